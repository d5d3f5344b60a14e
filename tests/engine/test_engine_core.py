"""The engine core's way in, on a scripted engine (no model): every request is answered once, a full
waiting queue and a slow or failing grammar are refused with typed errors, an abort drops a request
whose grammar is compiling, and the typed errors become the same OpenAI error objects wherever they
were raised (in this process or carried over the core-process protocol)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from pagedllm.engine.engine_core import AbortCommand, AddCommand, EngineCore, EngineOutput, StopCommand
from pagedllm.engine.errors import QueueFullError, RequestError
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.proc.protocol import Codec, CoreOutputs, rejection, rejection_error
from pagedllm.entrypoints.openai.serving_engine import error_from_exception
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


class _Grammars:
    """Compiles ``regex`` grammars: "slow" takes ``delay`` seconds, "bad" fails."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.release = threading.Event()

    def compile(self, params: StructuredOutputsParams) -> object:
        if params.regex == "bad":
            raise RequestError("structured_outputs", "structured_outputs.regex: invalid regex: bad")
        if params.regex == "slow":
            self.release.wait(self.delay)
        return object()


class _Engine:
    """Each request waits one step, then finishes with one token."""

    model_name = "scripted"
    max_model_len = 64
    vocab_size = 256
    tokenizer = None

    def __init__(self, delay: float = 5.0) -> None:
        self.grammars = _Grammars(delay)
        self.waiting: list[str] = []
        self.added: list[str] = []

    @property
    def structured_output_manager(self) -> _Grammars:
        return self.grammars

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        arrival_time: Any = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> None:
        if lora_request is not None:
            raise RequestError("lora_request", "this engine has no adapters.")
        if not prompt:
            raise RequestError("prompt", "prompt must not be empty.")
        self.waiting.append(request_id)
        self.added.append(request_id)

    def step(self) -> list[RequestOutput]:
        done, self.waiting = self.waiting, []
        return [
            RequestOutput(r, None, [1], [CompletionOutput(0, "a", [97], None, None, "length")], True)
            for r in done
        ]

    def step_pooling(self) -> list[Any]:
        return []

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.waiting = [r for r in self.waiting if r not in ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def get_stats(self) -> EngineStats:
        return EngineStats(num_waiting=len(self.waiting))

    def pop_token_intervals(self) -> list[float]:
        return []


class _Answers:
    """The core's transport: records what each request was told."""

    def __init__(self) -> None:
        self.taken: list[str] = []
        self.refused: dict[str, BaseException] = {}
        self.finished: list[str] = []

    def accepted(self, request_id: str) -> None:
        self.taken.append(request_id)

    def rejected(self, request_id: str, exc: BaseException) -> None:
        assert request_id not in self.refused
        self.refused[request_id] = exc

    def outputs(self, outputs: Sequence[EngineOutput]) -> None:
        self.finished += [o.request_id for o in outputs if o.finished]

    def aborted(self, request_ids: list[str]) -> None:
        pass

    def iteration_done(self, stats: EngineStats, *, stepped: bool) -> None:
        pass


def _core(engine: _Engine, answers: _Answers, **kwargs: Any) -> tuple[EngineCore, threading.Thread]:
    core = EngineCore(engine, answers, idle_wait=0.05, **kwargs)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    return core, thread


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _grammar(regex: str) -> SamplingParams:
    return SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(regex=regex))


def test_admission_answers_each_request_once_with_typed_refusals() -> None:
    engine, answers = _Engine(delay=5.0), _Answers()
    core, thread = _core(engine, answers, max_queued_requests=2, grammar_compile_timeout=0.3)
    try:
        for rid, prompt, params in [
            ("empty", [], SamplingParams(max_tokens=1)),  # refused by the engine: queues nothing
            ("a", [1], SamplingParams(max_tokens=1, n=2)),  # two sequences: the queue is full
            ("b", [1], SamplingParams(max_tokens=1)),
            ("bad", [1], _grammar("bad")),
            ("slow", [1], _grammar("slow")),
            ("gone", [1], _grammar("slow")),
        ]:
            core.submit(AddCommand(rid, prompt, params))
        core.submit(AbortCommand(["gone"]))
        _wait(lambda: len(answers.taken) + len(answers.refused) == 5)
        assert answers.taken == ["a"]
        full = answers.refused["b"]
        assert isinstance(full, QueueFullError) and "adds 1 (max_queued_requests=2)" in str(full)
        empty, bad = answers.refused["empty"], answers.refused["bad"]
        assert isinstance(empty, RequestError) and isinstance(bad, RequestError)
        assert (empty.param, bad.param) == ("prompt", "structured_outputs")
        slow = answers.refused["slow"]
        assert isinstance(slow, RequestError) and "longer than 0.3 s" in slow.message
        assert "gone" not in engine.added
        _wait(lambda: answers.finished == ["a"])
        engine.grammars.release.set()
        time.sleep(0.2)  # the late compilations end: neither request is answered again
        assert len(answers.taken) + len(answers.refused) == 5
    finally:
        engine.grammars.release.set()
        core.submit(StopCommand())
        thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    ("error", "status", "kind", "param", "code"),
    [
        (QueueFullError("The server is overloaded."), 503, "server_error", None, "queue_full"),
        (
            RequestError("structured_outputs", "structured_outputs: x"),
            400,
            "invalid_request_error",
            "response_format",
            None,
        ),
        (
            RequestError(
                "prompt", "This model's maximum context length is 8 tokens.", "context_length_exceeded"
            ),
            400,
            "invalid_request_error",
            "messages",
            "context_length_exceeded",
        ),
    ],
)
def test_typed_errors_cross_the_protocol_and_become_one_error_object(
    error: RequestError, status: int, kind: str, param: str | None, code: str | None
) -> None:
    codec = Codec()
    message = codec.from_core.decode(codec.encode(CoreOutputs(0, 0.0, rejected=[rejection("r", error)])))
    assert isinstance(message, CoreOutputs)
    again = rejection_error(message.rejected[0])
    assert type(again) is type(error) and (again.param, again.code, again.message) == (
        error.param,
        error.code,
        error.message,
    )
    aliases = {"structured_outputs": "response_format", "prompt": "messages"}
    for raised in (error, again):
        body = error_from_exception(raised, aliases)
        assert (body.status_code, body.type, body.param, body.code, body.message) == (
            status,
            kind,
            param,
            code,
            error.message,
        )
