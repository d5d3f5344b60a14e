"""Streamed responses are written from the engine's delta outputs: in both engine fronts (the engine
on a thread of the server, ``--no-multiprocess``, and in a core process, the default), what a stream
sends adds up to the response that is not streamed: text, tokens and their logprobs, finish reasons and
usage, for two prompts of two choices each, seeded sampling and stop strings."""

from __future__ import annotations

from typing import Any

import pytest

from helpers.server import SMALL_ENGINE_ARGS, RemoteServer

STOP = [", ", "the "]


def completions_match(client: Any, model: str) -> set[str]:
    """Streamed and unstreamed completions agree; returns the stop reasons seen."""
    kwargs: dict[str, Any] = dict(
        model=model,
        prompt=["Once upon a time", "The best thing about the sea is"],
        n=2,
        max_tokens=16,
        temperature=0.9,
        seed=5,
        stop=STOP,
        logprobs=2,
    )
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(
            stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kwargs
        )
    )
    text: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    token_logprobs: dict[int, list[float | None]] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert chunk.usage is not None  # continuous usage: in every chunk
        text[choice.index] = text.get(choice.index, "") + choice.text
        if choice.logprobs is not None:
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
            token_logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert len(full.choices) == 4
    for want in full.choices:
        assert text[want.index] == want.text
        assert tokens[want.index] == want.logprobs.tokens
        assert token_logprobs[want.index] == pytest.approx(want.logprobs.token_logprobs)
        assert finishes[want.index] == [want.finish_reason], "one finish per choice, in its last chunk"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and full.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    assert chunks[-2].usage.completion_tokens == full.usage.completion_tokens
    return {getattr(c, "stop_reason", None) for c in full.choices}


def chat_matches(client: Any, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model,
        messages=[{"role": "user", "content": "Describe the sea in one sentence."}],
        n=2,
        max_tokens=16,
        temperature=0,
        stop=STOP,
        logprobs=True,
        top_logprobs=1,
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
        if choice.logprobs is not None:
            tokens.setdefault(choice.index, []).extend(t.token for t in choice.logprobs.content)
        if choice.finish_reason is not None:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    for want in full.choices:
        assert text[want.index] == want.message.content
        assert tokens[want.index] == [t.token for t in want.logprobs.content]
        assert finishes[want.index] == [want.finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.parametrize(
    "front",
    [pytest.param(["--no-multiprocess"], marks=pytest.mark.slow), []],
    ids=["engine-thread", "core-process"],
)
def test_streams_add_up_to_the_unstreamed_responses(front: list[str]) -> None:
    with RemoteServer([*SMALL_ENGINE_ARGS, *front]) as srv:
        client = srv.client()
        model = client.models.list().data[0].id
        assert completions_match(client, model) & set(STOP), "no choice ended on a stop string"
        chat_matches(client, model)
