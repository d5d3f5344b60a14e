"""``--max-step-time-ms`` through a real server, in both engine fronts: the engine on a thread of the
server (``--no-multiprocess``) and in a core process (the default)."""

from __future__ import annotations

import threading

import pytest

from helpers.server import SMALL_ENGINE_ARGS, RemoteServer

KEY = "step-budget-key"
PROMPT_TOKENS = 700


@pytest.mark.slow
@pytest.mark.parametrize("front", [["--no-multiprocess"], []], ids=["engine-thread", "core-process"])
def test_the_step_budget_chunks_a_long_prompt_in_every_front(front: list[str]) -> None:
    """The server reports the target, and a long prompt that arrives while a stream decodes is
    computed in several steps beside the stream's decodes (the budget starts at four blocks and grows
    from what it measures); the greedy tokens are those of a prompt computed in one step (checked by
    the engine tests)."""
    args = [*SMALL_ENGINE_ARGS, *front, "--max-step-time-ms", "150"]
    with RemoteServer(args, api_key=KEY) as srv:
        client = srv.client()
        model = client.models.list().data[0].id
        started = threading.Event()
        streamed: list[str] = []

        def stream() -> None:
            chunks = client.completions.create(
                model=model,
                prompt="Once upon a time",
                max_tokens=120,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in chunks:
                streamed.append(chunk.choices[0].text if chunk.choices else "")
                started.set()

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        assert started.wait(60), "the stream started"
        prompt = [1000 + (i * 37) % 20000 for i in range(PROMPT_TOKENS)]
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        streamer.join(120)
        assert not streamer.is_alive() and len(streamed) >= 100
        state = srv.get("/v1/engine/state?steps=1000").json()
        assert state["config"]["max_step_time_ms"] == 150.0
        finished = [f for f in state["finished"] if f["prompt_tokens"] == PROMPT_TOKENS]
        assert len(finished) == 1
        rid = finished[0]["request_id"]
        steps = [
            s["scheduled"]
            for s in state["steps"]
            if any(r == rid and k == "prefill" for r, _, k in s["scheduled"])
        ]
        chunks = [n for scheduled in steps for r, n, k in scheduled if r == rid and k == "prefill"]
        assert sum(chunks) == PROMPT_TOKENS and len(chunks) >= 2, chunks
        assert all(any(k == "decode" for _, _, k in scheduled) for scheduled in steps), "beside the stream"
        srv.wait_idle(timeout=30)
    assert srv.proc is not None and srv.proc.poll() is not None, "the server is gone"


def test_a_bad_target_stops_the_server_with_the_field_named() -> None:
    srv = RemoteServer([*SMALL_ENGINE_ARGS, "--max-step-time-ms", "-5"], startup_timeout=60)
    try:
        with pytest.raises(RuntimeError, match="max_step_time_ms must be a number of milliseconds >= 0"):
            srv.start()
    finally:
        srv.stop()
    assert srv.proc is not None and srv.proc.poll() is not None, "the server is gone"
