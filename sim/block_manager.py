"""The paged KV cache's block manager, with prefix caching, by vLLM V1's rules (version 0.33).

Each rule, and where vLLM implements it:

- Free blocks form one queue, taken from the head (BlockPool.get_new_blocks, popleft_n). A freed
  block without a hash goes to the head (reused first), a freed block with a hash to the tail
  (BlockPool.free_blocks: prepend_n / append_n). Blocks without a hash hold nothing anyone can
  reuse, so which of them is taken makes no difference: here they are a stack (`_free_plain`)
  taken before the hashed ones, which are an LRU queue in freeing order (`_lru`; a block a hit
  takes out of it is skipped when it reaches the head, see `_lru_skip`).
- A request's blocks are freed tail first, so its last blocks are evicted before its prefix
  (SingleTypeKVCacheManager.free: `reversed(...)`).
- Taking a hashed free block evicts it: its hash leaves the index (BlockPool.get_new_blocks,
  _maybe_evict_cached_block).
- Every full block is cached: prompt and generated tokens alike, whether or not an identical
  block is already indexed; duplicates stay indexed and a lookup returns the one indexed first
  (BlockPool.cache_full_blocks, BlockHashToBlockMap.insert / get_one_block).
- When: at scheduling, for the blocks this step's tokens fill (KVCacheManager.allocate_slots calls
  cache_blocks with `min(num_computed + num_new, num_tokens)`). Blocks that may hold content
  shared with other requests (prompt blocks with trace hashes) are indexed then. A block of the
  request's own tokens (generated ones, or a prompt without trace hashes) can only ever be
  looked up by its own request, after a preemption: it is given its hash lazily, when the
  request's blocks are freed, which gives the same index and the same free queue (a held block
  is never evicted). A finished request never comes back, so its own blocks go to the free
  queue's tail, as vLLM's hashed blocks do, without entering the index.
- A waiting request takes the longest stretch of cached full blocks from the start of its known
  tokens (prompt, and the tokens it generated before a preemption), at most `num_tokens - 1`
  tokens: a whole-prompt hit recomputes the last block to get logits for the last token
  (KVCacheManager.get_computed_blocks, FullAttentionManager.find_longest_cache_hit).
- A hit block's reference count grows by one, and a free one leaves the free queue; a shared
  block returns to the queue when its last user frees it (BlockPool.touch, free_blocks). A hit
  on a free block counts against the free blocks when admitting
  (SingleTypeKVCacheManager.get_num_blocks_to_allocate, num_evictable_blocks).
- The prefix-cache hit rate counts tokens at admissions of requests never preempted: queries
  are the request's tokens, hits its cached tokens (KVCacheManager.record_prefix_cache_stats,
  PrefixCacheStats.record). Re-admissions after a preemption are counted apart.

vLLM's pool also holds a null block (block 0) that no request gets; servesim's `num_blocks` are
all usable (vLLM's `num_gpu_blocks` minus one).

The manager is three classes, as vLLM 0.33 splits it (vllm/v1/core/): the free queue
(sim/block_pool.py, `BlockPool`: block_pool.py's BlockPool and kv_cache_utils.py's
FreeKVCacheBlockQueue), the index of cached blocks with their reference counts
(sim/prefix_index.py, `PrefixIndex`: block_pool.py's BlockHashToBlockMap, BlockPool.touch and
single_type_kv_cache_manager.py's find_longest_cache_hit), and this one, which admits, grows and
frees requests (kv_cache_manager.py's KVCacheManager: get_computed_blocks, allocate_slots, free).
Each is a subclass of the one before (the hot paths read the pool's and the index's fields
directly: no call between them on the way).
"""

from __future__ import annotations

from sim import block_checks
from sim.prefix_index import HELD, PrefixIndex
from sim.request import Request


class CachedPrefix(list):
    """What `cached_prefix` returns: the blocks of the cached prefix, and how many of them are
    free (each a block to take out of the free queue on admission)."""

    __slots__ = ("num_free",)

    def __init__(self, blocks: list[int], num_free: int):
        super().__init__(blocks)
        self.num_free = num_free


class BlockManager(PrefixIndex):
    slides_windows = False  # HybridBlockManager: sliding groups free blocks after each step (`slide`)
    # SlidingWindowBlockManager: a request frees blocks when it is scheduled, so a step's decodes grow
    # through `grow_decodes` (each frees, then takes), not `grow_tables` (policies/base.py _schedule_decodes).
    frees_when_scheduled = False
    pipelined = False  # set by the engine while it schedules beside a step in flight (read by SlidingWindowBlockManager)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queried_tokens = 0  # tokens looked up at first admissions (vLLM's PrefixCacheStats.queries)
        self.num_hit_tokens = 0  # of which found cached (PrefixCacheStats.hits)
        self.num_preempted_queried_tokens = 0  # the same at re-admissions after a preemption
        self.num_preempted_hit_tokens = 0
        # Blocks a decode step takes for each request whose token opens a block: one (a hybrid
        # cache's other groups each open one too, at most: HybridBlockManager).
        self.blocks_per_opening = 1

    # Admission of a waiting request.

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """Blocks holding the longest cached stretch of the request's full blocks from its start, at
        most num_tokens - 1 tokens (one token is always computed, for its logits)."""
        if not self.enable_prefix_caching:
            return CachedPrefix([], 0)
        num_blocks = (request.num_tokens - 1) // self.block_size
        if not request.num_preemptions:
            # Its own tokens (generated ones, and the whole prompt of a request without trace
            # hashes) are cached only once it ran: before, only the shared prompt blocks can hit.
            num_blocks = min(num_blocks, request.num_shared_blocks(self.block_size))
        if not num_blocks:
            return CachedPrefix([], 0)
        num_shared = request.num_shared_blocks(self.block_size)
        blocks, num_free = self._shared_hits(request, min(num_blocks, num_shared))
        if num_blocks > num_shared == len(blocks):  # its own blocks, indexed when it was preempted
            hash_to_block = self.hash_to_block
            for key in request.block_hashes(self.block_size, num_blocks)[num_shared:num_blocks]:
                block = hash_to_block.get(key)
                if block is None:
                    break
                blocks.append(block)
                num_free += 1  # only this request finds them, and it holds none while it waits
        return CachedPrefix(blocks, num_free)

    def num_cached_blocks(self, request: Request) -> int:
        """Leading full blocks of the request's prompt that the cache holds now (what a router
        may ask of a replica; unlike `cached_prefix`, a fully cached prompt counts whole)."""
        if not self.enable_prefix_caching or request.hash_ids is None:
            return 0
        return len(self._shared_hits(request, request.num_shared_blocks(self.block_size))[0])

    def can_allocate(self, cached: CachedPrefix, num_new_tokens: int, num_first_tokens: int = 0) -> bool:
        """Whether a request with this cached prefix (`cached_prefix`'s answer) can get blocks for
        `num_new_tokens` more (SingleTypeKVCacheManager.get_num_blocks_to_allocate: a hit on a
        free block takes it out of the free queue too). `num_first_tokens`: the tokens of its first
        chunk when `num_new_tokens` reserves its whole sequence; they need fewer blocks here (a
        sliding window's cap can make them the stricter check: SlidingWindowBlockManager)."""
        num_new = self.blocks_for(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return num_new + cached.num_free <= self.num_free_blocks

    def allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> int:
        """Give an admitted request its cached prefix (`cached_prefix`'s blocks, looked up just
        before) and blocks for `num_new_tokens` more tokens. Returns the prefix hit in tokens: the
        request's computed tokens now (the caller sets them; this changes only its blocks)."""
        num_cached = len(cached_blocks)
        if num_cached:
            skip, state = self._lru_skip, self._state
            num_shared = min(num_cached, request.num_shared_blocks(self.block_size))
            num_taken = num_cached - num_shared  # its own blocks are free (cached_prefix)
            for block in cached_blocks[num_shared:]:
                skip[block] += 1
            # Hits on free blocks: out of the LRU queue (the others are shared with a running
            # request), a span of slots at a time while all of its blocks are free.
            helds = self._helds
            for slot, a, b in self._slot_spans(request, num_shared):
                n = b - a
                if max(state[slot:slot + n]) < HELD:
                    state[slot:slot + n] = helds if n == len(helds) else [HELD] * n  # (a stretch may pass a row)
                    for block in cached_blocks[a:b]:
                        skip[block] += 1
                    num_taken += n
                    continue
                for block, k in zip(cached_blocks[a:b], range(slot, slot + n)):
                    s = state[k]
                    if s < HELD:  # (a free block still indexed: its state is live)
                        skip[block] += 1
                        num_taken += 1
                        state[k] = HELD
                    else:
                        state[k] = s + 1
            self._num_stale += num_taken
            self._num_lru -= num_taken
            self._num_shared += num_cached - num_taken
        num_hit = num_cached * self.block_size
        if self.enable_prefix_caching:
            if request.num_preemptions:
                self.num_preempted_queried_tokens += request.num_tokens
                self.num_preempted_hit_tokens += num_hit
            else:
                self.num_queried_tokens += request.num_tokens
                self.num_hit_tokens += num_hit
        request.block_table = table = list(cached_blocks)
        request.num_hashed_blocks = num_cached
        num_after = num_hit + num_new_tokens
        num_new = self.blocks_for(num_after) - num_cached
        if num_new > 0:
            table.extend(self.pop_free_blocks(num_new))
        self.index_full_blocks(request, num_after)
        return num_hit

    # Growth of a running request.

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        return needed <= self.num_free_blocks

    def append(self, request: Request, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens of the request (the caller checked
        can_append), and index the blocks they fill."""
        table = request.block_table
        num_after = request.num_computed_tokens + num_new_tokens
        num_new = self.blocks_for(num_after) - len(table)
        if num_new > 0:
            table.extend(self.pop_free_blocks(num_new))
        self.index_full_blocks(request, num_after)

    def index_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the shared blocks that the request's first `num_tokens` tokens fill: `append`'s
        indexing, also for blocks given to the request by hand (a chunk run's, sim/fast_forward.py).
        Shared blocks now; the request's own blocks when it frees them (module docstring)."""
        if self.enable_prefix_caching:
            num_full = min(num_tokens // self.block_size, request.num_shared_blocks(self.block_size))
            if num_full > request.num_hashed_blocks:
                self._register(request, num_full)

    # A request leaves.

    def free(self, request: Request, preempted: bool = False, num_scheduled: int = 0) -> None:
        """Release a finished or preempted request's blocks, tail first: a block whose last user
        leaves goes to the head of the free queue without a hash, to its tail with one. The full
        blocks not indexed yet hold its own tokens: a preempted request may find them again, so
        they are indexed; a finished one's go to the tail unindexed (nobody can find them).
        `num_scheduled`: tokens scheduled in this step for a request preempted after it was
        scheduled (vLLM cached the blocks they fill when it scheduled them)."""
        table = request.block_table
        if not self.enable_prefix_caching:
            self._free_plain.extend(reversed(table))
        else:
            num_full = (request.num_computed_tokens + num_scheduled) // self.block_size
            if preempted:
                self._register(request, num_full)
            elif num_full > request.num_hashed_blocks:
                shared = request.num_shared_blocks(self.block_size)
                if shared > request.num_hashed_blocks:
                    self._register(request, min(num_full, shared))
            # Its hashed blocks are its first ones (indexed, or full blocks of its own): the rest
            # are the partly filled tail, blocks nobody else holds, free at once.
            num_hashed = request.num_hashed_blocks
            num_full = max(num_full, num_hashed)
            tail = table[num_full:]
            tail.reverse()
            self._free_plain.extend(tail)
            spans = self._slot_spans(request, num_hashed)
            state = self._state
            if self._num_shared and any(max(state[slot:slot + b - a]) > HELD for slot, a, b in spans) or (
                    self._dup_state and not self._dup_state.keys().isdisjoint(table[:num_hashed])):
                self._free_some(table, num_full, spans)
            else:  # each of its blocks is its own: all of them become free, its full ones to the queue's tail
                hashed = table[:num_full]  # its own full blocks (not indexed) after the indexed ones
                hashed.reverse()
                # Its block k is the queue's entry `top - k`, at slot `slot + k - a` of its span: every
                # slot of the span gets the state top - a + slot.
                top = self._lru_offset + len(self._lru) + num_full - 1
                for slot, a, b in spans:
                    state[slot:slot + b - a] = [top - a + slot] * (b - a)
                self._lru.extend(hashed)
                self._num_lru += num_full
        request.block_table = []
        request.num_hashed_blocks = 0

    def _free_some(self, table: list[int], num_full: int, spans: list[tuple[int, int, int]]) -> None:
        """free() of full blocks when some of the request's are shared or duplicates: each loses
        its reference, and only those left with none become free, to the queue's tail in order
        (tail first). A span of slots whose blocks are all the request's alone is freed with slice
        stores, as free() frees them; the others block by block."""
        slots, state, dup_state = self._slots, self._state, self._dup_state
        position = self._lru_offset + len(self._lru)
        num_shared = spans[-1][2] if spans else 0
        freed = table[num_shared:num_full]  # its own full blocks: nobody else holds them
        freed.reverse()
        position += len(freed)
        for slot, a, b in reversed(spans):
            n = b - a
            blocks = table[a:b]
            states = state[slot:slot + n]
            if max(states) == HELD and (not dup_state or dup_state.keys().isdisjoint(blocks)):
                # Its own blocks, each the one in its slot: block k is entry position + b - 1 - k.
                state[slot:slot + n] = [position + b - 1 - a + slot] * n
                blocks.reverse()
                freed += blocks
                position += n
                continue
            for k in range(n - 1, -1, -1):
                block, at = blocks[k], slot + k
                if slots[at] == block:  # the block in its slot
                    s = states[k]
                    if s > HELD:  # shared with a running request: stays in use
                        state[at] = s - 1
                        self._num_shared -= 1
                        continue
                    state[at] = position + at
                else:  # a duplicate behind it
                    dup_state[block] = position
                freed.append(block)
                position += 1
        self._lru.extend(freed)
        self._num_lru += len(freed)

    def grow_decodes(self, decoders: list[Request]) -> None:
        """A step's decodes, one token each (the caller checked the free blocks cover their opening
        blocks), for a cache that frees blocks as it schedules (`frees_when_scheduled`:
        SlidingWindowBlockManager); here, the opening blocks alone."""
        bs = self.block_size
        self.grow_tables([r for r in decoders if len(r.block_table) * bs <= r.num_computed_tokens])

    # What a hybrid cache (HybridBlockManager, below) changes; a single group's answers.

    def max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens may hold at once (more than the cache: rejected)."""
        return self.blocks_for(num_tokens)

    def max_request_tokens(self) -> int:
        """The most tokens one request may hold KV for (`max_blocks_needed` of them fit the whole
        cache; a request needing more can never run): the largest such count, by bisection
        (`max_blocks_needed` grows with the tokens)."""
        low, high = 0, self.num_blocks * self.block_size  # (every token needs a block slot)
        while low < high:
            mid = (low + high + 1) // 2
            if self.max_blocks_needed(mid) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def slide(self, running: list[Request]) -> None:
        """After a step: blocks that sliding windows no longer need are freed (HybridBlockManager)."""

    def extra_blocks(self, request: Request) -> list[int]:
        """Blocks the request holds besides its block table (a hybrid cache's other groups)."""
        return []

    # For tests: sim/block_checks.py.

    @property
    def ref_counts(self) -> list[int]:
        """Users of each block (0: free), as vLLM counts them; made from the state, for tests."""
        return block_checks.ref_counts(self)

    def indexed_blocks(self, request: Request, i: int) -> list[int]:
        """The blocks indexed with the key of the request's block i, in indexing order (a lookup
        returns the first); for tests."""
        return block_checks.indexed_blocks(self, request, i)

    def check_invariants(self, running: list[Request]) -> None:
        """Blocks add up and the pool, the index and the running block tables agree (block_checks)."""
        block_checks.check_invariants(self, running)


# Hybrid models: sliding-window and full-attention layers (vLLM's hybrid KV cache manager).

FULL, SLIDING = "full_attention", "sliding_attention"


class HybridBlockManager(BlockManager):
    """The block manager of a model with several KV cache groups, sliding-window layers among them
    (vllm/v1/core/kv_cache_coordinator.py HybridKVCacheCoordinator): one pool of blocks shared by
    the groups, a block table per group and request.

    `groups` is the layout as plain data, one (kind, sliding_window) per group in vLLM's order
    (backends/kv_capacity.py kv_cache_groups; sim/app/plan.py passes it). The first full-attention
    group is the primary one: its table is `Request.block_table`, with every rule of BlockManager
    (prefix caching, the free queue's order). Each other group's blocks are plain blocks of the same
    pool, held per request here:

    - a full-attention group holds every block of the request's tokens, as the primary;
    - a sliding group holds only its window's: `blocks_held` blocks, those wholly before the window
      freed as it slides (single_type_kv_cache_manager.py SlidingWindowManager:
      get_num_skipped_tokens = max(0, computed - window + 1), remove_skipped_blocks frees the
      skipped // block_size blocks before it). vLLM frees them at the request's next scheduling
      (KVCacheManager.allocate_slots, before it counts the blocks to allocate); here at the end of
      the step that computed the tokens (`slide`, called by the engine), which is the same point
      for the count of free blocks: nothing takes blocks between a step's end and the next
      scheduling.

    What is simpler than vLLM, and said so (docs/kv-cache.md):
    - the secondary groups' blocks are never cached: freed, they go to the head of the free queue
      (vLLM frees a cached sliding block to the tail, with its hash);
    - prefix caching: a hit is the primary group's (FullAttentionManager.find_longest_cache_hit);
      vLLM's sliding group then needs the cdiv(window - 1, block_size) blocks before the hit cached
      (SlidingWindowManager.find_longest_cache_hit), taken here to be cached while their
      full-attention twins are. The window's blocks at the hit are taken fresh from the pool (vLLM
      shares them with a running request holding them);
    - async scheduling's in-flight tokens (allocate_slots' num_in_flight_tokens) are not subtracted.
    A model whose only group slides (Mistral-7B-v0.1) keeps BlockManager: every block charged."""

    slides_windows = True

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 groups: tuple[tuple[str, int | None], ...], max_admission_tokens: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        kinds = [kind for kind, _ in groups]
        if FULL not in kinds or any(k not in (FULL, SLIDING) for k in kinds):
            raise ValueError(f"a hybrid KV cache needs a full-attention group and sliding ones, got {kinds}")
        primary = kinds.index(FULL)
        # The other groups' windows (None: full attention), in vLLM's group order.
        self.windows: list[int | None] = [w if k == SLIDING else None
                                          for i, (k, w) in enumerate(groups) if i != primary]
        self.blocks_per_opening = 1 + len(self.windows)
        # SlidingWindowSpec.max_admission_blocks_per_request's tokens: window - 1 + the tokens in
        # flight, at most max_model_len (what a full-prompt reservation charges a sliding group).
        self.max_admission_tokens = max_admission_tokens
        self._held: dict[int, list[list[int]]] = {}  # request index -> per other group, its blocks held
        self._skipped: dict[int, list[int]] = {}  # ... and the blocks freed before its window

    def _skip(self, window: int | None, num_computed: int) -> int:
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def _need(self, request: Request | None, num_computed: int, num_tokens: int) -> tuple[int, int]:
        """(blocks the other groups take, blocks they free) for the request to hold `num_tokens`
        tokens with `num_computed` computed; None: a request holding nothing yet."""
        target = self.blocks_for(num_tokens)
        new = freed = 0
        for g, window in enumerate(self.windows):
            held, skipped = (len(self._held[request.index][g]), self._skipped[request.index][g]) \
                if request is not None and request.index in self._held else (0, 0)
            end = skipped + held  # the table's length
            skip = max(skipped, self._skip(window, num_computed))
            freed += min(skip, end) - skipped if skip > skipped else 0
            new += max(0, target - max(end, skip))
        return new, freed

    def max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens may hold at once, every group together (its
        admission: a sliding group's at most its window's and the tokens in flight)."""
        blocks = self.blocks_for(num_tokens)
        cap = -(-min(self.max_admission_tokens, num_tokens) // self.block_size) + 1
        return blocks + sum(blocks if w is None else min(blocks, cap) for w in self.windows)

    def can_allocate(self, cached: CachedPrefix, num_new_tokens: int, num_first_tokens: int = 0) -> bool:
        num_hit = len(cached) * self.block_size
        num_tokens = num_hit + num_new_tokens
        num_new = self.blocks_for(num_tokens) - len(cached)
        blocks = self.blocks_for(num_tokens)
        cap = -(-min(self.max_admission_tokens, num_tokens) // self.block_size) + 1
        other = sum(blocks if w is None else min(blocks - min(self._skip(w, num_hit), blocks), cap)
                    for w in self.windows)
        return num_new + cached.num_free + other <= self.num_free_blocks

    def allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> int:
        num_hit = super().allocate(request, cached_blocks, num_new_tokens)
        target = self.blocks_for(num_hit + num_new_tokens)
        held, skipped = [], []
        for window in self.windows:
            skip = min(self._skip(window, num_hit), target)
            held.append(self.pop_free_blocks(target - skip))
            skipped.append(skip)
        self._held[request.index], self._skipped[request.index] = held, skipped
        return num_hit

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        num_computed = request.num_computed_tokens
        needed = self.blocks_for(num_computed + num_new_tokens) - len(request.block_table)
        new, freed = self._need(request, num_computed, num_computed + num_new_tokens)
        return needed + new <= self.num_free_blocks + freed

    def append(self, request: Request, num_new_tokens: int) -> None:
        super().append(request, num_new_tokens)
        self._grow_others(request, request.num_computed_tokens + num_new_tokens)

    def grow_tables(self, owners: list[Request], counts: list[int] | None = None) -> None:
        """A decode step's opening blocks (the policy's bulk path): each owner's primary block,
        then its other groups' (fast-forward, which hands out a run's blocks in one go with
        `counts`, is off for a hybrid cache: `slides_windows`)."""
        assert counts is None, "a hybrid cache grows one decode step at a time (no fast-forward runs)"
        for request in owners:
            super().grow_tables([request])
            self._grow_others(request, request.num_computed_tokens + 1)

    def grow_tables_at(self, requests: list[Request], opens: list[int], n: int) -> None:
        raise AssertionError("a hybrid cache grows one decode step at a time (no fast-forward runs)")

    def take_over(self, request: Request, num_tokens: int) -> None:
        super().take_over(request, num_tokens)
        self._held[request.index] = [[] for _ in self.windows]
        self._skipped[request.index] = [0] * len(self.windows)
        self._slide_one(request, num_tokens)
        self._grow_others(request, num_tokens)

    def _grow_others(self, request: Request, num_tokens: int) -> None:
        """The other groups' blocks up to `num_tokens` tokens (after any slide)."""
        target = self.blocks_for(num_tokens)
        for held, skipped in zip(self._held[request.index], self._skipped[request.index]):
            end = skipped + len(held)
            if target > end:
                held.extend(self.pop_free_blocks(target - end))

    def _slide_one(self, request: Request, num_computed: int) -> None:
        held_all, skipped_all = self._held[request.index], self._skipped[request.index]
        for g, window in enumerate(self.windows):
            skip = self._skip(window, num_computed)
            skipped = skipped_all[g]
            if skip > skipped:
                held = held_all[g]
                gone = held[:skip - skipped]
                del held[:skip - skipped]
                gone.reverse()
                self._free_plain.extend(gone)
                skipped_all[g] = skipped + len(gone)

    def slide(self, running: list[Request]) -> None:
        """After a step: each running request's sliding groups free the blocks now wholly before
        their windows (remove_skipped_blocks with its computed tokens)."""
        held = self._held
        for request in running:
            if request.index in held:
                self._slide_one(request, request.num_computed_tokens)

    def free(self, request: Request, preempted: bool = False, num_scheduled: int = 0) -> None:
        super().free(request, preempted, num_scheduled)
        held = self._held.pop(request.index, None)
        if held is not None:
            del self._skipped[request.index]
            for blocks in held:  # tail first, as SingleTypeKVCacheManager.free
                self._free_plain.extend(reversed(blocks))

    def extra_blocks(self, request: Request) -> list[int]:
        return [b for blocks in self._held.get(request.index, []) for b in blocks]

    def held_by_group(self, request: Request) -> list[int]:
        """Blocks the request holds in each group, vLLM's group order (for tests)."""
        return [len(request.block_table)] + [len(blocks) for blocks in self._held.get(request.index, [])]
