"""The host tier of the KV cache: a second pool of blocks in host memory.

It holds the KV of requests swapped out of the device (preemption by swapping) and, with prefix
caching, the cached blocks the device pool evicts (a second-level prefix cache, from which a prefix
hit brings them back). Every move between the tiers is a block copy that the next step makes before
its forward: the tier records them, and the scheduler hands them to the executor with the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.request import Request
from pagedllm.sched.block_pool import RELEASED_BLOCK, BlockPool, KVBlock


@dataclass
class SwapStats:
    """Counters since the engine started."""

    swapped_out: int = 0  # requests preempted by swapping their KV out
    swapped_in: int = 0  # requests brought back from the host tier
    blocks_out: int = 0  # device -> host block copies (swaps and evictions kept by the host cache)
    blocks_in: int = 0  # host -> device block copies (swaps in and host prefix-cache hits)
    host_hit_tokens: int = 0  # prompt tokens found in the host tier's prefix cache


class HostTier:
    """The host pool, the block copies the next step makes, and what they cost to track.

    Invariants:
    - every host block a swapped request lists in ``host_block_ids`` holds one reference of it;
      a request that is not swapped holds no host block;
    - ``copies_out`` (device -> host) run before ``copies_in`` (host -> device), both before the
      forward of the step they are taken with (:meth:`take_copies`), in the order recorded;
    - a host block that this step's copies read (a swap-in, a host prefix hit) keeps a reference until
      the copies are taken, so no copy out recorded later in the same step overwrites it first;
    - a device block copied out is only reused by the step's forward or later copies in, which run
      after every copy out, so each copy out reads the block's old content.
    An idle tier (no swapped request, copies taken) has every block free, cached or not.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching, on_host=True)
        self.copies_out: list[tuple[int, int]] = []  # (device block, host block)
        self.copies_in: list[tuple[int, int]] = []  # (host block, device block)
        self._reading: list[int] = []  # host blocks read by copies in not yet taken
        self.stats = SwapStats()

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies recorded since the previous call (for the step being scheduled); the host
        blocks they read are released (cached ones stay cached)."""
        out, into = self.copies_out, self.copies_in
        self.copies_out, self.copies_in = [], []
        self.pool.free(self._reading)
        self._reading = []
        return out, into

    # -- swapping ----------------------------------------------------------------------------
    def swap_out(self, request: Request, device: BlockPool) -> bool:
        """Copy the request's held blocks to new host blocks and free them on the device; False
        (nothing changed) when the host pool lacks free blocks."""
        held = [b for b in request.block_ids if b != RELEASED_BLOCK]
        if len(held) > self.pool.num_free_blocks:
            return False
        host = iter(self.pool.allocate(len(held)))
        request.host_block_ids = [
            b if b == RELEASED_BLOCK else next(host).block_id for b in request.block_ids
        ]
        self.copies_out += [
            (d, h)
            for d, h in zip(request.block_ids, request.host_block_ids, strict=True)
            if d != RELEASED_BLOCK
        ]
        device.free(held[::-1])  # tail blocks first in the eviction order, as a finished request's
        request.block_ids = []
        self.stats.swapped_out += 1
        self.stats.blocks_out += len(held)
        return True

    def swap_in(self, request: Request, device: BlockPool) -> bool:
        """Give the swapped request new device blocks holding its KV again (copied in before the next
        forward); False (nothing changed) when the device pool lacks free blocks."""
        held = [h for h in request.host_block_ids if h != RELEASED_BLOCK]
        if len(held) > device.num_free_blocks:
            return False
        fresh = iter(device.allocate(len(held)))
        request.block_ids = [
            h if h == RELEASED_BLOCK else next(fresh).block_id for h in request.host_block_ids
        ]
        self.copies_in += [
            (h, d)
            for h, d in zip(request.host_block_ids, request.block_ids, strict=True)
            if h != RELEASED_BLOCK
        ]
        self._reading += held  # the request's references, released once the copies are taken
        request.host_block_ids = []
        self.stats.swapped_in += 1
        self.stats.blocks_in += len(held)
        return True

    def free(self, request: Request) -> None:
        """Release a swapped request's host blocks (it finished or was aborted while swapped)."""
        self.pool.free([h for h in reversed(request.host_block_ids) if h != RELEASED_BLOCK])
        request.host_block_ids = []

    # -- the second-level prefix cache --------------------------------------------------------
    def keep_evicted(self, block: KVBlock) -> None:
        """Copy a cached device block being evicted into the host cache (unless it is there already
        or the host pool has no free block)."""
        assert block.block_hash is not None and block.token_ids is not None
        pool = self.pool
        if not pool.enable_caching or not pool.num_free_blocks or block.block_hash in pool.cached:
            return
        (host,) = pool.allocate(1)
        pool.register(host.block_id, block.block_hash, block.token_ids)
        pool.free([host.block_id])  # cached and unreferenced: evictable in turn, LRU
        self.copies_out.append((block.block_id, host.block_id))
        self.stats.blocks_out += 1

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        return self.pool.lookup(block_hash, token_ids)

    def hold(self, hits: Sequence[KVBlock]) -> None:
        """Reference host prefix hits so that nothing takes them before they are restored."""
        self.pool.touch(hits)
        self._reading += [b.block_id for b in hits]

    def restore(self, hits: Sequence[KVBlock], device_blocks: Sequence[KVBlock], block_size: int) -> None:
        """Copy held host hits into new device blocks (same order)."""
        self.copies_in += [(h.block_id, d.block_id) for h, d in zip(hits, device_blocks, strict=True)]
        self.stats.blocks_in += len(hits)
        self.stats.host_hit_tokens += len(hits) * block_size

    def check_idle(self) -> None:
        """Assert the idle invariant: no host block referenced, no copy left untaken."""
        bad = [b.block_id for b in self.pool.blocks if b.ref_cnt != 0]
        if bad or self.copies_out or self.copies_in or self._reading:
            raise AssertionError(f"host KV blocks still referenced while idle: {bad[:10]}")
