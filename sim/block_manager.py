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
    # SlidingWindowBlockManager (sim/sliding_block_manager.py): no fast-forward runs (`slides_windows`),
    # and a request frees blocks when it is scheduled, so a step's decodes grow through `grow_decodes`
    # (each frees, then takes), not `grow_tables` (policies/base.py _schedule_decodes).
    slides_windows = False
    frees_when_scheduled = False
    pipelined = False  # set by the engine while it schedules beside a step in flight ...
    step_in_flight = -1  # ... and that step's index (asynchronous scheduling: `num_cached_tokens`)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queried_tokens = 0  # tokens looked up at first admissions (vLLM's PrefixCacheStats.queries)
        self.num_hit_tokens = 0  # of which found cached (PrefixCacheStats.hits)
        self.num_preempted_queried_tokens = 0  # the same at re-admissions after a preemption
        self.num_preempted_hit_tokens = 0
        # Blocks a decode step takes for each request whose token opens a block: one (a cache of
        # several groups opens one in each: SlidingWindowBlockManager).
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

    def can_allocate(self, cached: CachedPrefix, num_new_tokens: int, num_first_tokens: int = 0, reserve: int = 0) -> bool:
        """Whether a request with this cached prefix (`cached_prefix`'s answer) can get blocks for
        `num_new_tokens` more (SingleTypeKVCacheManager.get_num_blocks_to_allocate: a hit on a
        free block takes it out of the free queue too). `num_first_tokens`: the tokens of its first
        chunk when `num_new_tokens` reserves its whole sequence; they need fewer blocks here (a
        sliding window's cap can make them the stricter check: SlidingWindowBlockManager). `reserve`:
        blocks that must stay free besides (the watermark: Policy._try_admit)."""
        num_new = self.blocks_for(len(cached) * self.block_size + num_new_tokens) - len(cached)
        return num_new + cached.num_free + reserve <= self.num_free_blocks

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
        self._count_hit(request, num_hit)
        request.block_table = table = list(cached_blocks)
        request.num_hashed_blocks = num_cached
        num_after = num_hit + num_new_tokens
        num_new = self.blocks_for(num_after) - num_cached
        if num_new > 0:
            table.extend(self.pop_free_blocks(num_new))
        self.index_full_blocks(request, num_after)
        return num_hit

    def _count_hit(self, request: Request, num_hit: int) -> None:
        """vLLM's prefix-cache stats at an admission: the request's tokens looked up, `num_hit` of
        them found (PrefixCacheStats.record), apart for a request readmitted after a preemption."""
        if self.enable_prefix_caching:
            if request.num_preemptions:
                self.num_preempted_queried_tokens += request.num_tokens
                self.num_preempted_hit_tokens += num_hit
            else:
                self.num_queried_tokens += request.num_tokens
                self.num_hit_tokens += num_hit

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
            num_full = self.num_cached_tokens(request, num_scheduled) // self.block_size
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

    def release_finished(self, request: Request) -> None:
        """A finished request's blocks back to the pool (its hashed blocks stay cached there), and its
        block keys dropped: it is never looked up again. The engine's, and a policy's for a finishing
        request it preempts (policies/base.py `_preempt`)."""
        self.free(request)
        request.drop_block_hashes()

    def num_cached_tokens(self, request: Request, num_scheduled: int = 0) -> int:
        """The tokens whose full blocks vLLM has cached for the request when it leaves
        (`num_scheduled`: its tokens of this step, for a request preempted after it was scheduled in
        it): all it computed, but one less when it is preempted, under asynchronous scheduling, while
        vLLM does not know a token it computed yet. KVCacheManager.allocate_slots caches
        `min(num_computed + num_new, request.num_tokens)`, and vLLM's num_tokens leaves out a token
        in flight (its placeholder, AsyncScheduler._update_after_schedule); Scheduler.update_from_output
        caches up to `num_computed_tokens - num_in_flight_tokens` once a step's output is processed.
        So the block filled by a token sampled in the step in flight (scheduled in this step), or, in
        the step in flight, by the token sampled in the step before (Request.cached_short_step), is
        not cached: freed to the free queue's head. A finished request's output was processed: all."""
        short = False
        if self.pipelined:  # a preemption beside the step in flight
            if num_scheduled:
                short = request.last_sampled_step == self.step_in_flight
            else:
                short = request.cached_short_step == self.step_in_flight
        return request.num_computed_tokens + num_scheduled - short

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

    # What a cache of sliding-window groups (SlidingWindowBlockManager) changes; a single group's answers.

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
        """At a step's end (SlidingWindowBlockManager: the step's tokens are then the ones in flight)."""

    def extra_blocks(self, request: Request) -> list[int]:
        """Blocks the request holds besides its block table (a cache's other groups)."""
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
