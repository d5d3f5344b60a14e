"""Per-request block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.request import Request

# The chain's start. Python hashes tuples of ints the same way in every process (unlike strings), so
# a front-end computes the hashes a core's prefix cache uses (for prefix-aware routing).
_ROOT_HASH = 0x5EED_0F_B10C5


def prompt_block_hashes(token_ids: list[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (at most ``max_blocks``), as a
    prefix-caching KV cache manager with this block size registers them."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    parent = _ROOT_HASH
    for i in range(n):
        parent = hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


def hash_block(parent_hash: int, token_ids: tuple[int, ...], extra_keys: tuple = ()) -> int:
    """Chained block hash: a block is identified by its parent's hash, its tokens and extra keys."""
    return hash((parent_hash, token_ids, extra_keys))


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache


class KVCacheManager:
    """Gives requests KV blocks and finds their cached prefixes.

    Invariants: each block id in a request's ``block_ids`` holds one reference of that request;
    ``free`` returns all of them at once; when no request holds blocks, every block is free (cached
    or not) and has ref_cnt 0.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(request.all_token_ids[i * bs : (i + 1) * bs])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, leaving at least one token to compute."""
        if not self.enable_caching or not request.uses_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        parent = _ROOT_HASH
        for i in range(max_blocks):
            tokens = self._block_tokens(request, i)
            h = hash_block(parent, tokens)
            block = self.pool.lookup(h, tokens)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def blocks_needed(self, request: Request, num_tokens: int, computed: list[KVBlock] | None = None) -> int:
        """New blocks to allocate so the request holds KV room for ``num_tokens`` in total."""
        held = len(request.block_ids) + (len(computed) if computed else 0)
        return max(0, -(-num_tokens // self.block_size) - held)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed`` are prefix-cache hits for a request being admitted. Returns False and changes
        nothing when there are not enough free blocks.
        """
        capacity = len(request.block_ids) * self.block_size
        if not computed and request.num_computed_tokens + num_new_tokens <= capacity:
            return True  # the room is there already (most decode steps)
        computed = computed or []
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_needed(request, num_computed + num_new_tokens, computed)
        # Hits that are currently unreferenced come out of the free queue too.
        hits_from_free = sum(1 for b in computed if b.ref_cnt == 0)
        if need + hits_from_free > self.pool.num_free_blocks:
            return False
        if computed:
            self.pool.touch(computed)
            request.block_ids.extend(b.block_id for b in computed)
            for b in computed:
                assert b.block_hash is not None
                request.block_hashes.append(b.block_hash)
        if need:
            request.block_ids.extend(b.block_id for b in self.pool.allocate(need))
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> list[int]:
        """Register the request's full blocks within its first ``num_tokens`` tokens (default: the
        computed ones) in the prefix cache; returns the ids of blocks newly registered.

        The scheduler registers the blocks a step *will* fill when it schedules the step, as vLLM
        does: a request admitted later in the same step then shares them, and reads them in the
        same forward after they are written (every layer writes K/V before attending). Should the
        forward fail, :meth:`uncache` takes them back.
        """
        num_full = (request.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size
        if not self.enable_caching or num_full <= len(request.block_hashes):
            return []  # nothing new (most decode steps)
        parent = request.block_hashes[-1] if request.block_hashes else _ROOT_HASH
        registered = []
        for i in range(len(request.block_hashes), num_full):
            tokens = self._block_tokens(request, i)
            h = hash_block(parent, tokens)
            if self.pool.register(request.block_ids[i], h, tokens):
                registered.append(request.block_ids[i])
            request.block_hashes.append(h)
            parent = h
        return registered

    def uncache(self, block_ids: list[int]) -> None:
        """Drop these blocks from the prefix cache (their content was never computed)."""
        self.pool.uncache(block_ids)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks; tail blocks go first in the eviction order."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.block_hashes = []

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_idle(self) -> None:
        """Assert the idle invariant: no block referenced, free queue holds every block."""
        bad = [b.block_id for b in self.pool.blocks if b.ref_cnt != 0]
        if bad or self.pool.num_free_blocks != self.pool.num_blocks:
            raise AssertionError(f"KV blocks still referenced while idle: {bad[:10]}")
