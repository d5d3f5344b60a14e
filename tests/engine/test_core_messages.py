"""An engine-core process survives whatever a front-end sends it.

The test plays front-end 0 of a real core process (the default model): it answers the core's Hello,
then sends every message type the core takes, once as it should be and then with each field (and
each field of the sampling, pooling and structured-output parameters inside a request) replaced by
values of other types, generated from the message structs themselves. A request the core cannot
decode, or whose parameters it refuses, is refused alone (a rejection naming the field, which the
front-end answers with a 400); other messages it cannot read are dropped. Afterwards the core is
alive, answers a greedy request with the same tokens as before, holds no KV block for a request, and
exits 0 when told to.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.engine.proc.launch import CoreOptions, LocalCores, start_local_cores
from pagedllm.engine.proc.protocol import (
    AbortRequests,
    AddRequest,
    Codec,
    CoreOutputs,
    EngineStateQuery,
    Hello,
    Ping,
    ResetPrefixCache,
    Welcome,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.utils import free_port_range

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [1, 504, 3458, 282, 4649, 314]  # "The capital of France is" and friends: any in-vocabulary ids
# One value of each msgpack type; a field gets every one whose type differs from its valid value's.
WRONG_VALUES: list[Any] = [None, True, -7, 2.5, "x", [], [1, "a"], {}, {"k": 1}, b"\x00\x01"]
WAIT_S = 120.0


def kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


def wrong_values(valid: Any) -> list[Any]:
    return [v for v in WRONG_VALUES if kind(v) != kind(valid)]


class FrontEnd:
    """Front-end 0 of one core: a ROUTER socket that greets the core, sends raw payloads, collects
    the core's answers and pings it (a core with no word from its front-ends exits)."""

    def __init__(self) -> None:
        self.address = f"tcp://127.0.0.1:{free_port_range('127.0.0.1', 1)}"
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.address)
        self.codec = Codec()
        self.identity = b""
        self.accepted: set[str] = set()
        self.rejected: dict[str, str] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.embedded: set[str] = set()
        self.stats: EngineStats | None = None
        self.last_ping = 0.0

    def greet(self, timeout: float) -> None:
        assert self.sock.poll(int(timeout * 1000)), "the core did not say Hello"
        self.identity, payload = self.sock.recv_multipart()
        assert isinstance(self.codec.from_core.decode(payload), Hello)
        self.sock.send_multipart([self.identity, self.codec.encode(Welcome([self.address]))])

    def send_raw(self, payload: bytes) -> None:
        self.sock.send_multipart([self.identity, payload])

    def send(self, message: Any) -> None:
        self.send_raw(self.codec.encode(message))

    def pump(self, seconds: float) -> None:
        """Read the core's messages for ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            if now - self.last_ping > 1.0:
                self.send(Ping())
                self.last_ping = now
            left = deadline - now
            if left <= 0:
                return
            if not self.sock.poll(int(min(left, 0.2) * 1000)):
                continue
            _, payload = self.sock.recv_multipart()
            message = self.codec.from_core.decode(payload)
            if not isinstance(message, CoreOutputs):
                raise AssertionError(f"the core sent {message!r}")
            self.accepted.update(message.accepted)
            self.rejected.update({r.request_id: r.message for r in message.rejected})
            for delta in message.deltas:
                self.tokens.setdefault(delta.request_id, []).extend(
                    t for c in delta.completions for t in c.token_ids
                )
                if delta.finished:
                    self.finished.add(delta.request_id)
            self.embedded.update(e.request_id for e in message.embeddings)
            if message.stats is not None:
                self.stats = message.stats

    def wait_for(self, predicate: Any, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "the core did not answer in time"
            self.pump(0.2)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def core() -> Iterator[tuple[FrontEnd, LocalCores]]:
    front = FrontEnd()
    config = EngineConfig(max_model_len=64, num_kv_blocks=64, max_num_seqs=16)
    cores = start_local_cores(config, [0], CoreOptions(rank=0, frontend_address=front.address))
    try:
        front.greet(timeout=240.0)
        yield front, cores
    finally:
        cores.stop(timeout=10.0)
        front.close()
    assert not cores.any_alive()


def builtins_of(message: Any) -> list[Any]:
    """A message as msgpack sees it: ``[tag, field, ...]`` with parameters as maps."""
    items = msgspec.msgpack.decode(msgspec.msgpack.encode(message))
    assert isinstance(items, list)
    return items


def mutations(message: Any) -> Iterator[tuple[str, Any, list[Any]]]:
    """(field path, value, message items) for each field of ``message`` (and of the parameter maps inside)
    replaced by each value of another type; the type tag too."""
    items = builtins_of(message)
    for value in wrong_values(items[0]):
        yield "tag", value, [value, *items[1:]]
    names = type(message).__struct_fields__
    for position, name in enumerate(names, start=1):
        valid = items[position]
        for value in wrong_values(valid):
            changed = list(items)
            changed[position] = value
            yield name, value, changed
        if isinstance(valid, dict):
            for key, inner in valid.items():
                for value in wrong_values(inner):
                    changed = list(items)
                    changed[position] = {**valid, key: value}
                    yield f"{key}", value, changed
                if isinstance(inner, dict):
                    for sub, sub_valid in inner.items():
                        for value in wrong_values(sub_valid):
                            changed = list(items)
                            changed[position] = {**valid, key: {**inner, sub: value}}
                            yield f"{key}.{sub}", value, changed


def greedy(max_tokens: int = 4, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_core_survives_every_message_with_fields_of_the_wrong_type(core: tuple[FrontEnd, LocalCores]) -> None:
    front, cores = core
    front.send(AddRequest("before", PROMPT, sampling=greedy(6)))
    front.wait_for(lambda: "before" in front.finished)
    reference = front.tokens["before"]
    assert len(reference) == 6

    # Valid examples of every message the core takes (Shutdown last, on its own).
    json_params = greedy(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    examples: list[Any] = [
        AddRequest("gen", PROMPT, sampling=greedy(2, stop=["\n"], logit_bias={5: -1.0}), priority=0),
        AddRequest("json", PROMPT, sampling=json_params),
        AddRequest(
            "choice", PROMPT, sampling=greedy(structured_outputs=StructuredOutputsParams(choice=["a"]))
        ),
        AddRequest("embed", PROMPT, pooling=PoolingParams(dimensions=8, normalize=True)),
        AbortRequests(["nobody"]),
        EngineStateQuery(1),
        ResetPrefixCache(),
        Ping(),
        Welcome([front.address]),
    ]
    sent_requests: dict[str, str] = {}  # request id -> the field changed
    given: dict[str, Any] = {}  # request id -> the value it was given
    count = 0
    for example in examples:
        for field_path, value, items in mutations(example):
            if isinstance(example, AddRequest) and isinstance(items[1], str) and field_path != "request_id":
                rid = f"m{count}-{field_path}"
                items = [items[0], rid, *items[2:]]
                if items[0] == "add":
                    sent_requests[rid] = field_path
                    given[rid] = value
            front.send_raw(msgspec.msgpack.encode(items))
            count += 1
            if count % 25 == 0:
                front.pump(0.05)
                assert cores.exitcode(0) is None, f"the core exited after a message changing {field_path}"
    assert count > 300, count  # every field of every message, a few values each

    # Every request the core could identify was answered: refused (naming what it could not take),
    # or accepted and run to its end (a value of another type that is still valid, such as a string
    # for a string, or an embed request refused by a generate engine).
    front.wait_for(lambda: all(r in front.rejected or r in front.finished for r in sent_requests))
    assert cores.exitcode(0) is None
    refused = {rid: front.rejected[rid] for rid in sent_requests if rid in front.rejected}
    assert len(refused) > 0.8 * len(sent_requests)
    named = [rid for rid, message in refused.items() if sent_requests[rid].split(".")[-1] in message]
    assert len(named) > 0.5 * len(refused), list(refused.items())[:10]
    # The case that once stopped the core: a schema that is a number.
    undecodable = next(
        r for r, p in sent_requests.items() if p == "structured_outputs.json" and given[r] == -7
    )
    assert refused[undecodable].startswith("structured_outputs.json: "), refused[undecodable]

    # Still serving, with the same greedy tokens, and no request holds a block.
    front.send(AddRequest("after", PROMPT, sampling=greedy(6)))
    front.wait_for(lambda: "after" in front.finished)
    assert front.tokens["after"] == reference
    front.pump(0.5)
    stats = front.stats
    assert stats is not None and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0

    from pagedllm.engine.proc.protocol import Shutdown

    front.send(Shutdown())
    deadline = time.monotonic() + 30
    while cores.exitcode(0) is None and time.monotonic() < deadline:
        front.pump(0.2)
    assert cores.exitcode(0) == 0


def test_mutations_cover_nested_parameters() -> None:
    """The generator reaches the fields inside a request's parameters, not only the message's own."""
    params = greedy(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    paths = {path for path, _, _ in mutations(AddRequest("r", PROMPT, sampling=params))}
    sampling_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {"request_id", "prompt_token_ids", "sampling", "priority"} <= paths
    assert sampling_fields - {"all_stop_token_ids"} <= paths
    assert {"structured_outputs.json", "structured_outputs.regex", "structured_outputs.after"} <= paths
