"""Reference: sim/block_manager.py as it was before the per-chunk prefix index (commit cb7f578), kept
unchanged so tests/test_block_manager_reference.py can check the new one against it. Do not optimise it.


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
- A waiting request takes the longest run of cached full blocks from the start of its known
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
"""

from __future__ import annotations

from sim.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}  # the block a lookup of a hash returns: the first indexed
        self._duplicates: dict[int, list[int]] = {}  # further blocks with the same hash, in indexing order
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        # Hashed free blocks, evicted first to last. A hit takes a block out of the middle by counting
        # one more stale entry of it (`_lru_skip`): its entries ahead of its live one are skipped.
        self._lru: list[int] = []  # a queue: its head is at _lru_head (taken entries are dropped now and then)
        self._lru_head = 0
        self._lru_skip = [0] * num_blocks
        self._num_stale = 0  # sum of _lru_skip
        self._num_lru = 0
        self._num_lru_indexed = 0  # of which in the hash index (the others: finished requests' own blocks)
        self.num_queried_tokens = 0  # tokens looked up at first admissions (vLLM's PrefixCacheStats.queries)
        self.num_hit_tokens = 0  # of which found cached (PrefixCacheStats.hits)
        self.num_preempted_queried_tokens = 0  # the same at re-admissions after a preemption
        self.num_preempted_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + self._num_lru

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pop_free_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks from the head of the free queue (the caller checked there
        are enough): blocks without a hash first, then hashed ones, evicted in freeing order."""
        plain = self._free_plain
        take = min(num_blocks, len(plain))
        blocks = plain[:-take - 1:-1] if take else []
        del plain[len(plain) - take:]
        if num_blocks > take:
            num_evict = num_blocks - take
            self._num_lru -= num_evict
            lru, head = self._lru, self._lru_head
            evicted = lru[head:head + num_evict]
            self._lru_head = head + num_evict
            if self._num_stale:
                evicted = self._without_stale(evicted, num_evict)
            head = self._lru_head
            if head >= 4096 and 2 * head >= len(lru):  # drop the entries taken
                del lru[:head]
                self._lru_head = 0
            if self._num_lru_indexed:
                block_hash, hash_to_block = self.block_hash, self.hash_to_block
                num_indexed = 0
                if self._duplicates:
                    for block in evicted:
                        num_indexed += block_hash[block] is not None
                        self._unindex(block)
                else:  # every hash has one block (_unindex inlined: this runs for every eviction)
                    for block in evicted:
                        key = block_hash[block]
                        if key is not None:  # None: a finished request's own block, never indexed
                            del hash_to_block[key]
                            block_hash[block] = None
                            num_indexed += 1
                self._num_lru_indexed -= num_indexed
            blocks += evicted
        ref_counts = self.ref_counts
        for block in blocks:
            ref_counts[block] = 1
        return blocks

    def _without_stale(self, entries: list[int], num_live: int) -> list[int]:
        """The live blocks among LRU entries just taken from the head, topped up to `num_live`."""
        skip, lru = self._lru_skip, self._lru
        live = []
        for block in entries:
            if skip[block]:  # a stale entry: the block left the queue on a hit
                skip[block] -= 1
                self._num_stale -= 1
            else:
                live.append(block)
        while len(live) < num_live:
            block = lru[self._lru_head]
            self._lru_head += 1
            if skip[block]:
                skip[block] -= 1
                self._num_stale -= 1
            else:
                live.append(block)
        return live

    # The hash index.

    def _unindex(self, block: int) -> None:
        key = self.block_hash[block]
        self.block_hash[block] = None
        if key is None:  # a finished request's own block, never indexed
            return
        duplicates = self._duplicates.get(key)
        if self.hash_to_block[key] == block:
            if duplicates:
                self.hash_to_block[key] = duplicates.pop(0)
            else:
                del self.hash_to_block[key]
        else:
            duplicates.remove(block)
        if duplicates is not None and not duplicates:
            del self._duplicates[key]

    def _register(self, request: Request, num_full: int) -> None:
        """Index the request's blocks [num_hashed_blocks, num_full) (full blocks of known tokens)."""
        start = request.num_hashed_blocks
        if num_full <= start:
            return
        keys = request.block_hashes(self.block_size, num_full)
        block_hash, index = self.block_hash, self.hash_to_block.setdefault
        for key, block in zip(keys[start:num_full], request.block_table[start:num_full]):
            block_hash[block] = key
            if index(key, block) != block:  # an identical block is indexed already: this one after it
                self._duplicates.setdefault(key, []).append(block)
        request.num_hashed_blocks = num_full

    # Admission of a waiting request.

    def cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached run of the request's full blocks from its start, at
        most num_tokens - 1 tokens (one token is always computed, for its logits)."""
        if not self.enable_prefix_caching:
            return []
        num_blocks = (request.num_tokens - 1) // self.block_size
        if not request.num_preemptions:
            # Its own tokens (generated ones, and the whole prompt of a request without trace
            # hashes) are cached only once it ran: before, only the shared prompt blocks can hit.
            num_blocks = min(num_blocks, request.num_shared_blocks(self.block_size))
        if not num_blocks:
            return []
        blocks = []
        hash_to_block = self.hash_to_block
        for key in request.block_hashes(self.block_size, num_blocks)[:num_blocks]:
            block = hash_to_block.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_cached_blocks(self, request: Request) -> int:
        """Leading full blocks of the request's prompt that the cache holds now (what a router
        may ask of a replica; unlike `cached_prefix`, a fully cached prompt counts whole)."""
        if not self.enable_prefix_caching or request.hash_ids is None:
            return 0
        num = 0
        hash_to_block = self.hash_to_block
        num_shared = request.num_shared_blocks(self.block_size)  # the prompt's blocks other requests may hold
        for h in request.block_hashes(self.block_size, num_shared)[:num_shared]:
            if h not in hash_to_block:
                break
            num += 1
        return num

    def can_allocate(self, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Whether a request with these cached blocks can get blocks for `num_new_tokens` more."""
        num_new = self.blocks_for(len(cached_blocks) * self.block_size + num_new_tokens) - len(cached_blocks)
        num_taken_from_free = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return num_new + num_taken_from_free <= self.num_free_blocks

    def allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> None:
        """Give an admitted request its cached prefix and blocks for `num_new_tokens` more tokens."""
        ref_counts, skip = self.ref_counts, self._lru_skip
        for block in cached_blocks:
            if ref_counts[block] == 0:  # out of the LRU queue
                skip[block] += 1
                self._num_stale += 1
                self._num_lru -= 1
                self._num_lru_indexed -= 1  # a hit is indexed
            ref_counts[block] += 1
        num_hit = len(cached_blocks) * self.block_size
        if self.enable_prefix_caching:
            if request.num_preemptions:
                self.num_preempted_queried_tokens += request.num_tokens
                self.num_preempted_hit_tokens += num_hit
            else:
                self.num_queried_tokens += request.num_tokens
                self.num_hit_tokens += num_hit
        request.block_table = list(cached_blocks)
        request.num_hashed_blocks = len(cached_blocks)
        request.num_computed_tokens = num_hit
        request.num_prefix_hit_tokens += num_hit
        self.append(request, num_new_tokens)

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
        if self.enable_prefix_caching:
            # Shared blocks now; the request's own blocks when it frees them (module docstring).
            num_full = min(num_after // self.block_size, request.num_shared_blocks(self.block_size))
            if num_full > request.num_hashed_blocks:
                self._register(request, num_full)

    def free(self, request: Request, preempted: bool = False, num_scheduled: int = 0) -> None:
        """Release a finished or preempted request's blocks, tail first: a block whose last user
        leaves goes to the head of the free queue without a hash, to its tail with one. The full
        blocks not indexed yet hold its own tokens: a preempted request may find them again, so
        they are indexed; a finished one's go to the tail unindexed (nobody can find them).
        `num_scheduled`: tokens scheduled in this step for a request preempted after it was
        scheduled (vLLM cached the blocks they fill when it scheduled them)."""
        ref_counts = self.ref_counts
        if not self.enable_prefix_caching:
            for block in request.block_table:
                ref_counts[block] = 0
            self._free_plain.extend(reversed(request.block_table))
        else:
            table = request.block_table
            num_full = (request.num_computed_tokens + num_scheduled) // self.block_size
            if preempted:
                self._register(request, num_full)
            elif num_full > request.num_hashed_blocks:
                shared = request.num_shared_blocks(self.block_size)
                if shared > request.num_hashed_blocks:
                    self._register(request, min(num_full, shared))
            # Its hashed blocks are its first ones (indexed, or full blocks of its own): the rest
            # are the partly filled tail.
            num_full = max(num_full, request.num_hashed_blocks)
            plain = self._free_plain
            for block in reversed(table[num_full:]):
                count = ref_counts[block] - 1
                ref_counts[block] = count
                if not count:
                    plain.append(block)
            # Its own full blocks, not indexed: no other request can have found them, so each
            # has this request's reference only and becomes free.
            hashed = table[request.num_hashed_blocks:num_full]
            hashed.reverse()
            for block in hashed:
                ref_counts[block] = 0
            num_own = len(hashed)
            for block in reversed(table[:request.num_hashed_blocks]):  # indexed
                count = ref_counts[block] - 1
                ref_counts[block] = count
                if not count:
                    hashed.append(block)
            self._lru.extend(hashed)
            self._num_lru += len(hashed)
            self._num_lru_indexed += len(hashed) - num_own
        request.block_table = []
        request.num_hashed_blocks = 0

    def cached_free_blocks(self) -> list[int]:
        """The hashed free blocks, in eviction order (the LRU queue without its stale entries)."""
        skip = list(self._lru_skip)
        live = []
        for block in self._lru[self._lru_head:]:
            if skip[block]:
                skip[block] -= 1
            else:
                live.append(block)
        return live

    def check_invariants(self, running: list[Request]) -> None:
        """Blocks add up: free + used = total, reference counts match the block tables, and the
        hash index and the blocks' hashes agree."""
        counts = [0] * self.num_blocks
        for r in running:
            for b in r.block_table:
                counts[b] += 1
        assert counts == self.ref_counts, "reference counts differ from the running block tables"
        num_used = sum(1 for c in counts if c > 0)
        assert num_used + self.num_free_blocks == self.num_blocks, "free + used != total"
        indexed = [(h, b) for h, b in self.hash_to_block.items()]
        indexed += [(h, b) for h, blocks in self._duplicates.items() for b in blocks]
        assert all(self.block_hash[b] == h for h, b in indexed), "the hash index and the blocks' hashes disagree"
        assert all(blocks for blocks in self._duplicates.values()) and set(self._duplicates) <= set(self.hash_to_block)
        assert sum(h is not None for h in self.block_hash) == len(indexed), "a hashed block is not indexed"
        lru = self.cached_free_blocks()
        assert len(lru) == self._num_lru and sum(self._lru_skip) == self._num_stale == len(self._lru) - self._lru_head - len(lru)
        assert self._num_lru_indexed == sum(self.block_hash[b] is not None for b in lru)
        free = set(self._free_plain) | set(lru)
        assert len(free) == self.num_free_blocks, "a block is free twice"
        assert all(counts[b] == 0 for b in free), "a used block is also free"
        assert all(self.block_hash[b] is None for b in self._free_plain), "a hashed block in the plain pool"
        # (The LRU queue may hold blocks without a hash: finished requests' own, never indexed.)
        for r in running:
            assert all(self.block_hash[b] is not None for b in r.block_table[:r.num_hashed_blocks])
