"""Draft-model speculative decoding in the engine: greedy tokens identical with and without a draft
(a noisy copy of a tiny target, which agrees often but not always, so drafts are both accepted and
rolled back), alone and in batches, with chunked prefill, prefix caching and preemption; every draft
accepted when the draft is the target itself; sampled tokens keeping their distribution; a draft
pool too small for every request; refused drafts (vocabulary, tokenizer, path) naming the field;
the draft's state freed after finished and aborted requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import pagedllm.worker.draft_model as draft_model
from helpers.model_factory import make_tiny_hf_model
from helpers.prompts import PROMPTS as TEXT_PROMPTS
from helpers.spec_cases import (
    VOCAB16,
    chi2_homogeneity_pvalue,
    generated_tokens,
    noisy_copy,
    sampled_token_counts,
    with_config,
)
from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import main
from pagedllm.request import Request
from pagedllm.worker.draft_model import DraftModelProposer, draft_kv_blocks

K = 4
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# Different lengths: four share a system prompt (prefix-cache hits), one is several times longer
# than the 32-token step budget below (chunked prefill of the target and of the draft).
PROMPTS = [*TEXT_PROMPTS[:7], TEXT_PROMPTS[0] * 3]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny target, a noisy copy of it (the draft), and a draft whose config says another vocabulary."""
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_hf_model(root / "target", "llama", initializer_range=0.3)
    return {
        "target": target,
        "draft": noisy_copy(target, str(root / "noisy"), noise=0.02),
        "vocab": with_config(target, str(root / "vocab"), vocab_size=49153),
    }


def spec(path: str, k: int = K) -> dict[str, Any]:
    return {"model": path, "num_speculative_tokens": k}


def engine(target: str, draft: str | None, **kwargs: Any) -> LLM:
    """The target in float32 with ``draft`` as its draft model (None: no speculation)."""
    args: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 256, **kwargs}
    return LLM(target, speculative_config=None if draft is None else spec(draft), **args)


def run(llm: LLM, prompts: list[Any], one_by_one: bool = False) -> list[list[int]]:
    return generated_tokens(llm, GREEDY, prompts, one_by_one)


def proposer_of(llm: LLM) -> DraftModelProposer:
    proposer = llm.llm_engine.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


_plain: dict[str, list[list[int]]] = {}


def plain_tokens(target: str) -> list[list[int]]:
    if target not in _plain:
        llm = engine(target, None)
        _plain[target] = run(llm, PROMPTS)
        llm.shutdown()
    return _plain[target]


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"num_kv_blocks": 256, "max_num_batched_tokens": 32}, id="chunked"),
        # A target pool too small for every request at once: preemption (the draft state of a
        # preempted request is dropped and rebuilt).
        pytest.param({"num_kv_blocks": 14, "max_num_batched_tokens": 48}, id="chunked-preempted"),
    ],
)
def test_greedy_tokens_equal_plain_decoding(models: dict[str, str], engine_args: dict[str, Any]) -> None:
    reference = plain_tokens(models["target"])
    llm = engine(models["target"], models["draft"], **engine_args)
    proposer = proposer_of(llm)
    calls: list[int] = []  # batch size of each proposal
    original = proposer.propose_all

    def counted(requests: list[Request]) -> list[list[int]]:
        calls.append(len(requests))
        return original(requests)

    proposer.propose_all = counted  # type: ignore[method-assign]
    assert run(llm, PROMPTS) == reference
    stats = llm.llm_engine.get_stats()
    # Some drafts accepted, some rolled back.
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
    if engine_args["num_kv_blocks"] == 14:
        assert stats.num_preemptions > 0, "the pool did not force preemption"
    else:
        # Batched: one draft forward per draft position for the whole batch (plus the chunks of
        # prompts longer than the step budget), not one per request.
        assert max(calls) > 1
        assert proposer.num_draft_steps <= len(calls) * K + 8, (proposer.num_draft_steps, len(calls))
    # One request at a time, the target's prefix cache warm from the batch above.
    assert run(llm, PROMPTS[:3], one_by_one=True) == reference[:3]
    if engine_args["num_kv_blocks"] == 256:
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    llm.shutdown()


def test_target_as_its_own_draft_accepts_every_draft(models: dict[str, str]) -> None:
    llm = engine(models["target"], models["target"])
    assert run(llm, PROMPTS[4:8]) == plain_tokens(models["target"])[4:8]
    stats = llm.llm_engine.get_stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens, stats
    # Every request but the last steps of each (capped by max_tokens) verified K drafts a step.
    assert stats.spec_draft_tokens > 0.8 * K * stats.spec_drafts
    llm.shutdown()


def test_sampled_tokens_keep_their_distribution(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Temperature 1 over a 16-token vocabulary, with a noisy copy of the target as the draft: its
    greedy drafts are verified by rejection sampling (part accepted), and the token at output
    position 10 has the same distribution with and without speculation (chi-square, significance
    0.001, 1,200 seeded requests each)."""
    root = tmp_path_factory.mktemp("vocab16")
    path = make_tiny_hf_model(root / "target", "llama", **VOCAB16)
    draft = noisy_copy(path, str(root / "draft"), noise=0.1)
    plain, _ = sampled_token_counts(path, None)
    counts, stats = sampled_token_counts(path, spec(draft, 3))
    assert stats.spec_draft_tokens > 3000 and 1000 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert chi2_homogeneity_pvalue(plain, counts) > 0.001, (plain, counts)


def test_a_draft_pool_without_room_gives_no_drafts(
    models: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft pool of 6 blocks holds about one request: the others get no drafts, and the tokens
    are still those of plain decoding."""
    monkeypatch.setattr(draft_model, "draft_kv_blocks", lambda *args: 6)
    llm = engine(models["target"], models["draft"])
    assert proposer_of(llm).kv_cache_manager.pool.num_blocks == 6
    assert run(llm, PROMPTS) == plain_tokens(models["target"])
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_drafts < stats.generation_tokens / 2, stats
    llm.shutdown()


def test_aborted_and_finished_requests_free_the_draft_state(models: dict[str, str]) -> None:
    llm = engine(models["target"], models["draft"])
    core = llm.llm_engine
    proposer = proposer_of(llm)
    for i, prompt in enumerate(PROMPTS[:4]):
        params = SamplingParams(temperature=0, max_tokens=30 + 10 * i, ignore_eos=True)
        core.add_request(f"r{i}", prompt, params)
    for _ in range(4):
        core.step()
    assert set(proposer.states) == {"r0", "r1", "r2", "r3"}
    assert proposer.kv_cache_manager.num_free_blocks < proposer.kv_cache_manager.pool.num_blocks
    core.abort_request("r1")
    core.step()  # the next proposal sweeps the aborted request's state
    assert "r1" not in proposer.states
    core.abort_request(["r2"])
    while core.has_unfinished_requests():
        core.step()
    core.check_idle()  # sweeps r2 (aborted) and the finished ones, then checks the pool
    assert not proposer.states
    # The ids may be used again: a fresh request gets a fresh draft state.
    core.add_request("r1", PROMPTS[1], GREEDY)
    while core.has_unfinished_requests():
        core.step()
    core.check_idle()
    llm.shutdown()


def test_a_draft_with_another_vocabulary_is_refused_before_it_loads(
    models: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args: Any) -> None:
        raise AssertionError("the draft's weights were loaded")

    monkeypatch.setattr(draft_model.DraftExecutor, "__init__", no_load)
    with pytest.raises(ValueError, match=r"speculative_config\.model .*49153 tokens.*49152"):
        engine(models["target"], models["vocab"])


def test_a_draft_with_another_tokenizer_is_refused(models: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "tokenizer"
    draft = with_config(models["target"], str(folder))
    tokenizer = AutoTokenizer.from_pretrained(draft)
    tokenizer.add_tokens(["<draft-only>"])
    tokenizer.save_pretrained(draft)
    with pytest.raises(ValueError, match=r"speculative_config\.model .*another tokenizer"):
        engine(models["target"], draft)


def test_a_missing_draft_is_refused(models: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.model .*cannot be loaded"):
        engine(models["target"], str(tmp_path / "none"))


def test_draft_pool_size() -> None:
    # The target's 100 blocks, plus (cdiv(4, 16) + 1) = 2 blocks for each of 8 requests.
    assert draft_kv_blocks(100, 8, 4, 16, 2048) == 116
    # Never more than 8 requests of 64 + 4 tokens (5 blocks each) need.
    assert draft_kv_blocks(100, 8, 4, 16, 64) == 40
    # No more requests run than the target has blocks: 3 of them, 2 more blocks each.
    assert draft_kv_blocks(3, 8, 4, 16, 2048) == 9


def test_requests_the_cap_rules_out_get_no_drafts(models: dict[str, str]) -> None:
    """Logprobs, a penalty, and the last token before max_tokens: no drafts, no draft state."""
    llm = engine(models["target"], models["draft"], num_kv_blocks=64)
    proposer = proposer_of(llm)
    tokens = [5, 6, 7, 8]
    asks = [
        SamplingParams(temperature=0, max_tokens=8, logprobs=1),
        SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=3),
    ]
    requests = []
    for i, params in enumerate(asks):
        request = Request(f"x{i}", tokens, params, max_tokens=params.max_tokens or 8, eos_token_ids=[2])
        for token in (9, 10):
            request.append_output_token(token)
        requests.append(request)
    assert proposer.propose_all(requests) == [[], [], []]
    assert [r.spec_token_ids for r in requests] == [[], [], []]  # a proposer writes no request
    assert not proposer.states
    llm.shutdown()


@pytest.mark.slow
def test_bench_spec_with_a_draft_model(models: dict[str, str], tmp_path: Path) -> None:
    """``pagedllm bench spec`` with a draft model: same greedy tokens, acceptance reported."""
    out = tmp_path / "spec.json"
    args = ["bench", "spec", "--model", models["target"], "--dtype", "float32", "--max-model-len", "512"]
    args += ["--output-len", "12", "--concurrency", "16", "--no-warmup"]
    args += ["--spec", json.dumps(spec(models["draft"])), "--output-json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    stats = data["spec_stats"]
    assert data["same_tokens"] == 16 and 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    assert data["acceptance_rate"] == stats["accepted_tokens"] / stats["draft_tokens"]


def test_bench_spec_refuses_a_missing_draft_before_running(tmp_path: Path) -> None:
    missing = json.dumps(spec(str(tmp_path / "none")))
    assert main(["bench", "spec", "--spec", missing, "--model", str(tmp_path / "also-none")]) == 2
