"""``pagedllm bench prefix-routing``: prefix-cache hit rate of data-parallel routing policies.

Measured: the prefix-cache hit rate (prompt tokens found cached / prompt tokens looked up, summed over
the engine cores) of the same workload run by

* ``one core``: one engine-core process (``multiprocess=True, data_parallel_size=1``);
* ``dp2 prefix``: two cores, each request routed to the core that holds the longest prefix of its
  prompt (``data_parallel_routing="prefix"``);
* ``dp2 round-robin``: two cores, requests dealt out in turn, prefixes ignored;
* ``one core 2x KV`` (``--double-kv-reference``, on by default): one core with twice the KV blocks,
  i.e. the KV capacity of the two cores together in one cache, for context.

The workload (``--groups`` x ``--per-group`` requests, seeded by ``--seed``): each group has its own
system prompt of ``--system-len`` random token ids and each request is its group's system prompt
followed by its own random user suffix of ``--user-len`` tokens, asking for ``--output-len`` tokens
(greedy, EOS ignored). Token ids are drawn from the tokenizer's vocabulary without its special ids.
The requests arrive interleaved in a seeded random order and all at once (one ``LLM.generate``
call). The order is shuffled rather than strictly cyclic (g0, g1, ..., g7, g0, ...): with two cores
and an even number of groups, a cyclic order would deal every request of a group to the same core
under round-robin, giving it perfect group affinity by accident.

Why routing matters here: the KV cache of each core is kept small (``--num-kv-blocks``, default 160
blocks of 16 tokens, with ``--max-num-seqs`` 8). The default 8 system prompts of 512 tokens take
8 x 32 = 256 blocks, so one core cannot keep every group's prefix: a group's blocks are evicted by
the others' before its next request comes, and the prefix is computed again. Two cores with prefix
routing hold 4 groups each (128 blocks, plus 3 blocks of its own for each of the 8 running
requests: 152), which fits. Round-robin makes each core see all 8 groups, so each core is in the
one-core situation again, with half the requests. The gain of prefix routing
is therefore effective cache capacity, i.e. prompt tokens not computed again. The goals: prefix
routing's hit rate at least 0.90 of one core's and at least 1.5 times round-robin's. With the default
sizes the best any routing can do is 15 of every group's 16 requests finding their whole system
prompt cached, 8 x 15 x 512 / (128 x 544) = 88.2 %.

Also reported per run: wall time and output tokens/s of the ``generate`` call (model loading and a
short warm-up outside it), prompt tokens computed, preemptions, and per core the requests it served
(its generated tokens / ``--output-len``) and its own hit rate. Each run has its own ``LLM``, shut
down before the next starts. The times say little when the cores of the processes share fewer CPU
cores than they have threads; the hit rates depend on the machine only through the timing of the
requests' arrival at the cores.

Routing decides where a request runs, not what it produces, so the greedy outputs (the token ids of
every request) are compared with the first run's, request by request: identical, a near-tie flip (at
the first differing position each run's token is among the other's top ``TOP_LOGPROBS`` tokens: a
prompt computed in one piece or after a cached prefix, in another batch, can give slightly different
floating-point results, enough to swap two tokens of almost equal probability; prompts of random
tokens give flat distributions where such ties are common), or a mismatch (anything else: a fault).
For near ties the largest log-probability gap between the two tokens in the first run's distribution
is reported. The exit status is 0 whether or not the goals are met.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.engine.observe.stats import EngineStats
from pagedllm.sampling_params import SamplingParams
from pagedllm_bench.common import (
    add_run_args,
    format_table,
    machine_info,
    now_iso,
    ratio,
    run_at_log_level,
    set_num_threads,
    write_json,
)
from pagedllm_bench.hf_reference import greedy_compare
from pagedllm_bench.workloads import BenchRequest, Workload, random_ids, token_pool

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

logger = logging.getLogger("pagedllm_bench")

# Goals: prefix routing's hit rate over one core's, and over round-robin's.
GOAL_VS_ONE_CORE = 0.90
GOAL_VS_ROUND_ROBIN = 1.5

ONE_CORE = "one core"
PREFIX = "dp2 prefix"
ROUND_ROBIN = "dp2 round-robin"
ONE_CORE_DOUBLE_KV = "one core 2x KV"

# Top log-probabilities kept per generated token, to tell near-tie flips from mismatches.
TOP_LOGPROBS = 5

# Length of the warm-up prompts: under one block, so they leave no full block in the prefix caches.
WARMUP_PROMPT_LEN = 8


@dataclass
class GroupedWorkload(Workload):
    """Requests in arrival order; ``groups[i]`` is the group (system prompt) of request ``i``."""

    groups: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "arrival_groups": list(self.groups)}


def grouped_workload(
    groups: int,
    per_group: int,
    system_len: int,
    user_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    exclude_token_ids: Iterable[int] = (),
) -> GroupedWorkload:
    """``groups`` x ``per_group`` requests, each its group's random system prompt plus its own random
    user suffix, in a seeded random (interleaved) order; the same for the same arguments."""
    for name, value in (
        ("groups", groups),
        ("per_group", per_group),
        ("system_len", system_len),
        ("user_len", user_len),
        ("output_len", output_len),
    ):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")
    rng = random.Random(seed)
    pool = token_pool(vocab_size, exclude_token_ids)
    systems = [random_ids(rng, system_len, pool) for _ in range(groups)]
    tagged = [
        (g, BenchRequest(systems[g] + random_ids(rng, user_len, pool), output_len))
        for g in range(groups)
        for _ in range(per_group)
    ]
    rng.shuffle(tagged)
    return GroupedWorkload(
        "grouped",
        [r for _, r in tagged],
        groups=[g for g, _ in tagged],
        params={
            "groups": groups,
            "per_group": per_group,
            "system_len": system_len,
            "user_len": user_len,
            "output_len": output_len,
            "seed": seed,
        },
    )


@dataclass
class RunSpec:
    """One run: its label, core count, routing policy and KV blocks per core."""

    name: str
    data_parallel_size: int
    routing: str
    num_kv_blocks: int


@dataclass
class CoreFigures:
    """One core's share of a run (counter deltas over the ``generate`` call)."""

    requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


@dataclass
class RunResult:
    """Figures of one run; ``token_ids[i]`` is the output of request ``i`` of the workload and
    ``top_logprobs[i][j]`` the top log-probabilities (token id -> log-probability) at its ``j``-th
    generated token."""

    spec: RunSpec
    model: str
    elapsed_s: float
    output_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_computed: int
    num_preemptions: int
    cores: dict[int, CoreFigures]
    token_ids: list[list[int]]
    top_logprobs: list[list[dict[int, float]]]

    @property
    def hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / max(self.elapsed_s, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "data_parallel_size": self.spec.data_parallel_size,
            "routing": self.spec.routing,
            "num_kv_blocks_per_core": self.spec.num_kv_blocks,
            "elapsed_s": self.elapsed_s,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.hit_rate,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "num_preemptions": self.num_preemptions,
            "cores": {
                str(rank): {**dataclasses.asdict(core), "prefix_cache_hit_rate": core.hit_rate}
                for rank, core in sorted(self.cores.items())
            },
        }


@dataclass
class PrefixRoutingResult:
    """All runs of the benchmark, the ratios of hit rates against the goals, and output identity."""

    workload: GroupedWorkload
    runs: list[RunResult]

    def run(self, name: str) -> RunResult | None:
        return next((r for r in self.runs if r.spec.name == name), None)

    def _hit_ratio(self, numerator: str, denominator: str) -> float | None:
        a, b = self.run(numerator), self.run(denominator)
        if a is None or b is None or a.hit_rate is None or b.hit_rate is None:
            return None
        return ratio(a.hit_rate, b.hit_rate)

    @property
    def prefix_vs_one_core(self) -> float | None:
        return self._hit_ratio(PREFIX, ONE_CORE)

    @property
    def prefix_vs_round_robin(self) -> float | None:
        return self._hit_ratio(PREFIX, ROUND_ROBIN)

    @property
    def outputs_identical(self) -> bool:
        return all(r.token_ids == self.runs[0].token_ids for r in self.runs[1:])

    def comparisons(self) -> dict[str, OutputComparison]:
        """Each later run's outputs against the first run's."""
        return {r.spec.name: compare_outputs(self.runs[0], r) for r in self.runs[1:]}

    @property
    def outputs_close(self) -> bool:
        """No request differs from the first run's beyond a near-tie flip."""
        return all(c.mismatch == 0 for c in self.comparisons().values())

    def goals(self) -> dict[str, Any]:
        vs_one, vs_rr = self.prefix_vs_one_core, self.prefix_vs_round_robin
        return {
            "prefix_vs_one_core": {
                "ratio": vs_one,
                "goal": GOAL_VS_ONE_CORE,
                "met": vs_one is not None and vs_one >= GOAL_VS_ONE_CORE,
            },
            "prefix_vs_round_robin": {
                "ratio": vs_rr,
                "goal": GOAL_VS_ROUND_ROBIN,
                # A round-robin hit rate of zero makes the ratio undefined; any hits beat it.
                "met": (vs_rr is not None and vs_rr >= GOAL_VS_ROUND_ROBIN)
                or (vs_rr is None and _rate(self.run(PREFIX)) > 0 and _rate(self.run(ROUND_ROBIN)) == 0),
            },
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.runs[0].model if self.runs else None,
            "workload": self.workload.summary(),
            "runs": [r.to_json() for r in self.runs],
            "goals": self.goals(),
            "outputs_identical": self.outputs_identical,
            "outputs_close": self.outputs_close,
            "output_comparisons": {
                "reference": self.runs[0].spec.name if self.runs else None,
                **{name: dataclasses.asdict(c) for name, c in self.comparisons().items()},
            },
        }


@dataclass
class OutputComparison:
    """Requests whose greedy outputs are identical in two runs, differ by a near-tie flip, or
    mismatch; the indices of those that differ, and the largest log-probability gap of a near tie."""

    identical: int = 0
    near_tie: int = 0
    mismatch: int = 0
    differing: list[int] = field(default_factory=list)
    max_near_tie_gap: float | None = None


def compare_outputs(reference: RunResult, other: RunResult) -> OutputComparison:
    """``other``'s outputs against ``reference``'s, request by request (see the module docstring)."""
    out = OutputComparison()
    pairs = zip(reference.token_ids, reference.top_logprobs, other.token_ids, other.top_logprobs, strict=True)
    for i, (a_ids, a_top, b_ids, b_top) in enumerate(pairs):
        status, pos = greedy_compare(a_ids, a_top, b_ids, b_top)
        if status == "identical" and len(a_ids) == len(b_ids):
            out.identical += 1
            continue
        out.differing.append(i)
        if status == "near_tie" and pos is not None:
            out.near_tie += 1
            gap = a_top[pos][a_ids[pos]] - a_top[pos][b_ids[pos]]
            out.max_near_tie_gap = gap if out.max_near_tie_gap is None else max(out.max_near_tie_gap, gap)
        else:
            out.mismatch += 1
    return out


def _rate(run: RunResult | None) -> float:
    return (run.hit_rate or 0.0) if run is not None else 0.0


def default_runs(num_kv_blocks: int, double_kv_reference: bool = True) -> list[RunSpec]:
    """The runs of the benchmark: one core, two cores with each routing, optionally one core with
    twice the KV blocks."""
    runs = [
        RunSpec(ONE_CORE, 1, "prefix", num_kv_blocks),
        RunSpec(PREFIX, 2, "prefix", num_kv_blocks),
        RunSpec(ROUND_ROBIN, 2, "round_robin", num_kv_blocks),
    ]
    if double_kv_reference:
        runs.append(RunSpec(ONE_CORE_DOUBLE_KV, 1, "prefix", 2 * num_kv_blocks))
    return runs


def run_prefix_routing(
    workload: GroupedWorkload,
    engine_args: dict[str, Any],
    runs: Sequence[RunSpec],
    *,
    warmup: bool = True,
    before_shutdown: Callable[[RunSpec, LLM], None] | None = None,
) -> PrefixRoutingResult:
    """Run ``workload`` once per ``RunSpec``, each in a fresh multiprocess ``LLM`` with
    ``engine_args`` (``num_kv_blocks`` taken from the spec). ``before_shutdown`` is called with each
    run's ``LLM`` after its measurement, before the ``LLM`` is shut down."""
    results = []
    for spec in runs:
        results.append(_run_one(workload, engine_args, spec, warmup, before_shutdown))
        gc.collect()
    return PrefixRoutingResult(workload, results)


def _run_one(
    workload: GroupedWorkload,
    engine_args: dict[str, Any],
    spec: RunSpec,
    warmup: bool,
    before_shutdown: Callable[[RunSpec, LLM], None] | None,
) -> RunResult:
    from pagedllm.engine.proc.mp_llm_engine import MPLLMEngine
    from pagedllm.entrypoints.llm import LLM

    args = {**engine_args, "num_kv_blocks": spec.num_kv_blocks}
    llm = LLM(
        multiprocess=True,
        data_parallel_size=spec.data_parallel_size,
        data_parallel_routing=spec.routing,
        **args,
    )
    try:
        engine = llm.llm_engine
        assert isinstance(engine, MPLLMEngine)
        if warmup:
            # Prompts shorter than a block: they leave no block in the prefix caches.
            prompts = [
                r.prompt_token_ids[-WARMUP_PROMPT_LEN:]
                for r in workload.requests[: 2 * spec.data_parallel_size]
            ]
            llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False
            )
        before = engine.wait_for_stats()
        output_len = workload.requests[0].output_len
        params = SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=TOP_LOGPROBS
        )
        started = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in workload.requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        after = engine.wait_for_stats()
        model = engine.model_name
        if before_shutdown is not None:
            before_shutdown(spec, llm)
    finally:
        llm.shutdown()
        del llm
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    top_logprobs = [
        [{t: lp.logprob for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])] for o in outputs
    ]
    cores = {
        rank: _core_figures(before.get(rank, EngineStats()), stats, output_len)
        for rank, stats in after.items()
    }
    deltas = {
        name: sum(
            getattr(after[rank], name) - getattr(before.get(rank, EngineStats()), name) for rank in after
        )
        for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed", "num_preemptions")
    }
    return RunResult(
        spec=spec,
        model=model,
        elapsed_s=elapsed,
        output_tokens=sum(len(t) for t in token_ids),
        prefix_cache_queries=deltas["prefix_cache_queries"],
        prefix_cache_hits=deltas["prefix_cache_hits"],
        prompt_tokens_computed=deltas["prompt_tokens_computed"],
        num_preemptions=deltas["num_preemptions"],
        cores=cores,
        token_ids=token_ids,
        top_logprobs=top_logprobs,
    )


def _core_figures(before: EngineStats, after: EngineStats, output_len: int) -> CoreFigures:
    generated = after.generation_tokens - before.generation_tokens
    return CoreFigures(
        requests=round(generated / output_len),
        prefix_cache_queries=after.prefix_cache_queries - before.prefix_cache_queries,
        prefix_cache_hits=after.prefix_cache_hits - before.prefix_cache_hits,
    )


def report(result: PrefixRoutingResult) -> str:
    """The results as a table followed by the ratios against the goals."""
    rows = []
    for r in result.runs:
        per_core = " / ".join(str(r.cores[rank].requests) for rank in sorted(r.cores))
        rows.append(
            [
                r.spec.name,
                r.spec.num_kv_blocks,
                None if r.hit_rate is None else 100.0 * r.hit_rate,
                r.prompt_tokens_computed,
                r.num_preemptions,
                r.output_tokens_per_s,
                r.elapsed_s,
                per_core,
            ]
        )
    headers = [
        "run",
        "KV blocks/core",
        "hit rate %",
        "prompt tok computed",
        "preemptions",
        "output tok/s",
        "elapsed s",
        "requests/core",
    ]
    lines = [format_table(headers, rows)]
    goals = result.goals()
    for key, label in (("prefix_vs_one_core", "one core"), ("prefix_vs_round_robin", "round-robin")):
        g = goals[key]
        value = "-" if g["ratio"] is None else f"{g['ratio']:.2f}"
        lines.append(
            f"hit rate prefix / {label}: {value} (goal >= {g['goal']}): {'met' if g['met'] else 'NOT met'}"
        )
    lines.append(f"greedy outputs identical across runs: {str(result.outputs_identical).lower()}")
    if not result.outputs_identical:
        for name, c in result.comparisons().items():
            gap = "-" if c.max_near_tie_gap is None else f"{c.max_near_tie_gap:.2g}"
            lines.append(
                f"  {name} vs {result.runs[0].spec.name}: {c.identical} identical, "
                f"{c.near_tie} near-tie flips (largest logprob gap {gap}), {c.mismatch} mismatches"
            )
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefix-routing")
    group.add_argument(
        "--groups", type=int, default=8, help="Groups of requests sharing a system prompt (8)."
    )
    group.add_argument("--per-group", type=int, default=16, help="Requests per group (16).")
    group.add_argument(
        "--system-len", type=int, default=512, help="Tokens of each group's system prompt (512)."
    )
    group.add_argument("--user-len", type=int, default=32, help="Tokens of each request's own suffix (32).")
    group.add_argument("--output-len", type=int, default=8, help="Tokens generated per request (8).")
    group.add_argument(
        "--double-kv-reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Also run one core with twice --num-kv-blocks, for context (default on).",
    )
    add_run_args(parser, warmup=True)
    parser.set_defaults(num_kv_blocks=160, max_num_seqs=8, max_model_len=1024)


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    from pagedllm.model.loader import load_model_tokenizer

    try:
        set_num_threads(args.num_threads)
        config = EngineConfig.from_cli_args(args)
        if config.num_kv_blocks is None:
            raise ValueError("--num-kv-blocks is needed: the benchmark limits each core's KV cache.")
        tokenizer = load_model_tokenizer(config.model, config.tokenizer)
        workload = grouped_workload(
            args.groups,
            args.per_group,
            args.system_len,
            args.user_len,
            args.output_len,
            len(tokenizer),
            config.seed,
            getattr(tokenizer, "all_special_ids", ()),
        )
        total_len = args.system_len + args.user_len + args.output_len
        if config.max_model_len is not None and total_len > config.max_model_len:
            raise ValueError(
                f"a request needs {total_len} tokens, more than --max-model-len {config.max_model_len}."
            )
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    system_blocks = -(-args.system_len // config.block_size)
    print(
        f"Workload: {args.groups} groups x {args.per_group} requests, system prompt "
        f"{args.system_len} tokens ({args.groups * system_blocks} blocks in all), user suffix "
        f"{args.user_len}, output {args.output_len}; {config.num_kv_blocks} KV blocks of "
        f"{config.block_size} tokens per core, max_num_seqs {config.max_num_seqs}"
    )
    engine_args = dataclasses.asdict(config)
    runs = default_runs(config.num_kv_blocks, args.double_kv_reference)
    result = run_prefix_routing(workload, engine_args, runs, warmup=args.warmup)
    print(report(result))
    if args.output_json:
        write_json(
            args.output_json,
            {
                "date": now_iso(),
                "machine": machine_info(),
                "engine_config": engine_args,
                **result.to_json(),
            },
        )
    return 0
