"""Which engine core a request goes to, under data parallelism.

:class:`PrefixRouter` keeps, per core, an approximate index of the full-block hashes its prefix cache
holds: the blocks of every prompt routed to it are added when the request is sent (so the next
request of a group finds them before the first has even been computed), and each core's reports of
registered and evicted blocks keep the index close to the truth (and share it between front-ends).
A request goes to the living core that holds the longest prefix of its prompt, unless that core is
busier than the least loaded one by more than ``max_imbalance`` sequences; otherwise (and when no
core holds any of it) it goes to the least loaded core (waiting + running), ties taken in turn.
``round_robin`` ignores prefixes and loads (it exists to compare against).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from pagedllm.sched.kv_cache_manager import prompt_block_hashes

ROUTING_POLICIES = ("prefix", "round_robin")


class PrefixRouter:
    """Routing state of one front-end. Invariant: ``index[r]`` holds at most ``max_index_blocks``
    hashes (least recently routed or reported dropped first)."""

    def __init__(
        self,
        ranks: Sequence[int],
        block_size: int,
        policy: str = "prefix",
        *,
        max_index_blocks: int = 1 << 16,
        max_imbalance: int = 32,
    ) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(
                f"data_parallel_routing must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}."
            )
        self.policy = policy
        self.block_size = block_size
        self.max_index_blocks = max_index_blocks
        self.max_imbalance = max_imbalance
        self.index: dict[int, OrderedDict[int, None]] = {r: OrderedDict() for r in ranks}
        self._turn = itertools.count()

    def choose(self, prompt_token_ids: list[int], loads: dict[int, int], lora_int_id: int = 0) -> int:
        """The rank for a prompt (under adapter ``lora_int_id``, 0: none), among the living cores (the
        keys of ``loads``, with their loads)."""
        if not loads:
            raise ValueError("no living core to route to")
        ranks = sorted(loads)
        turn = next(self._turn)
        if self.policy == "round_robin" or len(ranks) == 1:
            return ranks[turn % len(ranks)]
        least = min(loads.values())
        hashes = prompt_block_hashes(
            prompt_token_ids, self.block_size, (len(prompt_token_ids) - 1) // self.block_size, lora_int_id
        )
        best_rank, best_len = -1, 0
        for rank in ranks:
            index = self.index.get(rank)
            if not index:
                continue
            matched = 0
            for h in hashes:
                if h not in index:
                    break
                matched += 1
            if matched > best_len or (matched == best_len and matched and loads[rank] < loads[best_rank]):
                best_rank, best_len = rank, matched
        if best_len and loads[best_rank] - least <= self.max_imbalance:
            return best_rank
        idle = [r for r in ranks if loads[r] == least]
        return idle[turn % len(idle)]

    def routed(self, rank: int, prompt_token_ids: list[int], lora_int_id: int = 0) -> None:
        """Record that a prompt went to ``rank`` (its full blocks will be cached there); nothing to
        record when the index is never read (one core, or round robin)."""
        if self.policy == "round_robin" or len(self.index) < 2:
            return
        self.add(rank, prompt_block_hashes(prompt_token_ids, self.block_size, lora_int_id=lora_int_id))

    def add(self, rank: int, hashes: Sequence[int]) -> None:
        index = self.index.setdefault(rank, OrderedDict())
        for h in hashes:
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.max_index_blocks:
            index.popitem(last=False)

    def remove(self, rank: int, hashes: Sequence[int]) -> None:
        index = self.index.get(rank)
        if index:
            for h in hashes:
                index.pop(h, None)

    def forget(self, rank: int) -> None:
        """A core died: nothing is cached there any more."""
        self.index.pop(rank, None)


__all__ = ["ROUTING_POLICIES", "PrefixRouter"]
