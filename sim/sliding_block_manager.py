"""The block manager of a model whose every layer attends over one sliding window (Mistral-7B-v0.1):
one KV cache group of sliding-window layers, as vLLM 0.33 runs it (vllm/v1/core/): the
UnitaryKVCacheCoordinator over one SlidingWindowManager (single_type_kv_cache_manager.py), with
KVCacheManager.get_computed_blocks and allocate_slots (kv_cache_manager.py) and the BlockPool
(block_pool.py). tests/parity/ checks it step by step against vLLM's own scheduler.

Each rule, and where vLLM implements it (W is the window, B the block size):

- A request holds a block table of every block its tokens span, but the blocks wholly before its
  window are given back and their entries hold nothing (vLLM's null block; None here). Once C of its
  tokens are computed, max(0, C - W + 1) // B leading blocks are skipped
  (SlidingWindowManager.get_num_skipped_tokens). They are freed when the request is next scheduled,
  before the blocks it needs are counted (KVCacheManager.allocate_slots calls remove_skipped_blocks
  first; _remove_blocks_in_range frees them last block first and stops at an entry already freed).
  So a step's decodes grow one request at a time (`frees_when_scheduled`, `grow_decodes`): each
  frees, then takes, in the running order.
- Every full block is cached when the step that fills it is scheduled, and keeps its hash until it
  is evicted: held, or freed to the free queue's tail (BlockPool.cache_full_blocks, free_blocks).
  A freed block without a hash goes to the head. Taking a hashed free block evicts it
  (get_new_blocks, _maybe_evict_cached_block). Equal keys may index several blocks; a lookup gets
  the first indexed that is left (BlockHashToBlockMap.get_one_block).
- A waiting request's prefix hit (SlidingWindowManager.find_longest_cache_hit): from the right, the
  first stretch of cdiv(W - 1, B) cached blocks within its first (num_tokens - 1) // B blocks; the
  hit ends with that stretch and the blocks before it are null. Without such a stretch, the cached
  blocks from its start (fewer than a window's). A hit's blocks wholly before the window of the
  hit's end are not taken; the others are (BlockPool.touch: a free one leaves the free queue)
  (add_local_computed_blocks).
- Admission (allocate_slots): with the whole sequence reserved (`--reserve-full-isl`, the
  default), min(cdiv(tokens, B), max_admission_blocks) blocks must fit first, less the hit's, plus
  the hit's free blocks; then the first chunk's, uncapped (get_num_blocks_to_allocate).
  max_admission_blocks is SlidingWindowSpec.max_admission_blocks_per_request, cdiv(min(W - 1 + the
  tokens in flight, max_model_len), B) + 1. A running request needs cdiv(C + new tokens, B) entries.
- Freeing a finished or preempted request: its held blocks, last first (SingleTypeKVCacheManager.free).

Under asynchronous scheduling a request's tokens in the step in flight are not counted computed when
its skipped blocks are freed (allocate_slots: num_computed_tokens - num_in_flight_tokens): the
engine says when it schedules beside a step in flight (`pipelined`).

Unlike BlockManager, every full block is indexed when it fills (no lazy indexing of a request's own
blocks) and the index is one dict entry per key: the plain rendering of vLLM's, which this model's
runs (no fast-forward) afford. Where it still differs from vLLM: a block is cached when its tokens
are scheduled, where vLLM's AsyncScheduler caches a block filled by a placeholder token once that
step's output is processed (tests/parity/test_sliding_window_parity.py names the one run it shows in).
"""

from __future__ import annotations

from sim.block_manager import BlockManager, CachedPrefix
from sim.request import Request


class SlidingWindowBlockManager(BlockManager):
    """vLLM's KV cache of one sliding-window group (module docstring). Its free queue is
    BlockPool's (sim/block_pool.py); its index and reference counts are its own."""

    slides_windows = True  # no fast-forward: a run hands out blocks in one go
    frees_when_scheduled = True  # a request frees its skipped blocks when it is scheduled: one at a time

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int,
                 max_admission_tokens: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if sliding_window < 1:
            raise ValueError(f"a sliding window of {sliding_window} tokens")
        self.window = sliding_window
        # SlidingWindowSpec.max_admission_blocks_per_request: its tokens are window - 1 + the tokens
        # in flight, at most max_model_len (sim/app/plan.py passes them).
        self.max_admission_blocks = -(-max_admission_tokens // block_size) + 1
        # Blocks of a hit, from the right: cdiv(W - 1, B) (_contiguous_blocks_for_hit, no EAGLE).
        self.hit_blocks = -(-(sliding_window - 1) // block_size)
        # Asynchronous scheduling: a request's tokens scheduled in the step in flight are not counted
        # computed when its skipped blocks are freed (allocate_slots: num_computed_tokens -
        # num_in_flight_tokens). The engine sets `pipelined` while it schedules a step beside one in
        # flight; the tokens scheduled in each step are kept until the step's end (`slide`).
        self.pipelined = False
        self._scheduled: dict[int, int] = {}  # request index -> tokens scheduled in the step being scheduled
        self._in_flight: dict[int, int] = {}  # ... in the step before it (in flight while `pipelined`)
        self.refs = [0] * num_blocks  # users of each block (BlockPool's ref_cnt)
        self.key_of: list[int | None] = [None] * num_blocks  # each cached block's key
        self.blocks_of: dict[int, list[int]] = {}  # key -> the blocks cached with it, first indexed first
        self._index_may_hold_evicted = True  # every eviction goes through _forget_evicted

    # The free queue and the index.

    def _take(self, num: int) -> list[int]:
        """Blocks from the free queue's head, each now held once (BlockPool.get_new_blocks)."""
        blocks = self.pop_free_blocks(num) if num > 0 else []
        refs = self.refs
        for block in blocks:
            refs[block] = 1
        return blocks

    def _forget_evicted(self, evicted: list[int]) -> None:
        """Evicted blocks leave the index (_maybe_evict_cached_block)."""
        key_of, blocks_of = self.key_of, self.blocks_of
        for block in evicted:
            key = key_of[block]
            if key is not None:
                key_of[block] = None
                same = blocks_of[key]
                same.remove(block)
                if not same:
                    del blocks_of[key]

    def _free_blocks(self, blocks: list[int]) -> None:
        """BlockPool.free_blocks, `blocks` in eviction order: each loses a user; one left with none
        goes to the queue's tail with a hash, to its head without."""
        refs, key_of = self.refs, self.key_of
        for block in blocks:
            refs[block] -= 1
            if not refs[block]:
                if key_of[block] is not None:
                    self._lru.append(block)
                    self._num_lru += 1
                else:
                    self._free_plain.append(block)

    def _touch(self, blocks: list[int]) -> None:
        """A hit's blocks gain a user; a free one leaves the free queue (BlockPool.touch)."""
        refs, skip = self.refs, self._lru_skip
        for block in blocks:
            if not refs[block]:
                skip[block] += 1  # its queue entry goes stale (sim/block_pool.py)
                self._num_stale += 1
                self._num_lru -= 1
            refs[block] += 1

    def _cache(self, request: Request, num_tokens: int) -> None:
        """Cache the full blocks the first `num_tokens` tokens fill, past those cached already
        (KVCacheManager.cache_blocks)."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        start = request.num_hashed_blocks
        if num_full <= start:
            return
        keys = request.block_hashes(self.block_size, num_full)
        key_of, blocks_of, table = self.key_of, self.blocks_of, request.block_table
        for i in range(start, num_full):
            block = table[i]
            if block is not None:
                key_of[block] = keys[i]
                blocks_of.setdefault(keys[i], []).append(block)
        request.num_hashed_blocks = num_full

    def _skip(self, request: Request, num_computed: int) -> None:
        """Free the blocks wholly before the window of `num_computed` tokens (remove_skipped_blocks),
        last first, down to an entry already freed; less the tokens in flight when `pipelined`."""
        if self.pipelined:
            num_computed = max(0, num_computed - self._in_flight.get(request.index, 0))
        table = request.block_table
        num_skipped = min(max(0, num_computed - self.window + 1) // self.block_size, len(table))
        freed = []
        for i in range(num_skipped - 1, -1, -1):
            block = table[i]
            if block is None:
                break
            freed.append(block)
            table[i] = None  # type: ignore[call-overload]  # vLLM's null block
        if freed:
            self._free_blocks(freed)

    # Admission of a waiting request.

    def _hit(self, request: Request, num_blocks: int) -> list[int | None]:
        """The blocks of the longest cache hit within the request's first `num_blocks` blocks, None
        where the hit holds nothing (SlidingWindowManager.find_longest_cache_hit)."""
        if not num_blocks or not self.blocks_of:
            return []
        keys = request.block_hashes(self.block_size, num_blocks)
        blocks_of, need = self.blocks_of, self.hit_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            if keys[i] in blocks_of:
                run += 1
                if run >= need:
                    return [None] * i + [blocks_of[k][0] for k in keys[i:i + run]]
            else:
                run = 0
        return [blocks_of[k][0] for k in keys[:run]]  # the cached blocks from the start, fewer than `need`

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """The request's prefix hit (`_hit`) within num_tokens - 1 tokens, and how many of the
        blocks it takes are free."""
        if not self.enable_prefix_caching:
            return CachedPrefix([], 0)
        num_blocks = (request.num_tokens - 1) // self.block_size
        if not request.num_preemptions:  # only its shared prompt blocks can be cached before it ran
            num_blocks = min(num_blocks, request.num_shared_blocks(self.block_size))
        hit = self._hit(request, num_blocks)
        refs = self.refs
        taken: list[int] = hit[self._num_skipped(len(hit) * self.block_size):]  # type: ignore[assignment]  # none null
        return CachedPrefix(hit, sum(1 for b in taken if not refs[b]))  # type: ignore[arg-type]  # (null entries)

    def _num_skipped(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) // self.block_size

    def num_cached_blocks(self, request: Request) -> int:
        """The hit a router would find for the request's shared prompt blocks (the whole prompt's)."""
        if not self.enable_prefix_caching or request.hash_ids is None:
            return 0
        return len(self._hit(request, request.num_shared_blocks(self.block_size)))

    def can_allocate(self, cached: CachedPrefix, num_new_tokens: int, num_first_tokens: int = 0) -> bool:
        """allocate_slots' checks for a waiting request with this hit: blocks for `num_new_tokens`
        more, capped at max_admission_blocks when `num_first_tokens` (the first chunk's tokens) is
        given; then blocks for the first chunk, uncapped. Each less the hit's blocks, plus its
        free blocks taken."""
        num_hit = len(cached)
        hit_tokens = num_hit * self.block_size
        if num_first_tokens:
            capped = min(self.blocks_for(hit_tokens + num_new_tokens), self.max_admission_blocks)
            if max(capped - num_hit, 0) + cached.num_free > self.num_free_blocks:
                return False
            num_new_tokens = num_first_tokens
        return max(self.blocks_for(hit_tokens + num_new_tokens) - num_hit, 0) + cached.num_free <= self.num_free_blocks

    def allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> int:
        """Give an admitted request its hit (`cached_prefix`'s, looked up just before): null entries
        for the blocks before the hit's window, the others taken; then blocks for `num_new_tokens`
        more, caching those they fill. Returns the hit in tokens."""
        num_hit = len(cached_blocks) * self.block_size
        skipped = self._num_skipped(num_hit)
        kept = cached_blocks[skipped:]
        self._touch(kept)
        if self.enable_prefix_caching:
            if request.num_preemptions:
                self.num_preempted_queried_tokens += request.num_tokens
                self.num_preempted_hit_tokens += num_hit
            else:
                self.num_queried_tokens += request.num_tokens
                self.num_hit_tokens += num_hit
        table: list = [None] * min(skipped, len(cached_blocks))
        table += kept
        request.block_table = table
        request.num_hashed_blocks = len(table)
        num_after = num_hit + num_new_tokens
        table += self._take(self.blocks_for(num_after) - len(table))
        self._cache(request, min(num_after, request.num_tokens))
        self._scheduled[request.index] = num_new_tokens
        return num_hit

    # Growth of a running request.

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        """allocate_slots for a running request: its skipped blocks are freed first (whether or not
        the rest fits), then its new entries must fit."""
        self._skip(request, request.num_computed_tokens)
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        return needed <= self.num_free_blocks

    def append(self, request: Request, num_new_tokens: int) -> None:
        self._skip(request, request.num_computed_tokens)
        num_after = request.num_computed_tokens + num_new_tokens
        table = request.block_table
        table += self._take(self.blocks_for(num_after) - len(table))
        self._cache(request, min(num_after, request.num_tokens))
        self._scheduled[request.index] = num_new_tokens

    def index_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._cache(request, num_tokens)

    def grow_decodes(self, decoders: list[Request]) -> None:
        """A step's decodes, one token each, in order: each frees its skipped blocks, takes a block if
        its token opens one, and caches the block its token fills (`append`'s work, written out: this
        runs for every decode of every step; the caller checked the free blocks cover the openings)."""
        bs, window, refs, caching = self.block_size, self.window, self.refs, self.enable_prefix_caching
        scheduled = self._scheduled
        for r in decoders:
            computed = r.num_computed_tokens
            table = r.block_table
            n = (computed - window + 1) // bs
            if n > 0 and table[n - 1 if n <= len(table) else -1] is not None:
                self._skip(r, computed)
            scheduled[r.index] = 1
            if len(table) * bs <= computed:
                block = self.pop_free_blocks(1)[0]
                refs[block] = 1
                table.append(block)
            if caching and (computed + 1) // bs > r.num_hashed_blocks:
                self._cache(r, computed + 1)

    def grow_tables(self, owners: list[Request], counts: list[int] | None = None) -> None:
        raise AssertionError("a sliding-window cache grows a step's decodes with grow_decodes")

    def grow_tables_at(self, requests: list[Request], opens: list[int], n: int) -> None:
        raise AssertionError("a sliding-window cache takes no fast-forward runs")

    def take_over(self, request: Request, num_tokens: int) -> None:
        """A fresh table for a request whose first `num_tokens` tokens' KV arrive from elsewhere (a
        disaggregated decode replica): null entries before the window, blocks for the rest
        (allocate_external_computed_blocks), cached once the KV is in."""
        skipped = self._num_skipped(num_tokens)
        table: list = [None] * skipped
        table += self._take(self.blocks_for(num_tokens) - skipped)
        request.block_table = table
        request.num_hashed_blocks = 0
        self._cache(request, num_tokens)

    # A request leaves.

    def free(self, request: Request, preempted: bool = False, num_scheduled: int = 0) -> None:
        """Its held blocks, last first (its full blocks were cached when scheduled)."""
        self._free_blocks([b for b in reversed(request.block_table) if b is not None])
        request.block_table = []
        request.num_hashed_blocks = 0
        self._scheduled.pop(request.index, None)
        self._in_flight.pop(request.index, None)

    def slide(self, running: list[Request]) -> None:
        """At a step's end nothing is freed (a request frees its skipped blocks when it is next
        scheduled); the step's tokens become the ones in flight while the next is scheduled."""
        self._in_flight, self._scheduled = self._scheduled, {}

    # Limits.

    def max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens may hold at once: its window's and the tokens in
        flight (max_admission_blocks), at most all of them."""
        return min(self.blocks_for(num_tokens), self.max_admission_blocks)

    def max_request_tokens(self) -> int:
        """Any length runs when a window's blocks fit the cache (the engine's --max-model-len bounds it)."""
        if self.max_admission_blocks <= self.num_blocks:
            return 1 << 62
        return super().max_request_tokens()

    # For tests.

    @property
    def ref_counts(self) -> list[int]:
        return list(self.refs)

    def indexed_blocks(self, request: Request, i: int) -> list[int]:
        key = request.block_hashes(self.block_size, i + 1)[i]
        return list(self.blocks_of.get(key, []))

    def check_invariants(self, running: list[Request]) -> None:
        """Blocks add up: the running tables' users are the reference counts, free + used = total,
        the free queue holds exactly the unused blocks, the index and the blocks' keys agree."""
        counts = [0] * self.num_blocks
        for r in running:
            for block in r.block_table:
                if block is not None:
                    counts[block] += 1
            assert r.num_hashed_blocks <= len(r.block_table)
        assert counts == self.refs, "reference counts differ from the running block tables"
        free = self._free_plain + self.cached_free_blocks()
        assert len(free) == len(set(free)) == self.num_free_blocks, "a block is free twice"
        assert sorted(free) == [b for b in range(self.num_blocks) if not counts[b]], "free blocks differ from unused ones"
        assert all(self.key_of[b] is None for b in self._free_plain), "a cached block at the head of the queue"
        assert all(self.key_of[b] is not None for b in self.cached_free_blocks()), "an uncached block in the LRU queue"
        indexed = sorted((k, b) for k, bs in self.blocks_of.items() for b in bs)
        assert indexed == sorted((k, b) for b, k in enumerate(self.key_of) if k is not None), "the index is off"
        assert all(self.blocks_of.values()), "an empty key in the index"
