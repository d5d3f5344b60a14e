"""Per-request block tables on top of the block pool, with prefix caching and, for models whose
every layer attends through a sliding window, the release of blocks that have left the window."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.request import Request
from pagedllm.sched.block_pool import RELEASED_BLOCK, BlockPool, KVBlock
from pagedllm.sched.host_tier import HostTier

# The chain's start. Python hashes tuples of ints the same way in every process (unlike strings), so
# a front-end computes the hashes a core's prefix cache uses (for prefix-aware routing).
_ROOT_HASH = 0x5EED_0F_B10C5


def root_hash(lora_int_id: int = 0) -> int:
    """The start of a request's hash chain: one per LoRA adapter (0: the base model), so that blocks
    computed under one adapter are never served to a request of another or of the base model."""
    return _ROOT_HASH if not lora_int_id else hash((_ROOT_HASH, lora_int_id))


def prompt_block_hashes(
    token_ids: list[int], block_size: int, max_blocks: int | None = None, lora_int_id: int = 0
) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (at most ``max_blocks``) under adapter
    ``lora_int_id``, as a prefix-caching KV cache manager with this block size registers them."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    parent = root_hash(lora_int_id)
    for i in range(n):
        parent = hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


def hash_block(parent_hash: int, token_ids: tuple[int, ...], extra_keys: tuple = ()) -> int:
    """Chained block hash: a block is identified by its parent's hash, its tokens and extra keys."""
    return hash((parent_hash, token_ids, extra_keys))


@dataclass
class BlockTableChange:
    """What the worker writes into one request's block table before a step (a field of
    :class:`pagedllm.sched.scheduler.SchedulerOutput`).

    The table becomes its first ``start`` entries as the worker holds them, followed by
    ``block_ids``; entries past that are dropped. ``start`` 0 rewrites the table (a request scheduled
    for the first time, readmitted after preemption, or swapped back in). Applying the same change
    twice gives the same table.
    """

    request_id: str
    start: int  # entries the worker already holds and keeps (0: the table is rewritten)
    block_ids: list[int]  # physical ids of logical blocks ``start, start + 1, ...``


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found in the cache


def uniform_sliding_window(model_config: object) -> int | None:
    """The window whose out-of-window blocks a KV cache manager may release for this model: the
    largest layer window when every layer has one (Mistral), else None (full-attention layers need
    every block). Reads ``num_hidden_layers`` and ``layer_sliding_window(i)`` when the config has them."""
    window_of = getattr(model_config, "layer_sliding_window", None)
    num_layers = getattr(model_config, "num_hidden_layers", 0)
    if window_of is None or not num_layers:
        return None
    windows = [window_of(i) for i in range(num_layers)]
    if any(w is None for w in windows):
        return None
    return max(windows)


class KVCacheManager:
    """Gives requests KV blocks and finds their cached prefixes.

    Invariants: each block id in a request's ``block_ids`` other than :data:`RELEASED_BLOCK` holds
    one reference of that request; ``free`` returns all of them at once; when no request holds
    blocks, every block is free (cached or not) and has ref_cnt 0.

    Sliding window (``sliding_window`` set: every layer of the model attends only to the last
    ``sliding_window`` positions, so the token at position p reads keys ``p - sliding_window + 1 ..
    p``): the tokens a request still computes sit at positions ``num_computed_tokens`` and later,
    so they never read keys before ``num_computed_tokens - sliding_window + 1``. Each
    :meth:`allocate_slots` first releases the blocks wholly before that key: their entries in
    ``block_ids`` become :data:`RELEASED_BLOCK` (logical indices are kept, and the entries are a
    prefix of ``block_ids``), and attention backends never read them; prefix-cache hits wholly
    before the window of a request being admitted are not taken at all. So a running request holds at
    most ``cdiv(sliding_window - 1 + num_new_tokens, block_size) + 1`` blocks after a step's
    allocation. Released blocks go back to the pool with their prefix-cache entries, like the blocks
    of a finished request: a later prefix hit reuses such a block only while it is still registered
    (unreferenced blocks are unregistered when they are reallocated), so a hit never assumes a block
    that was released and then overwritten. A request preempted after releasing blocks recomputes
    from its longest cached prefix like any other.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        sliding_window: int | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got {sliding_window}.")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.stats = PrefixCacheStats()
        # The host tier (``num_host_blocks`` > 0): swapped requests' KV, and the cached blocks the
        # device pool evicts, which prefix lookups find there when the device has lost them.
        self.host = HostTier(num_host_blocks, enable_caching) if num_host_blocks else None
        if self.host is not None and enable_caching:
            self.pool.on_evict = self.host.keep_evicted
        # What the worker's block tables hold: request id -> entries of its ``block_ids`` sent in a
        # BlockTableChange; and the requests whose tables the worker drops at its next step (their
        # blocks were freed or swapped out since the worker last heard of them).
        self._sent: dict[str, int] = {}
        self._dropped: list[str] = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _block_tokens(self, request: Request, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(request.all_token_ids[i * bs : (i + 1) * bs])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, leaving at least one token to compute.
        Each block is a device block or, where the device has lost it, a host-tier block
        (``on_host``), which :meth:`allocate_slots` copies back."""
        if not self.enable_caching or not request.uses_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        parent = root_hash(request.lora_int_id)
        host = self.host
        for i in range(max_blocks):
            tokens = self._block_tokens(request, i)
            h = hash_block(parent, tokens)
            block = self.pool.lookup(h, tokens)
            if block is None and host is not None:
                block = host.lookup(h, tokens)
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

        ``computed`` are prefix-cache hits for a request being admitted; those in the host tier get
        new device blocks, copied in before the step's forward and registered in the device's cache.
        Returns False and changes nothing when there are not enough free blocks (blocks released from
        the window stay released: the request no longer needs them either way).
        """
        if self.sliding_window is not None and request.block_ids:
            self.release_out_of_window(request)
        capacity = len(request.block_ids) * self.block_size
        if not computed and request.num_computed_tokens + num_new_tokens <= capacity:
            return True  # the room is there already (most decode steps)
        computed = computed or []
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_needed(request, num_computed + num_new_tokens, computed)
        # Hits wholly before the window of the tokens to compute are not taken (their entries are
        # released at once); the others that are currently unreferenced come out of the free queue.
        # (Hits come only with a request being admitted, which holds no blocks yet.)
        skip = min(self._first_needed_block(num_computed), len(computed)) if computed else 0
        kept = computed[skip:]
        on_host = [b for b in kept if b.on_host]
        on_device = [b for b in kept if not b.on_host]
        hits_from_free = sum(1 for b in on_device if b.ref_cnt == 0)
        if need + len(on_host) + hits_from_free > self.pool.num_free_blocks:
            return False
        if computed:
            self.pool.touch(on_device)
            request.block_ids.extend([RELEASED_BLOCK] * skip)
            if on_host:
                request.block_ids.extend(self._restore(kept, on_host))
            else:
                request.block_ids.extend(b.block_id for b in kept)
            for b in computed:
                assert b.block_hash is not None
                request.block_hashes.append(b.block_hash)
        if need:
            request.block_ids.extend(b.block_id for b in self.pool.allocate(need))
        return True

    def _restore(self, kept: list[KVBlock], on_host: list[KVBlock]) -> list[int]:
        """The device block ids of ``kept`` hits, the host ones copied into new device blocks."""
        assert self.host is not None
        self.host.hold(on_host)  # first: evictions the allocation below copies out must not take them
        fresh = self.pool.allocate(len(on_host))
        self.host.restore(on_host, fresh, self.block_size)
        restored = iter(fresh)
        ids = []
        for b in kept:
            if not b.on_host:
                ids.append(b.block_id)
                continue
            block = next(restored)
            assert b.block_hash is not None and b.token_ids is not None
            self.pool.register(block.block_id, b.block_hash, b.token_ids)
            ids.append(block.block_id)
        return ids

    # -- the worker's block tables -------------------------------------------------------------
    def table_changes(self, requests: Iterable[Request]) -> list[BlockTableChange]:
        """The changes that bring the worker's tables of ``requests`` (scheduled for a step) up to
        their ``block_ids``: the entries appended since the last change, or, for a table the worker
        does not hold, the whole of it. Blocks released from a sliding window keep their old ids in
        the worker's table (no change): attention never reads them."""
        changes = []
        for request in requests:
            rid = request.request_id
            ids = request.block_ids
            sent = self._sent.get(rid)
            if sent is None or sent > len(ids):
                changes.append(BlockTableChange(rid, 0, list(ids)))
            elif sent < len(ids):
                changes.append(BlockTableChange(rid, sent, ids[sent:]))
            self._sent[rid] = len(ids)
        return changes

    def take_dropped_tables(self) -> list[str]:
        """Requests whose block tables the worker drops (each told once)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _drop_table(self, request: Request) -> None:
        """The request holds no device blocks any more: the worker's table of it goes."""
        if self._sent.pop(request.request_id, None) is not None:
            self._dropped.append(request.request_id)

    # -- swapping ----------------------------------------------------------------------------
    def swap_out(self, request: Request) -> bool:
        """Move the request's KV to the host tier, freeing its device blocks (False, nothing
        changed: no host tier, or too few free host blocks)."""
        if self.host is None or not self.host.swap_out(request, self.pool):
            return False
        self._drop_table(request)
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped request's KV back to new device blocks and make room for
        ``num_new_tokens`` more (False, nothing changed, when the device lacks the blocks)."""
        assert self.host is not None and request.host_block_ids
        held = sum(1 for h in request.host_block_ids if h != RELEASED_BLOCK)
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        if held + max(0, total - len(request.host_block_ids)) > self.pool.num_free_blocks:
            return False
        if not self.host.swap_in(request, self.pool):
            return False
        for i, h in enumerate(request.block_hashes):  # its full blocks are shared again
            if request.block_ids[i] != RELEASED_BLOCK:
                self.pool.register(request.block_ids[i], h, self._block_tokens(request, i))
        ok = self.allocate_slots(request, num_new_tokens)
        assert ok, "room was checked above"
        return True

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The block copies between the tiers that the step being scheduled makes (see HostTier)."""
        return self.host.take_copies() if self.host is not None else ([], [])

    def _first_needed_block(self, num_computed_tokens: int) -> int:
        """Logical index of the first block that tokens from position ``num_computed_tokens`` on
        read (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def release_out_of_window(self, request: Request) -> int:
        """Release the request's blocks wholly before the window of its remaining tokens (see the
        class docstring); returns how many were released."""
        ids = request.block_ids
        end = min(self._first_needed_block(request.num_computed_tokens), len(ids))
        released = [b for b in ids[:end] if b != RELEASED_BLOCK]
        if not released:
            return 0
        # Oldest first in the eviction order: they are the least likely prefix to be hit again.
        self.pool.free(released)
        for i in range(end):
            ids[i] = RELEASED_BLOCK
        return len(released)

    def num_held_blocks(self, request: Request) -> int:
        """Blocks the request holds a reference on (released entries excluded)."""
        return sum(1 for b in request.block_ids if b != RELEASED_BLOCK)

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
        parent = request.block_hashes[-1] if request.block_hashes else root_hash(request.lora_int_id)
        registered = []
        for i in range(len(request.block_hashes), num_full):
            tokens = self._block_tokens(request, i)
            h = hash_block(parent, tokens)
            block_id = request.block_ids[i]
            # A block released before it could be registered (its last token was in flight) only
            # extends the hash chain.
            if block_id != RELEASED_BLOCK and self.pool.register(block_id, h, tokens):
                registered.append(block_id)
            request.block_hashes.append(h)
            parent = h
        return registered

    def uncache(self, block_ids: list[int]) -> None:
        """Drop these blocks from the prefix cache (their content was never computed)."""
        self.pool.uncache(block_ids)

    def free(self, request: Request) -> None:
        """Return all of the request's blocks; tail blocks go first in the eviction order."""
        self.pool.free([b for b in reversed(request.block_ids) if b != RELEASED_BLOCK])
        if request.host_block_ids:
            assert self.host is not None
            self.host.free(request)
        request.block_ids = []
        request.block_hashes = []
        self._drop_table(request)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block of both tiers; only possible while no block is referenced."""
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        if self.host is not None and not self.host.pool.reset_prefix_cache():
            return False
        return self.pool.reset_prefix_cache()

    def check_idle(self) -> None:
        """Assert the idle invariant: no block referenced, free queue holds every block."""
        bad = [b.block_id for b in self.pool.blocks if b.ref_cnt != 0]
        if bad or self.pool.num_free_blocks != self.pool.num_blocks:
            raise AssertionError(f"KV blocks still referenced while idle: {bad[:10]}")
        if self._sent:
            raise AssertionError(f"block tables of freed requests still tracked: {sorted(self._sent)[:10]}")
        if self.host is not None:
            self.host.check_idle()
