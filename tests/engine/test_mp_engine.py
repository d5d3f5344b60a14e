"""The engine in core processes, offline: ``LLM(multiprocess=True)`` gives the in-process outputs,
refuses what the in-process engine refuses, reports a dead core at once, and leaves no process behind.

Also the pieces on their own: the message codec, the output deltas and their accumulation, and the
prefix-aware router."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import psutil
import pytest

from helpers.processes import own_descendants
from pagedllm import LLM, SamplingParams
from pagedllm.engine.delta_outputs import OutputAccumulator
from pagedllm.engine.errors import EngineDeadError
from pagedllm.engine.proc.dp_router import PrefixRouter
from pagedllm.engine.proc.output_codec import OutputDecoder, encode_output
from pagedllm.engine.proc.protocol import AddRequest, Codec, CoreOutputs
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from pagedllm.sched.kv_cache_manager import KVCacheManager, prompt_block_hashes

ENGINE_ARGS: dict[str, Any] = {"max_model_len": 1024, "num_kv_blocks": 256}
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three colours:",
    "def fibonacci(n):",
]


def core_processes() -> list[psutil.Process]:
    """Engine-core processes started by this test process (alive ones)."""
    out = []
    for child in own_descendants():
        try:
            if (
                "pagedllm.engine.proc.core_process" in " ".join(child.cmdline())
                and child.status() != "zombie"
            ):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_no_cores(pids: list[int] | None = None, timeout: float = 15.0) -> None:
    """Wait until no engine-core process of this test process is left (of ``pids`` when given)."""

    def left() -> list[psutil.Process]:
        return [p for p in core_processes() if pids is None or p.pid in pids]

    deadline = time.monotonic() + timeout
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left(), "engine-core processes left behind"


def core_pids(llm: LLM) -> list[int]:
    return list(llm.llm_engine.cores.pids.values())  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def mp_llm() -> Iterator[LLM]:
    llm = LLM(multiprocess=True, **ENGINE_ARGS)
    yield llm
    llm.shutdown()
    wait_no_cores()


@pytest.fixture(scope="module")
def local_llm() -> LLM:
    return LLM(**ENGINE_ARGS)


def tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


# ------------------------------------------------------------------ the pieces


def test_codec_round_trips_requests_and_outputs() -> None:
    codec = Codec()
    params = SamplingParams(
        n=2,
        temperature=0.7,
        seed=3,
        stop=["\n"],
        logit_bias={5: -1.5},
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
    )
    message = AddRequest("r1", [1, 2, 3], sampling=params)
    decoded = codec.to_core.decode(codec.encode(message))
    assert decoded == message and isinstance(decoded.sampling, SamplingParams)
    assert decoded.sampling.logit_bias == {5: -1.5}
    embed = codec.to_core.decode(codec.encode(AddRequest("e", [4], pooling=PoolingParams(dimensions=8))))
    assert isinstance(embed, AddRequest) and embed.pooling == PoolingParams(dimensions=8)
    out = CoreOutputs(rank=1, core_time=2.0, accepted=["a"])
    assert codec.from_core.decode(codec.encode(out)) == out
    with pytest.raises(msgspec.ValidationError):  # a message of the other direction is refused
        codec.to_core.decode(codec.encode(out))


def test_deltas_rebuild_the_cumulative_outputs() -> None:
    """Delta outputs -> messages -> decoded and accumulated outputs gives back the cumulative
    snapshots, with each message carrying only what is new."""
    codec = Codec()
    texts = [["He", "Hello", "Hello wor", "Hello world"], ["A", "AB", "AB", "ABC"]]
    snapshots, deltas = [], []
    prompt_logprobs = [None, {9: Logprob(-1.0)}]
    for step in range(4):
        outs, news = [], []
        for i in range(2):
            ids = list(range(step + 1 + i))
            logprobs = [{t: Logprob(-0.5, 1, str(t))} for t in ids]
            done = "length" if step == 3 else None
            outs.append(CompletionOutput(i, texts[i][step], ids, -float(step), logprobs, done))
            old_ids = len(ids) - 1 if step else 0
            old_text = len(texts[i][step - 1]) if step else 0
            news.append(
                CompletionOutput(
                    i, texts[i][step][old_text:], ids[old_ids:], -float(step), logprobs[old_ids:], done
                )
            )
        snapshots.append(
            RequestOutput("r", "p", [9, 9], outs, finished=step == 3, prompt_logprobs=prompt_logprobs)
        )
        first = prompt_logprobs if step == 0 else None
        deltas.append(RequestOutput("r", "p", [9, 9], news, finished=step == 3, prompt_logprobs=first))
    decoder = OutputDecoder("p", [9, 9], OutputAccumulator(2))
    rebuilt = []
    for delta in deltas:
        message = codec.from_core.decode(codec.encode(CoreOutputs(0, 0.0, deltas=[encode_output(delta)])))
        (sent,) = message.deltas
        assert sum(len(c.token_ids) for c in sent.completions) <= 2 or delta is deltas[0]
        rebuilt.append(decoder.output(sent, offset=0.0))
    for want, got in zip(snapshots, rebuilt, strict=True):
        assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.logprobs for c in got.outputs] == [c.logprobs for c in want.outputs]
        assert got.finished == want.finished and got.prompt_logprobs == want.prompt_logprobs
    # Without an accumulator the front-end hands the deltas on as they came.
    plain = OutputDecoder("p", [9, 9], None).output(encode_output(deltas[1]), offset=0.0)
    assert [(c.text, c.token_ids) for c in plain.outputs] == [
        (c.text, c.token_ids) for c in deltas[1].outputs
    ]


def test_router_hashes_match_the_kv_cache_managers() -> None:
    """The front-end computes the block hashes a core's prefix cache registers."""
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    ids = list(range(100, 114))
    req = Request("r", ids, SamplingParams(), max_tokens=1, eos_token_ids=[0])
    assert manager.allocate_slots(req, len(ids))
    req.num_computed_tokens = len(ids)
    manager.pool.report_events = True
    manager.cache_full_blocks(req)
    added, removed = manager.pool.take_events()
    assert added == prompt_block_hashes(ids, 4) and len(added) == 3 and not removed
    manager.free(req)
    manager.reset_prefix_cache()
    assert sorted(manager.pool.take_events()[1]) == sorted(added)


def test_router_prefers_the_core_holding_the_prefix_then_the_least_loaded() -> None:
    router = PrefixRouter([0, 1], block_size=4)
    shared = list(range(1, 13))
    first = router.choose(shared + [50], {0: 0, 1: 0})
    router.routed(first, shared + [50])
    other = 1 - first
    # The same prefix follows the first request, even to the busier core.
    assert router.choose(shared + [60], {first: 5, other: 0}) == first
    # A new prefix goes to the least loaded core.
    assert router.choose([7, 7, 7, 7, 7, 7, 7, 7, 1], {first: 5, other: 0}) == other
    # Too busy: the prefix loses to the load.
    assert router.choose(shared + [70], {first: 100, other: 0}) == other
    # Evictions reported by the core drop its blocks from the index.
    router.remove(first, prompt_block_hashes(shared, 4))
    assert router.choose(shared + [80], {first: 3, other: 0}) == other
    # A dead core is forgotten; round robin ignores prefixes and takes turns.
    router.forget(first)
    assert router.choose(shared, {other: 0}) == other
    rr = PrefixRouter([0, 1], block_size=4, policy="round_robin")
    assert [rr.choose(shared, {0: 0, 1: 0}) for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="data_parallel_routing"):
        PrefixRouter([0], block_size=4, policy="random")


# ------------------------------------------------------------------ LLM(multiprocess=True)


def test_multiprocess_outputs_equal_in_process(mp_llm: LLM, local_llm: LLM) -> None:
    cases = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=24, stop=[".", "\n"], logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=16),
        SamplingParams(
            temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
        ),
    ]
    for params in cases:
        want = local_llm.generate(PROMPTS, params, use_tqdm=False)
        got = mp_llm.generate(PROMPTS, params, use_tqdm=False)
        assert tokens(got) == tokens(want), params
        for w, g in zip(want, got, strict=True):
            assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
            assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
            assert [c.stop_reason for c in g.outputs] == [c.stop_reason for c in w.outputs]
            assert g.prompt_token_ids == w.prompt_token_ids and g.prompt == w.prompt
            if params.logprobs:
                assert g.outputs[0].logprobs == w.outputs[0].logprobs
                assert g.prompt_logprobs == w.prompt_logprobs
    chat = [{"role": "user", "content": "Say hi."}]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    assert tokens(mp_llm.chat(chat, greedy, use_tqdm=False)) == tokens(
        local_llm.chat(chat, greedy, use_tqdm=False)
    )
    mp_llm.llm_engine.check_idle()


def run_each_kind(engine: Any, params: SamplingParams, kinds: list[RequestOutputKind]) -> dict[tuple, list]:
    """Every output of each prompt asked with each kind, all in one batch."""
    seen: dict[tuple, list[RequestOutput]] = {}
    for i, prompt in enumerate(PROMPTS[:2]):
        for kind in kinds:
            seen[i, kind] = []
            engine.add_request(f"{kind.name}-{i}", prompt, dataclasses.replace(params, output_kind=kind))
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id.rsplit("-", 1)[1])
            seen[i, RequestOutputKind[out.request_id.rsplit("-", 1)[0]]].append(out)
    return seen


def test_delta_outputs_add_up_to_the_cumulative_ones(mp_llm: LLM, local_llm: LLM) -> None:
    """DELTA outputs, in this process and from core processes, add up to the cumulative outputs
    (text, token ids, logprobs, cumulative logprob, finish): greedy and seeded sampling, two
    sequences, stop strings (whose possible beginnings are held back, never sent then taken back).
    Across processes cumulative outputs are added up from deltas by the front-end: they equal this
    process's."""
    stop = [", ", "the "]
    cases = [
        SamplingParams(temperature=0, n=2, max_tokens=20, stop=stop, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.9, seed=11, n=2, max_tokens=20, stop=stop, logprobs=2),
    ]
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA]
    stopped = set()
    for params in cases:
        by_engine = [run_each_kind(llm.llm_engine, params, kinds) for llm in (local_llm, mp_llm)]
        for seen in by_engine:
            for i in range(2):
                cumulative, deltas = seen[i, RequestOutputKind.CUMULATIVE], seen[i, RequestOutputKind.DELTA]
                acc = OutputAccumulator(params.n)
                for k, delta in enumerate(deltas):
                    assert delta.finished == (k == len(deltas) - 1)
                    assert (delta.prompt_logprobs is not None) == (
                        k == 0 and params.prompt_logprobs is not None
                    )
                    total = acc.add(delta)
                want = cumulative[-1]
                assert total.finished and want.finished
                assert [
                    (c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
                    for c in total.outputs
                ] == [
                    (c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
                    for c in want.outputs
                ]
                assert total.prompt_logprobs == want.prompt_logprobs
                finishes = [c.index for d in deltas for c in d.outputs if c.finish_reason is not None]
                assert sorted(finishes) == list(range(params.n)), "each sequence's finish comes once"
                stopped.update(c.stop_reason for c in want.outputs if isinstance(c.stop_reason, str))
        local, remote = by_engine
        for key in local:
            assert [c.token_ids for c in local[key][-1].outputs] == [
                c.token_ids for c in remote[key][-1].outputs
            ]
    assert stopped, "no case ended on a stop string"
    mp_llm.llm_engine.check_idle()


def test_multiprocess_refuses_bad_requests_and_stays_usable(mp_llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        mp_llm.generate([[1, 2, 10**7]], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        mp_llm.generate(["Hi", "there"], SamplingParams(max_tokens=5000), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        mp_llm.generate(["Hi"], SamplingParams(logprobs=1000), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        mp_llm.generate([""], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="does not embed"):
        mp_llm.llm_engine.add_request("x", "Hi", PoolingParams())
    # Nothing was left behind, and the engine still serves.
    mp_llm.llm_engine.check_idle()
    assert len(mp_llm.generate(["Hi"], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 4
    mp_llm.llm_engine.check_idle()


@pytest.mark.slow
def test_data_parallel_offline_matches_and_spreads(local_llm: LLM) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    want = local_llm.generate(prompts, greedy, use_tqdm=False)
    llm = LLM(multiprocess=True, data_parallel_size=2, **ENGINE_ARGS)
    pids = core_pids(llm)
    try:
        before = llm.llm_engine.wait_for_stats()
        got = llm.generate(prompts, greedy, use_tqdm=False)
        assert tokens(got) == tokens(want)
        llm.llm_engine.check_idle()
        after = llm.llm_engine.wait_for_stats()
        served = {r: after[r].prompt_tokens - before[r].prompt_tokens for r in after}
        assert set(served) == {0, 1} and all(n > 0 for n in served.values()), served
    finally:
        llm.shutdown()
    wait_no_cores(pids)


@pytest.mark.slow
def test_multiprocess_embeddings_equal_in_process() -> None:
    model = "sentence-transformers/all-MiniLM-L6-v2"
    texts = ["A cat sat on the mat.", "Paged attention stores keys in blocks."]
    want = [o.embedding for o in LLM(model, max_model_len=256).embed(texts, use_tqdm=False)]
    llm = LLM(model, multiprocess=True, max_model_len=256)
    pids = core_pids(llm)
    try:
        got = [o.embedding for o in llm.embed(texts, use_tqdm=False)]
        assert got == want
        llm.llm_engine.check_idle()
    finally:
        llm.shutdown()
    wait_no_cores(pids)


@pytest.mark.slow
def test_a_killed_core_fails_the_run_at_once_and_leaves_nothing() -> None:
    llm = LLM(multiprocess=True, **ENGINE_ARGS)
    [pid] = core_pids(llm)
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(str(i), f"Count to a thousand, {i}:", params)
    engine.step()  # running
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - killed < 2.0
    with pytest.raises(EngineDeadError):
        engine.add_request("late", "Hi", params)
    llm.shutdown()
    wait_no_cores([pid])


@pytest.mark.slow
def test_cores_stop_when_the_llm_is_collected() -> None:
    llm = LLM(multiprocess=True, **ENGINE_ARGS)
    pids = core_pids(llm)
    assert {p.pid for p in core_processes()} >= set(pids) and len(pids) == 1
    del llm
    gc.collect()
    wait_no_cores(pids)


def test_a_model_that_cannot_load_is_a_clear_error_and_leaves_nothing() -> None:
    before = {p.pid for p in core_processes()}
    with pytest.raises((ValueError, OSError), match="does not exist"):
        LLM("/nonexistent/model.gguf", multiprocess=True)
    assert {p.pid for p in core_processes()} <= before


def test_multiprocess_beam_search_equals_in_process(mp_llm: LLM, local_llm: LLM) -> None:
    from pagedllm.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=6)
    want = local_llm.beam_search(PROMPTS[:2], params)
    got = mp_llm.beam_search(PROMPTS[:2], params)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in want]
    mp_llm.llm_engine.check_idle()
