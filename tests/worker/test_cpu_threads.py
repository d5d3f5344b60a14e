"""The CPU thread governor: its policy on scripted CPU times, a real busy neighbour, and results that do
not depend on the team size."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.cpu_threads import CpuTimes, ThreadGovernor, allowed_cpus, read_cpu_times


class Script:
    """CPU times that grow by given rates (cores busy in all, cores of this process) per second."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = self.own = 0.0
        self.applied: list[int] = []

    def clock(self) -> float:
        return self.now

    def read(self, cpus: frozenset[int]) -> CpuTimes:
        return CpuTimes(self.busy, self.own)

    def run(self, gov: ThreadGovernor, seconds: float, others: float, own: float = 1.0) -> int:
        """Advance ``seconds`` in steps of 0.1 s, calling ``before_step`` before each."""
        for _ in range(round(seconds / 0.1)):
            gov.before_step()
            self.now = round(self.now + 0.1, 9)
            self.busy += 0.1 * (others + own)
            self.own += 0.1 * own
        return gov.before_step()


def governor(script: Script, cpus: int = 2, max_threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(
        max_threads,
        cpus=frozenset(range(cpus)),
        read=script.read,
        clock=script.clock,
        apply=script.applied.append,
    )


def test_a_neighbour_on_one_core_takes_a_thread_and_gives_it_back() -> None:
    s = Script()
    gov = governor(s)
    assert s.run(gov, 2.0, others=0.0, own=2.0) == 2
    assert s.applied == [2]  # the first step sets the team on its own thread
    assert s.run(gov, 2.0, others=1.0) == 1
    assert gov.others == pytest.approx(1.0)
    assert s.run(gov, 2.0, others=0.0) == 2
    assert s.applied == [2, 1, 2] and gov.changes == 2


def test_hysteresis_keeps_the_team_on_a_small_or_wavering_load() -> None:
    s = Script()
    gov = governor(s)
    assert s.run(gov, 3.0, others=0.6) == 2  # 1.4 cores free: not below the 1.3 mark
    assert s.run(gov, 3.0, others=0.75) == 1
    assert s.run(gov, 3.0, others=0.4) == 1  # 1.6 free: not above the 1.7 mark
    assert s.run(gov, 3.0, others=0.2) == 2
    assert gov.changes == 2


def test_the_team_stays_within_one_and_max_threads() -> None:
    s = Script()
    gov = governor(s, cpus=4, max_threads=3)
    assert s.run(gov, 2.0, others=0.0) == 3  # four free cores, but at most three threads
    assert s.run(gov, 2.0, others=3.9) == 1  # nothing free: still one thread
    assert s.run(gov, 2.0, others=1.0) == 3
    with pytest.raises(ValueError, match="max_threads"):
        ThreadGovernor(0)


def test_measurements_wait_for_the_interval() -> None:
    s = Script()
    gov = governor(s)
    reads = 0

    def counting_read(cpus: frozenset[int]) -> CpuTimes:
        nonlocal reads
        reads += 1
        return s.read(cpus)

    gov._read = counting_read
    s.run(gov, 2.0, others=0.0)  # 21 steps over 2 s, one measurement per 0.5 s
    assert reads == 5


def test_no_proc_stat_keeps_the_team() -> None:
    s = Script()
    gov = ThreadGovernor(
        2, cpus=frozenset({0, 1}), read=lambda cpus: None, clock=s.clock, apply=s.applied.append
    )
    assert s.run(gov, 2.0, others=1.0) == 2 and s.applied == [2]


@pytest.mark.skipif(len(allowed_cpus()) < 2 or read_cpu_times(allowed_cpus()) is None, reason="needs 2 cores")
def test_a_real_busy_loop_on_one_core_is_seen() -> None:
    cpus = allowed_cpus()
    core = min(cpus)
    applied: list[int] = []
    gov = ThreadGovernor(len(cpus), cpus=cpus, interval_s=0.5, apply=applied.append)
    busy = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    try:
        deadline = time.monotonic() + 20
        gov.before_step()
        # Other work on the machine only adds to what the loop takes: the team shrinks by at least one.
        while gov.threads == len(cpus) and time.monotonic() < deadline:
            time.sleep(0.1)
            gov.before_step()
        assert gov.others >= 0.7, gov.others
        assert gov.threads <= len(cpus) - 1
    finally:
        busy.kill()
        busy.wait(10)
    assert busy.poll() is not None


def test_greedy_outputs_do_not_depend_on_the_team_size() -> None:
    llm = LLM(max_model_len=512, num_kv_blocks=64, adapt_cpu_threads=False, enable_prefix_caching=False)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"] * 2
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs = llm.generate(prompts, params, use_tqdm=False)
            llm.llm_engine.check_idle()
            results.append(
                [
                    (
                        o.outputs[0].token_ids,
                        [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs],
                    )
                    for o in outs
                ]
            )
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1]
