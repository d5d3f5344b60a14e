"""The pool of physical KV blocks: ref counts, the prefix-cache index and the LRU free queue."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A block-table entry whose block was released (it lies wholly before the attention window of every
# token the request will still compute): attention never reads it.
RELEASED_BLOCK = -1


@dataclass
class KVBlock:
    """One physical block of ``block_size`` token slots.

    ``ref_cnt`` counts the requests whose block table holds this block. ``block_hash`` is set while
    the block is registered in the prefix cache (it holds a full block of known tokens, which are
    kept in ``token_ids`` to verify a hash hit).
    """

    block_id: int
    on_host: bool = False  # a block of the host tier's pool (not of the device's)
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Owns every block of the KV cache.

    Invariants:
    - a block is in ``free_queue`` iff its ``ref_cnt`` is 0;
    - the free queue is LRU ordered: blocks are taken from its front and freed blocks are appended
      at its back, so cached blocks freed long ago are evicted first;
    - ``cached[h]`` is the block registered under hash ``h``; a free block may stay registered
      (cached and unreferenced) until it is taken for a new use, which unregisters it.

    With ``report_events`` every hash that enters ``cached`` is appended to ``added`` and every one
    that leaves it to ``removed``, in order, until the owner takes them (:meth:`take_events`): what a
    data-parallel front-end needs to know where prefixes are cached.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, on_host: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i, on_host) for i in range(num_blocks)]
        # Called with each cached block that :meth:`allocate` evicts, before it is unregistered (the
        # host tier keeps a copy of it).
        self.on_evict: Callable[[KVBlock], None] | None = None
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.report_events = False
        self.added: list[int] = []
        self.removed: list[int] = []

    def take_events(self) -> tuple[list[int], list[int]]:
        """The hashes registered and dropped since the previous call (``report_events`` only)."""
        added, removed = self.added, self.removed
        self.added, self.removed = [], []
        return added, removed

    def _forget(self, block: KVBlock) -> None:
        """Unregister a block's hash (if it is the one registered under it)."""
        h = block.block_hash
        if h is not None and self.cached.get(h) is block:
            del self.cached[h]
            if self.report_events:
                self.removed.append(h)
        block.block_hash = None
        block.token_ids = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cache hits (removing unreferenced ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting their cache entries."""
        if n > len(self.free_queue):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                self._forget(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, given in eviction order (first = evicted first)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = block

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Record a full block under its hash (first writer wins; duplicates stay uncached).

        Returns whether the block was newly registered."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
        if self.report_events:
            self.added.append(block_hash)
        return True

    def uncache(self, block_ids: list[int]) -> None:
        """Forget the hashes of these blocks (they stay allocated or free as they are)."""
        for block_id in block_ids:
            self._forget(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible while no block is referenced."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            self._forget(block)
        return True
