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

The index. vLLM keeps one dict entry per block hash (BlockHashToBlockMap). Here the same lookups
are kept coarser, because a shared block's key is fixed by the trace block it ends in and its
place there (Request.block_hashes): the chained hash of the trace's hash ids up to that trace
block (Request.prefix_chain) names a chunk, one dict entry (`_chunk_of`), whose slots, one for
each block that can end in that trace block, hold the block indexed first with that key (a
stretch of the flat list `_slots`). Beside each slot a state (`_state`) says what its block is:

- held by running requests: HELD + (users - 1), so a hit on a held block adds one;
- free: the absolute position of its entry in the LRU queue plus the slot's number. The block is
  still indexed while that entry is at or past the queue's head (`_head_abs`); once the head has
  passed it, the block was evicted and the slot is empty. So an eviction only moves the head: no
  slot is touched, no block's count either (a block nobody indexes needs none: it has one user
  while held). Adding the slot's number makes a run of slots freed together share one state (a
  request frees its blocks tail first: its block k, at slot s0 + k, is the queue's entry top - k),
  so freeing them is a slice store of one repeated value.

A request's blocks occupy consecutive slots within each chunk, so indexing them, freeing them
(their slots get their entries' positions, consecutive too) and looking them up are slice
operations on `_slots` and `_state`: no loop over blocks. Trace blocks new to the index take
chunks numbered in a row where they can (`_new_chunks`: emptied chunks are kept sorted for that),
so a request's slots mostly run on from one chunk into the next, and a stretch of them over
several chunks (`_slot_runs`) is still one slice store. A chunk whose slots are all empty stays
in the dict until a sweep (`_sweep`, when chunks run out) takes it out for reuse: a lookup finds
nothing in an empty chunk, as in none, and indexing into it is indexing into a fresh one, so when
it leaves changes no answer. Duplicates (an identical block indexed while one is) wait behind the
block in their slot (`_duplicates`, by slot), in indexing order, each with its own state
(`_dup_state`); when the block in the slot is evicted the first duplicate takes its place. A hit
on a block only ever finds the one in the slot. A request's own blocks (negative keys, indexed on
a preemption: rare) are indexed per block (`hash_to_block`, `block_hash`), their duplicates in
`_duplicates` by key; only their own request can find them, after a preemption, so a hit on one
always finds it free. tests/test_block_manager_reference.py checks this against a previous
implementation, with one dict entry and one reference count per block as vLLM
(tests/reference_block_manager.py).
"""

from __future__ import annotations

from operator import itemgetter, sub

from sim.request import Request

HELD = 1 << 62  # a slot's state while its block is held: HELD + (users - 1); below it, a free block's LRU position + slot
EMPTY = -1  # a new slot's state: before every position


def _gather(values: list, indices: list[int]) -> tuple | list:
    """values[i] for each i in indices, in order (itemgetter takes them in one call)."""
    return itemgetter(*indices)(values) if len(indices) > 1 else [values[i] for i in indices]


class CachedPrefix(list):
    """What `cached_prefix` returns: the blocks of the cached prefix, and how many of them are
    free (each a block to take out of the free queue on admission)."""

    __slots__ = ("num_free",)

    def __init__(self, blocks: list[int], num_free: int):
        super().__init__(blocks)
        self.num_free = num_free


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The index of shared blocks, by trace block (module docstring, "The index").
        self._chunk_of: dict[int, int] = {}  # chain hash -> its chunk's number (1, 2, ...)
        self._chunk_hash: list[int] = [0]  # chunk number -> its chain hash (chunk 0 is nobody's)
        self._unused_chunks: list[int] = []  # numbers of chunks that left the index, for reuse
        self._width = 0  # slots per chunk, set by the first request with trace hashes
        self._slots: list[int | None] = []  # chunk c's slots are [c * width, (c + 1) * width): the block indexed there
        self._state: list[int] = []  # each slot's state: HELD + users - 1, or its free block's LRU position
        self._helds: list[int] = []  # [HELD] * width, a slice of it marks a run of slots held
        self._sweep_at = 16  # chunks made before empty ones are looked for (_sweep)
        # Blocks waiting behind the one in their slot (> 0), or own key (< 0), in indexing order.
        self._duplicates: dict[int, list[int]] = {}
        self._dup_state: dict[int, int] = {}  # a duplicate in a slot -> HELD, or its LRU position while free
        # The index of the requests' own blocks, by block key (negative).
        self.hash_to_block: dict[int, int] = {}  # the block a lookup of a key returns: the first indexed
        self.block_hash: list[int | None] = [None] * num_blocks  # an own block's key, if indexed
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        # Hashed free blocks, evicted first to last. A hit takes a block out of the middle by counting
        # one more stale entry of it (`_lru_skip`): its entries ahead of its live one are skipped.
        self._lru: list[int] = []  # a queue: its head is at _lru_head (taken entries are dropped now and then)
        self._lru_head = 0
        self._lru_offset = 0  # entries dropped from the front: _lru[i] is at absolute position _lru_offset + i
        self._lru_skip = [0] * num_blocks
        self._num_stale = 0  # sum of _lru_skip
        self._num_lru = 0
        # References beyond a block's first, over all blocks (the sum of max(users - 1, 0)): while
        # none is shared, a request's blocks are all its own and free() needs no counts.
        self._num_shared = 0
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

    @property
    def _head_abs(self) -> int:
        """The LRU queue head's absolute position: slot s is live while its state - s is at or past it."""
        return self._lru_offset + self._lru_head

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def ref_counts(self) -> list[int]:
        """Users of each block (0: free), as vLLM counts them; made from the state, for tests."""
        counts = [1] * self.num_blocks
        for block in self._free_plain + self.cached_free_blocks():
            counts[block] = 0
        for indexed, state in zip(self._slots, self._state):  # an empty slot holds None
            if state >= HELD:
                assert indexed is not None, "a held slot holds no block"
                counts[indexed] = state - HELD + 1
        return counts

    def pop_free_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks from the head of the free queue (the caller checked there
        are enough): blocks without a hash first, then hashed ones, evicted in freeing order."""
        plain = self._free_plain
        take = min(num_blocks, len(plain))
        blocks = plain[:-take - 1:-1] if take else []
        del plain[len(plain) - take:]
        if num_blocks > take:
            blocks += self._evict(num_blocks - take)
        return blocks

    def _evict(self, num_evict: int) -> list[int]:
        """Take `num_evict` blocks from the head of the LRU queue: moving the head past them takes
        them out of the shared index (module docstring); duplicates and own keys are seen to here."""
        self._num_lru -= num_evict
        lru, start = self._lru, self._lru_head
        head = start + num_evict
        evicted = lru[start:head]
        if self._num_stale and any(_gather(self._lru_skip, evicted)):  # a hit took some out of the queue
            evicted, head = self._without_stale(start, num_evict)
        self._lru_head = head
        if self._dup_state:  # a slot has duplicates: when its block goes, the first left takes its place
            self._unindex_duplicated()
        if self.hash_to_block:  # own blocks, indexed on preemptions
            block_hash = self.block_hash
            for block in evicted:
                if block_hash[block] is not None:
                    self._unindex_own(block)
        if head >= 4096 and 2 * head >= len(lru):  # drop the entries taken
            del lru[:head]
            self._lru_offset += head
            self._lru_head = 0
        return evicted

    def _without_stale(self, start: int, num_live: int) -> tuple[list[int], int]:
        """The first `num_live` live entries of the LRU queue from position `start` (its stale
        entries, left by hits, are passed over and forgotten), and the position after the last."""
        skip, lru = self._lru_skip, self._lru
        live: list[int] = []
        i = start
        while len(live) < num_live:
            block = lru[i]
            if skip[block]:  # a stale entry: the block left the queue on a hit
                skip[block] -= 1
                self._num_stale -= 1
            else:
                live.append(block)
            i += 1
        return live, i

    # The index.

    def _runs(self, request: Request, start: int) -> tuple[list[tuple[int, int, int]], int]:
        """The request's runs (Request.block_runs: chain hash, first, end for each trace block its
        shared blocks end in, `first` being the block in the chunk's first slot) and the number of
        the run that block `start` is in."""
        block_size, h_tokens = self.block_size, request.hash_block_tokens
        if not self._width:
            self._width = -(-h_tokens // block_size)  # at most this many blocks end in one trace block
            self._slots = [None] * self._width  # chunk 0: the slot of blocks not in the shared index
            self._state = [EMPTY] * self._width
            self._helds = [HELD] * self._width
        elif self._width != -(-h_tokens // block_size):
            raise ValueError("requests with different hash_block_tokens share one block manager")
        # Blocks no longer than trace blocks: a block ends in every trace block, so run j is trace
        # block j's. Longer: each block ends in a trace block of its own, so run i is block i's.
        i = start if block_size > h_tokens else ((start + 1) * block_size - 1) // h_tokens
        return request.block_runs(block_size), i

    def _register(self, request: Request, num_full: int) -> None:
        """Index the request's blocks [num_hashed_blocks, num_full) (full blocks of known tokens,
        held by it alone)."""
        start = request.num_hashed_blocks
        if num_full <= start:
            return
        table = request.block_table
        num_shared = min(num_full, request.num_shared_blocks(self.block_size))
        if start < num_shared:
            runs, k = self._runs(request, start)
            slots, state, width, chunk_of, helds = self._slots, self._state, self._width, self._chunk_of, self._helds
            live = self._head_abs
            num_runs = len(runs)
            # Where every trace block holds `width` blocks, trace blocks new to the index that get
            # chunks numbered one after another have their slots one after another too: a stretch
            # of them is indexed with one slice store (`_new_chunks`).
            whole = request.hash_block_tokens == width * self.block_size
            while k < num_runs:
                chain_hash, first, end = runs[k]
                if first >= num_shared:
                    break
                k += 1
                chunk = chunk_of.get(chain_hash)
                fresh = chunk is None
                if fresh:
                    if whole and k < num_runs and runs[k][1] < num_shared and runs[k][0] not in chunk_of:
                        m = k + 1  # runs[k - 1:m] are new to the index
                        while m < num_runs and runs[m][1] < num_shared and runs[m][0] not in chunk_of:
                            m += 1
                        j = k - 1
                        while j < m:  # a stretch of them at a time, numbered in a row
                            chunk, count = self._new_chunks(runs, j, m)
                            first = runs[j][1]
                            a = start if start > first else first
                            b = runs[j + count - 1][2]
                            if b > num_shared:
                                b = num_shared
                            lo = chunk * width - first + a
                            slots[lo:lo + b - a] = table[a:b]
                            state[lo:lo + b - a] = [HELD] * (b - a)
                            j += count
                        k = m
                        continue
                    chunk = self._new_chunk(chain_hash)
                base = chunk * width - first  # type: ignore[operator]  # block i's slot: base + i
                a = start if start > first else first
                b = num_shared if num_shared < end else end
                if fresh or max(state[base + a:base + b]) - (base + a) < live:  # the usual case: nothing indexed here
                    slots[base + a:base + b] = table[a:b]
                    state[base + a:base + b] = helds if b - a == width else helds[:b - a]
                else:
                    blocks = table[a:b]
                    for slot, block in enumerate(blocks, base + a):
                        if state[slot] - slot < live:
                            slots[slot] = block
                            state[slot] = HELD
                        else:  # an identical block is indexed already: this one after it
                            self._duplicates.setdefault(slot, []).append(block)
                            self._dup_state[block] = HELD
        start = max(start, num_shared)
        if start < num_full:  # the request's own blocks
            keys = request.block_hashes(self.block_size, num_full)
            block_hash, index = self.block_hash, self.hash_to_block.setdefault
            for key, block in zip(keys[start:num_full], table[start:num_full]):
                block_hash[block] = key
                if index(key, block) != block:
                    self._duplicates.setdefault(key, []).append(block)
        request.num_hashed_blocks = num_full

    def _new_chunks(self, runs: list[tuple], j: int, m: int) -> tuple[int, int]:
        """Chunks for the chain hashes of runs[j:m] (none in the index), as many of the first ones
        as get numbers in a row, put in the index: (the first one's number, how many). They are
        the chunks that taking them one by one would give, sweeps included: emptied chunks
        first (the sweep leaves them sorted, so the next ones are often in a row), then new ones
        up to a sweep. The caller fills their slots before it asks for more (a sweep would take
        back a chunk whose slots are all empty)."""
        unused = self._unused_chunks
        if not unused and len(self._chunk_hash) >= self._sweep_at:
            self._sweep()
        most = m - j
        if unused:  # sorted from largest to smallest: the last ones are taken first
            first = unused[-1]
            count = 1
            if most > 1:
                most = min(most, len(unused))
                while count < most and unused[-count - 1] == first + count:
                    count += 1
            del unused[len(unused) - count:]
            hashes = [run[0] for run in runs[j:j + count]]
            self._chunk_hash[first:first + count] = hashes
        else:
            first = len(self._chunk_hash)
            count = min(most, self._sweep_at - first)
            hashes = [run[0] for run in runs[j:j + count]]
            self._chunk_hash.extend(hashes)
            missing = (first + count) * self._width - len(self._slots)
            if missing > 0:  # room for more chunks, made many at a time
                num_new = max(missing, max(64, first // 4) * self._width)
                self._slots.extend([None] * num_new)
                self._state.extend([EMPTY] * num_new)
        self._chunk_of.update(zip(hashes, range(first, first + count)))
        return first, count

    def _new_chunk(self, chain_hash: int) -> int:
        """A chunk for this chain hash (not in the index), put in the index: `_new_chunks` for one."""
        return self._new_chunks([(chain_hash,)], 0, 1)[0]

    def _sweep(self) -> None:
        """Take the chunks none of whose slots holds a block any more out of the index, for reuse
        (evictions leave them in: module docstring)."""
        width, state, chunk_of = self._width, self._state, self._chunk_of
        live = self._head_abs
        for chain_hash, chunk in list(chunk_of.items()):
            first = chunk * width
            if state[first] - first >= live:  # (most chunks holding blocks hold their first slot)
                continue
            states = state[first:first + width]
            largest = max(states)
            if largest >= HELD or largest - first >= live and max(map(sub, states, range(first, first + width))) >= live:
                continue
            del chunk_of[chain_hash]
            self._unused_chunks.append(chunk)
        self._unused_chunks.sort(reverse=True)  # taken smallest first: stretches in a row (`_new_chunks`)
        # The next sweep: once the chunks freed now are used up and the index has at least four
        # times the chunks left in it now. Between two sweeps, the second looking at N chunks, at
        # least 3N/4 chunks were made, so sweeps look at 4/3 chunks per chunk made at most.
        if 4 * len(self._unused_chunks) < len(self._chunk_hash):
            self._sweep_at = 2 * len(self._chunk_hash)

    def _slot_runs(self, request: Request, stop: int) -> list[tuple[int, int, int]]:
        """(slot of block a, a, b) for each stretch [a, b) of the request's shared blocks below
        `stop` whose slots follow one another (one chunk's, or those of chunks numbered in a row
        that the blocks fill from their first slot), in order."""
        num_shared = min(stop, request.num_shared_blocks(self.block_size))
        out = []
        if num_shared:
            runs, _ = self._runs(request, 0)
            width, chunk_of = self._width, self._chunk_of
            slot = a = b = 0
            for chain_hash, first, end in runs:
                if first >= num_shared:
                    break
                at = chunk_of[chain_hash] * width  # block first's slot
                if at == slot + b - a and first == b and b:  # right after the stretch so far
                    b = num_shared if num_shared < end else end
                    continue
                if b:
                    out.append((slot, a, b))
                slot, a, b = at, first, num_shared if num_shared < end else end
            if b:
                out.append((slot, a, b))
        return out

    def _slots_of(self, request: Request, stop: int) -> list[int]:
        """The slots in the shared index of the request's indexed blocks [0, stop) (0: an own block);
        for check_invariants."""
        slots: list[int] = []
        for slot, a, b in self._slot_runs(request, stop):
            slots += range(slot, slot + b - a)
        if stop > len(slots):
            slots += [0] * (stop - len(slots))
        return slots

    def _unindex_duplicated(self) -> None:
        """After an eviction, at each slot with duplicates: while the block in the slot was evicted
        (its state passed by the head), the first duplicate takes its place; duplicates evicted
        behind it leave. The same as seeing to the evicted entries one by one, in order: the
        blocks left keep their order, the first of them in the slot."""
        live = self._head_abs
        slots, state, dup_state = self._slots, self._state, self._dup_state
        for slot in [key for key in self._duplicates if key > 0]:
            duplicates = self._duplicates[slot]
            while duplicates and state[slot] - slot < live:
                successor = duplicates.pop(0)
                slots[slot] = successor
                s = dup_state.pop(successor)
                state[slot] = s if s >= HELD else s + slot
            for block in [b for b in duplicates if dup_state[b] < live]:  # free, and passed by the head
                duplicates.remove(block)
                del dup_state[block]
            if not duplicates:
                del self._duplicates[slot]

    def _unindex_own(self, block: int) -> None:
        """An evicted own block (indexed by its key) leaves the index."""
        key: int = self.block_hash[block]  # type: ignore[assignment]  # an indexed own block has its key
        self.block_hash[block] = None
        duplicates = self._duplicates.get(key)
        if self.hash_to_block[key] == block:
            if duplicates:
                self.hash_to_block[key] = duplicates.pop(0)
            else:
                del self.hash_to_block[key]
        else:
            duplicates.remove(block)  # type: ignore[union-attr]  # it is among the duplicates
        if duplicates is not None and not duplicates:
            del self._duplicates[key]

    def _shared_hits(self, request: Request, stop: int) -> tuple[list[int], int]:
        """Blocks holding the longest indexed run of the request's shared blocks [0, stop), and how
        many of them are free."""
        blocks: list[int] = []
        num_free = 0
        if not stop or not self._chunk_of:
            return blocks, num_free
        runs, _ = self._runs(request, 0)
        slots, state, width, chunk_of = self._slots, self._state, self._width, self._chunk_of
        live = self._head_abs
        held = HELD.__le__
        for chain_hash, first, end in runs:
            if first >= stop:
                break
            chunk = chunk_of.get(chain_hash)
            if chunk is None:
                break
            lo = chunk * width
            hi = lo + (stop if stop < end else end) - first
            states = state[lo:hi]
            if min(states) - (hi - 1) < live:  # maybe an empty slot: the hit ends before it
                n = 0
                while n < hi - lo and states[n] - (lo + n) >= live:
                    n += 1
                if n < hi - lo:
                    blocks += slots[lo:lo + n]  # type: ignore[arg-type]  # the slots of a hit hold blocks
                    num_free += n - sum(map(held, states[:n]))
                    break
            blocks += slots[lo:hi]  # type: ignore[arg-type]
            num_free += hi - lo if max(states) < HELD else hi - lo - sum(map(held, states))
        return blocks, num_free

    def indexed_blocks(self, request: Request, i: int) -> list[int]:
        """The blocks indexed with the key of the request's block i, in indexing order (a lookup
        returns the first); for tests."""
        if i < request.num_shared_blocks(self.block_size):
            runs, k = self._runs(request, i)
            chain_hash, first, _ = runs[k]
            chunk = self._chunk_of.get(chain_hash)
            if chunk is None:
                return []
            slot = chunk * self._width - first + i
            if self._state[slot] - slot < self._head_abs:
                return []
            return [self._slots[slot]] + self._duplicates.get(slot, [])  # type: ignore[return-value]
        key = request.block_hashes(self.block_size, i + 1)[i]
        first_block = self.hash_to_block.get(key)
        return [] if first_block is None else [first_block] + self._duplicates.get(key, [])

    # Admission of a waiting request.

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """Blocks holding the longest cached run of the request's full blocks from its start, at
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

    def can_allocate(self, cached: CachedPrefix, num_new_tokens: int) -> bool:
        """Whether a request with this cached prefix (`cached_prefix`'s answer) can get blocks for
        `num_new_tokens` more (SingleTypeKVCacheManager.get_num_blocks_to_allocate: a hit on a
        free block takes it out of the free queue too)."""
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
            # request), a run of slots at a time while all of its blocks are free.
            helds = self._helds
            for slot, a, b in self._slot_runs(request, num_shared):
                n = b - a
                if max(state[slot:slot + n]) < HELD:
                    state[slot:slot + n] = helds if n == len(helds) else [HELD] * n  # (a stretch may pass a chunk)
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

    def grow_tables(self, owners: list[Request]) -> None:
        """Give each of `owners` one new block, taken from the free queue in that order (a request
        named more than once gets one each time): the blocks that a step's or a run's tokens open,
        in the order step-by-step scheduling takes them (the caller checked there are enough). The
        one way, with `allocate`, `append` and `take_over`, that a block table grows."""
        for request, block in zip(owners, self.pop_free_blocks(len(owners))):
            request.block_table.append(block)

    def take_over(self, request: Request, num_tokens: int) -> None:
        """A fresh table for a request whose first `num_tokens` tokens' KV arrive from elsewhere (a
        decode replica receiving a prefilled request, sim/disagg.py): nothing indexed."""
        request.block_table = self.pop_free_blocks(self.blocks_for(num_tokens))
        request.num_hashed_blocks = 0

    def index_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the shared blocks that the request's first `num_tokens` tokens fill: `append`'s
        indexing, also for blocks given to the request by hand (a chunk run's, sim/fast_forward.py).
        Shared blocks now; the request's own blocks when it frees them (module docstring)."""
        if self.enable_prefix_caching:
            num_full = min(num_tokens // self.block_size, request.num_shared_blocks(self.block_size))
            if num_full > request.num_hashed_blocks:
                self._register(request, num_full)

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
            runs = self._slot_runs(request, num_hashed)
            state = self._state
            if self._num_shared and any(max(state[slot:slot + b - a]) > HELD for slot, a, b in runs) or (
                    self._dup_state and not self._dup_state.keys().isdisjoint(table[:num_hashed])):
                self._free_some(table, num_full, runs)
            else:  # each of its blocks is its own: all of them become free, its full ones to the queue's tail
                hashed = table[:num_full]  # its own full blocks (not indexed) after the indexed ones
                hashed.reverse()
                # Its block k is the queue's entry `top - k`, at slot `slot + k - a` of its run: every
                # slot of the run gets the state top - a + slot.
                top = self._lru_offset + len(self._lru) + num_full - 1
                for slot, a, b in runs:
                    state[slot:slot + b - a] = [top - a + slot] * (b - a)
                self._lru.extend(hashed)
                self._num_lru += num_full
        request.block_table = []
        request.num_hashed_blocks = 0

    def _free_some(self, table: list[int], num_full: int, runs: list[tuple[int, int, int]]) -> None:
        """free() of full blocks when some of the request's are shared or duplicates: each loses
        its reference, and only those left with none become free, to the queue's tail in order
        (tail first). A run of slots whose blocks are all the request's alone is freed with slice
        stores, as free() frees them; the others block by block."""
        slots, state, dup_state = self._slots, self._state, self._dup_state
        position = self._lru_offset + len(self._lru)
        num_shared = runs[-1][2] if runs else 0
        freed = table[num_shared:num_full]  # its own full blocks: nobody else holds them
        freed.reverse()
        position += len(freed)
        for slot, a, b in reversed(runs):
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
        """Blocks add up: free + used = total, the users that the states and the free queues give
        each block match the block tables, the index's parts agree, and each free indexed block's
        state is its entry's place in the LRU queue."""
        counts = [0] * self.num_blocks
        for r in running:
            for b in r.block_table:
                counts[b] += 1
        assert counts == self.ref_counts, "reference counts differ from the running block tables"
        num_used = sum(1 for c in counts if c > 0)
        assert num_used + self.num_free_blocks == self.num_blocks, "free + used != total"
        slot_of = self._check_index()
        indexed = set(slot_of) | {b for b, h in enumerate(self.block_hash) if h is not None}
        lru = self.cached_free_blocks()
        assert len(lru) == self._num_lru and sum(self._lru_skip) == self._num_stale == len(self._lru) - self._lru_head - len(lru)
        assert self._num_shared == sum(c - 1 for c in counts if c > 1), "the count of shared references is off"
        skip = list(self._lru_skip)
        for i in range(self._lru_head, len(self._lru)):
            block = self._lru[i]
            if skip[block]:
                skip[block] -= 1
                continue
            slot = slot_of.get(block, 0)
            if slot:  # its state is this entry's position
                state = self._state[slot] - slot if self._slots[slot] == block else self._dup_state[block]
                assert state == self._lru_offset + i, "a free block's state is not its place in the queue"
        free = set(self._free_plain) | set(lru)
        assert len(free) == self.num_free_blocks, "a block is free twice"
        assert all(counts[b] == 0 for b in free), "a used block is also free"
        assert not indexed & set(self._free_plain), "a hashed block in the plain pool"
        for block, state in self._dup_state.items():
            assert (state == HELD) == (counts[block] == 1), "a duplicate's state is off"
        # (The LRU queue may hold blocks without a hash: finished requests' own, never indexed.)
        for r in running:
            n = r.num_hashed_blocks
            assert all(b in indexed for b in r.block_table[:n])
            assert [slot_of.get(b, 0) for b in r.block_table[:n]] == self._slots_of(r, n), "a block is not at its key's slot"

    def _check_index(self) -> dict[int, int]:
        """The index's parts agree: chunks and their chain hashes, own keys and their blocks' keys,
        duplicates; a chunk that holds a block is in the index (an empty one may be too, until a
        sweep). Returns each shared block's slot."""
        width, slots, live = self._width, self._slots, self._head_abs
        chunks = set(self._chunk_of.values())
        assert all(self._chunk_hash[c] == h for h, c in self._chunk_of.items()) and len(chunks) == len(self._chunk_of)
        assert 0 not in chunks and not chunks & set(self._unused_chunks)
        assert chunks | set(self._unused_chunks) == set(range(1, len(self._chunk_hash))), "a chunk is lost"
        assert len(slots) == len(self._state) >= width * len(self._chunk_hash) if width else not slots
        live_slots = [slot for slot, s in enumerate(self._state) if s - slot >= live]
        assert all(width <= slot < width * len(self._chunk_hash) for slot in live_slots), "a slot out of the chunks holds a block"
        for slot in live_slots:
            assert slot // width in chunks, "a chunk out of the index holds blocks"
        shared = [(slot, slots[slot]) for slot in live_slots]
        own = list(self.hash_to_block.items())
        for key, blocks in self._duplicates.items():
            assert blocks and (self._state[key] - key >= live if key > 0 else key in self.hash_to_block)
            (shared if key > 0 else own).extend((key, b) for b in blocks)
        assert sorted(self._dup_state) == sorted(b for key, bs in self._duplicates.items() if key > 0 for b in bs)
        slot_of = {b: slot for slot, b in shared}
        assert len(slot_of) == len(shared), "a block is at two slots"
        assert all(self.block_hash[b] == key for key, b in own), "the own index and the blocks' keys disagree"
        assert sum(h is not None for h in self.block_hash) == len(own), "an own block with a key is not indexed"
        assert not set(slot_of) & {b for _, b in own}, "a block in both indexes"
        return slot_of  # type: ignore[return-value]
