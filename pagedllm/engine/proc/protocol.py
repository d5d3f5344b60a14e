"""The messages between front-ends and engine-core processes, and their encoding.

Every message is a :mod:`msgspec` struct encoded as a msgpack array (field names are not sent) with
a type tag, so a front-end and a core decode exactly the types below and nothing else (no pickle).
Sampling and pooling parameters travel as the library's own dataclasses.

Front-end → core: :class:`AddRequest`, :class:`AbortRequests`, :class:`Welcome` (the reply to a
core's :class:`Hello`), :class:`Ping` (liveness), :class:`ResetPrefixCache`, :class:`EngineStateQuery`
(the dashboard's snapshot) and :class:`Shutdown`.
Core → front-end: :class:`Hello` (ready, with :class:`EngineInfo`), :class:`StartFailed`,
:class:`CoreOutputs` (one per loop iteration that has something to say, and a heartbeat at least
every few hundred milliseconds) and :class:`CoreDead`.

A request's ``priority`` (the ``priority`` scheduling policy's order) travels as a 64-bit integer:
:func:`check_wire_priority` refuses anything else before it is encoded, so that a core never meets a
message it cannot decode.

Outputs are deltas: a :class:`RequestDelta` is a ``DELTA`` output as the core's output processor made
it, carrying only what a request gained since the previous one (new text, token ids, logprobs); a
``FINAL_ONLY`` request's one output travels whole. The front-end adds deltas up only for callers that
want cumulative outputs (see :mod:`pagedllm.engine.proc.output_codec` and :mod:`pagedllm.engine.delta_outputs`).
"""

from __future__ import annotations

import msgspec

from pagedllm.engine.engine_checks import check_wire_priority
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.observe.step_events import StepRecord
from pagedllm.errors import RequestError, request_error
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import Logprob
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# -- front-end -> core ------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams | None = None  # a generate request
    pooling: PoolingParams | None = None  # an embed request
    priority: int = 0  # lower first, under the "priority" scheduling policy
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


def undecodable_request(raw: bytes, exc: Exception) -> tuple[str | None, str | None]:
    """For a message that failed to decode as :data:`ToCore` with ``exc``: the id of the request it
    carries, if it is an :class:`AddRequest` whose id can still be read, and the request field that
    ``exc`` names (``structured_outputs.json`` for ``$[3].structured_outputs.json``), if any."""
    try:
        items = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None, None
    if not (isinstance(items, list) and len(items) > 1 and items[0] == "add" and isinstance(items[1], str)):
        return None, None
    path = str(exc).rpartition(" - at `$")[2].rstrip("`")
    head, _, rest = path.partition("]")
    try:
        position = int(head.lstrip("[")) - 1  # element 0 is the type tag
        name = AddRequest.__struct_fields__[position]
    except (ValueError, IndexError):
        return items[1], None
    rest = rest.lstrip(".")
    if name in ("sampling", "pooling") and rest:
        return items[1], rest  # the parameters' own field names are the request's
    return items[1], name + rest if rest.startswith("[") or not rest else f"{name}.{rest}"


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    """Front-end 0's reply to a core's Hello: the addresses of every front-end, in index order."""

    frontend_addresses: list[str]


class Ping(msgspec.Struct, tag="ping", array_like=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """Forget every cached block (applied in order with the requests; refused by a core that is busy)."""


class EngineStateQuery(msgspec.Struct, tag="state", array_like=True):
    """Ask for the dashboard's snapshot (answered in ``CoreOutputs.state``, between two steps)."""

    query_id: int
    frontend: int = 0  # set by the core's I/O thread on arrival: the front-end that asked


ToCore = AddRequest | AbortRequests | Welcome | Ping | Shutdown | ResetPrefixCache | EngineStateQuery


# -- core -> front-end ------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", array_like=True):
    rank: int
    info: EngineInfo


class StartFailed(msgspec.Struct, tag="start_failed", array_like=True):
    rank: int
    reason: str


class Rejection(msgspec.Struct, array_like=True):
    """A refused request: the fields of the :class:`~pagedllm.errors.RequestError` the core raised,
    which the front-end raises again."""

    request_id: str
    param: str | None  # the request field at fault (None: none in particular)
    code: str | None  # None: an invalid request (400); "queue_full": the waiting queue is full (503)
    message: str


def rejection(request_id: str, error: RequestError) -> Rejection:
    """The message that refuses ``request_id`` with ``error``."""
    return Rejection(request_id, error.param, error.code, error.message)


def rejection_error(message: Rejection) -> RequestError:
    """The error a front-end raises for a rejection (the core's, typed as it was)."""
    return request_error(message.param, message.message, message.code)


class CompletionDelta(msgspec.Struct, array_like=True):
    """What one of a request's ``n`` sequences gained."""

    index: int
    text: str  # new visible text
    token_ids: list[int]  # new token ids
    logprobs: list[dict[int, Logprob]] | None  # new top logprobs (None: not asked for)
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    finished: bool
    num_cached_tokens: int
    completions: list[CompletionDelta]
    # Sent once, with the first delta that has them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # (arrival, first scheduled, first token, last token, finished) on the core's clock.
    times: tuple[float | None, float | None, float | None, float | None, float | None] | None = None


class EmbeddingResult(msgspec.Struct, array_like=True):
    request_id: str
    embedding: list[float]
    times: tuple[float | None, float | None, float | None, float | None, float | None] | None = None


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one core loop iteration has for one front-end (or a heartbeat)."""

    rank: int
    core_time: float  # the core's time.monotonic() when sent (to map its timestamps)
    accepted: list[str] = []
    rejected: list[Rejection] = []
    deltas: list[RequestDelta] = []
    embeddings: list[EmbeddingResult] = []
    stats: EngineStats | None = None
    token_intervals: list[float] = []  # seconds between successive tokens (for the latency histogram)
    cached_blocks: list[int] = []  # prefix-cache block hashes registered since the previous report
    evicted_blocks: list[int] = []  # and those dropped
    steps: list[StepRecord] = []  # the core's step records since the previous report (every front-end)
    state: tuple[int, bytes] | None = None  # (query id, snapshot JSON): the answer to an EngineStateQuery


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    rank: int
    reason: str


FromCore = Hello | StartFailed | CoreOutputs | CoreDead


class Codec:
    """Encoder and decoders of both directions (one per thread: msgspec encoders keep a buffer)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.to_core = msgspec.msgpack.Decoder(ToCore)
        self.from_core = msgspec.msgpack.Decoder(FromCore)

    def encode(self, message: ToCore | FromCore) -> bytes:
        return self.encoder.encode(message)


__all__ = [
    "AbortRequests",
    "AddRequest",
    "Codec",
    "CompletionDelta",
    "CoreDead",
    "CoreOutputs",
    "EmbeddingResult",
    "EngineInfo",
    "EngineStateQuery",
    "FromCore",
    "Hello",
    "Ping",
    "RequestDelta",
    "Rejection",
    "ResetPrefixCache",
    "Shutdown",
    "StartFailed",
    "ToCore",
    "Welcome",
    "check_wire_priority",
    "rejection",
    "rejection_error",
    "undecodable_request",
]
