"""The prefix index of the paged KV cache: which block holds the KV of which token prefix, and
how many running requests hold each indexed block (vLLM 0.33: BlockHashToBlockMap, BlockPool.touch
and cache_full_blocks in vllm/v1/core/block_pool.py, find_longest_cache_hit in
vllm/v1/core/single_type_kv_cache_manager.py). The rules it follows are listed in
sim/block_manager.py; this is how it keeps them fast.

The index. vLLM keeps one dict entry per block hash (BlockHashToBlockMap). Here the same lookups
are kept coarser, because a shared block's key is fixed by the trace block it ends in and its
place there (Request.block_hashes): the chained hash of the trace's hash ids up to that trace
block (Request.prefix_chain) names a row of slots, one dict entry (`_row_of`), whose slots, one for
each block that can end in that trace block, hold the block indexed first with that key (a
stretch of the flat list `_slots`). Beside each slot a state (`_state`) says what its block is:

- held by running requests: HELD + (users - 1), so a hit on a held block adds one;
- free: the absolute position of its entry in the LRU queue plus the slot's number. The block is
  still indexed while that entry is at or past the queue's head (`_head_abs`); once the head has
  passed it, the block was evicted and the slot is empty. So an eviction only moves the head: no
  slot is touched, no block's count either (a block nobody indexes needs none: it has one user
  while held). Adding the slot's number makes a span of slots freed together share one state (a
  request frees its blocks tail first: its block k, at slot s0 + k, is the queue's entry top - k),
  so freeing them is a slice store of one repeated value.

A request's blocks occupy consecutive slots within each row, so indexing them, freeing them
(their slots get their entries' positions, consecutive too) and looking them up are slice
operations on `_slots` and `_state`: no loop over blocks. Trace blocks new to the index take
rows numbered consecutively where they can (`_new_rows`: emptied rows are kept sorted for that),
so a request's slots mostly run on from one row into the next, and a stretch of them over
several rows (`_slot_spans`) is still one slice store. A row whose slots are all empty stays
in the dict until a sweep (`_sweep`, when rows run out) takes it out for reuse: a lookup finds
nothing in an empty row, as in none, and indexing into it is indexing into a fresh one, so when
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

from operator import sub

from sim.block_pool import BlockPool
from sim.request import Request

HELD = 1 << 62  # a slot's state while its block is held: HELD + (users - 1); below it, a free block's LRU position + slot
EMPTY = -1  # a new slot's state: before every position


class PrefixIndex(BlockPool):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        # The index of shared blocks, by trace block (module docstring, "The index").
        self._row_of: dict[int, int] = {}  # chain hash -> its row's number (1, 2, ...)
        self._row_hash: list[int] = [0]  # row number -> its chain hash (row 0 is nobody's)
        self._unused_rows: list[int] = []  # numbers of rows that left the index, for reuse
        self._width = 0  # slots per row, set by the first request with trace hashes
        self._slots: list[int | None] = []  # row c's slots are [c * width, (c + 1) * width): the block indexed there
        self._state: list[int] = []  # each slot's state: HELD + users - 1, or its free block's LRU position
        self._helds: list[int] = []  # [HELD] * width, a slice of it marks a span of slots held
        self._sweep_at = 16  # rows made before empty ones are looked for (_sweep)
        # Blocks waiting behind the one in their slot (> 0), or own key (< 0), in indexing order.
        self._duplicates: dict[int, list[int]] = {}
        self._dup_state: dict[int, int] = {}  # a duplicate in a slot -> HELD, or its LRU position while free
        # The index of the requests' own blocks, by block key (negative).
        self.hash_to_block: dict[int, int] = {}  # the block a lookup of a key returns: the first indexed
        self.block_hash: list[int | None] = [None] * num_blocks  # an own block's key, if indexed
        # References beyond a block's first, over all blocks (the sum of max(users - 1, 0)): while
        # none is shared, a request's blocks are all its own and free() needs no counts.
        self._num_shared = 0

    def _forget_evicted(self, evicted: list[int]) -> None:
        """Evicted blocks leave the index: a shared one by the head passing its slot's state (no work
        here), but a slot with duplicates passes to the first left, and an own block leaves by key."""
        if self._dup_state:  # a slot has duplicates: when its block goes, the first left takes its place
            self._unindex_duplicated()
        if self.hash_to_block:  # own blocks, indexed on preemptions
            block_hash = self.block_hash
            for block in evicted:
                if block_hash[block] is not None:
                    self._unindex_own(block)

    def _spans(self, request: Request, start: int) -> tuple[list[tuple[int, int, int]], int]:
        """The request's spans (Request.block_spans: chain hash, first, end for each trace block its
        shared blocks end in, `first` being the block in the row's first slot) and the number of
        the span that block `start` is in."""
        block_size, h_tokens = self.block_size, request.hash_block_tokens
        if not self._width:
            self._width = -(-h_tokens // block_size)  # at most this many blocks end in one trace block
            self._slots = [None] * self._width  # row 0: the slot of blocks not in the shared index
            self._state = [EMPTY] * self._width
            self._helds = [HELD] * self._width
        elif self._width != -(-h_tokens // block_size):
            raise ValueError("requests with different hash_block_tokens share one block manager")
        # Blocks no longer than trace blocks: a block ends in every trace block, so span j is trace
        # block j's. Longer: each block ends in a trace block of its own, so span i is block i's.
        i = start if block_size > h_tokens else ((start + 1) * block_size - 1) // h_tokens
        return request.block_spans(block_size), i

    def _register(self, request: Request, num_full: int) -> None:
        """Index the request's blocks [num_hashed_blocks, num_full) (full blocks of known tokens,
        held by it alone)."""
        start = request.num_hashed_blocks
        if num_full <= start:
            return
        table = request.block_table
        num_shared = min(num_full, request.num_shared_blocks(self.block_size))
        if start < num_shared:
            spans, k = self._spans(request, start)
            slots, state, width, row_of, helds = self._slots, self._state, self._width, self._row_of, self._helds
            live = self._head_abs
            num_spans = len(spans)
            # Where every trace block holds `width` blocks, trace blocks new to the index that get
            # rows numbered one after another have their slots one after another too: a stretch
            # of them is indexed with one slice store (`_new_rows`).
            whole = request.hash_block_tokens == width * self.block_size
            while k < num_spans:
                chain_hash, first, end = spans[k]
                if first >= num_shared:
                    break
                k += 1
                row = row_of.get(chain_hash)
                fresh = row is None
                if fresh:
                    if whole and k < num_spans and spans[k][1] < num_shared and spans[k][0] not in row_of:
                        m = k + 1  # spans[k - 1:m] are new to the index
                        while m < num_spans and spans[m][1] < num_shared and spans[m][0] not in row_of:
                            m += 1
                        j = k - 1
                        while j < m:  # a stretch of them at a time, numbered consecutively
                            row, count = self._new_rows(spans, j, m)
                            first = spans[j][1]
                            a = start if start > first else first
                            b = spans[j + count - 1][2]
                            if b > num_shared:
                                b = num_shared
                            lo = row * width - first + a
                            slots[lo:lo + b - a] = table[a:b]
                            state[lo:lo + b - a] = [HELD] * (b - a)
                            j += count
                        k = m
                        continue
                    row = self._new_row(chain_hash)
                base = row * width - first  # type: ignore[operator]  # block i's slot: base + i
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
                            self._index_may_hold_evicted = True
        start = max(start, num_shared)
        if start < num_full:  # the request's own blocks
            keys = request.block_hashes(self.block_size, num_full)
            block_hash, index = self.block_hash, self.hash_to_block.setdefault
            self._index_may_hold_evicted = True
            for key, block in zip(keys[start:num_full], table[start:num_full]):
                block_hash[block] = key
                if index(key, block) != block:
                    self._duplicates.setdefault(key, []).append(block)
        request.num_hashed_blocks = num_full

    def _new_rows(self, spans: list[tuple], j: int, m: int) -> tuple[int, int]:
        """Rows for the chain hashes of spans[j:m] (none in the index), as many of the first ones
        as get consecutive numbers, put in the index: (the first one's number, how many). They are
        the rows that taking them one by one would give, sweeps included: emptied rows
        first (the sweep leaves them sorted, so the next ones are often consecutive), then new ones
        up to a sweep. The caller fills their slots before it asks for more (a sweep would take
        back a row whose slots are all empty)."""
        unused = self._unused_rows
        if not unused and len(self._row_hash) >= self._sweep_at:
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
            hashes = [span[0] for span in spans[j:j + count]]
            self._row_hash[first:first + count] = hashes
        else:
            first = len(self._row_hash)
            count = min(most, self._sweep_at - first)
            hashes = [span[0] for span in spans[j:j + count]]
            self._row_hash.extend(hashes)
            missing = (first + count) * self._width - len(self._slots)
            if missing > 0:  # room for more rows, made many at a time
                num_new = max(missing, max(64, first // 4) * self._width)
                self._slots.extend([None] * num_new)
                self._state.extend([EMPTY] * num_new)
        self._row_of.update(zip(hashes, range(first, first + count)))
        return first, count

    def _new_row(self, chain_hash: int) -> int:
        """A row for this chain hash (not in the index), put in the index: `_new_rows` for one."""
        return self._new_rows([(chain_hash,)], 0, 1)[0]

    def _sweep(self) -> None:
        """Take the rows none of whose slots holds a block any more out of the index, for reuse
        (evictions leave them in: module docstring)."""
        width, state, row_of = self._width, self._state, self._row_of
        live = self._head_abs
        for chain_hash, row in list(row_of.items()):
            first = row * width
            if state[first] - first >= live:  # (most rows holding blocks hold their first slot)
                continue
            states = state[first:first + width]
            largest = max(states)
            if largest >= HELD or largest - first >= live and max(map(sub, states, range(first, first + width))) >= live:
                continue
            del row_of[chain_hash]
            self._unused_rows.append(row)
        self._unused_rows.sort(reverse=True)  # taken smallest first: consecutive stretches (`_new_rows`)
        # The next sweep: once the rows freed now are used up and the index has at least four
        # times the rows left in it now. Between two sweeps, the second looking at N rows, at
        # least 3N/4 rows were made, so sweeps look at 4/3 rows per row made at most.
        if 4 * len(self._unused_rows) < len(self._row_hash):
            self._sweep_at = 2 * len(self._row_hash)

    def _slot_spans(self, request: Request, stop: int) -> list[tuple[int, int, int]]:
        """(slot of block a, a, b) for each stretch [a, b) of the request's shared blocks below
        `stop` whose slots follow one another (one row's, or those of rows numbered consecutively
        that the blocks fill from their first slot), in order."""
        num_shared = min(stop, request.num_shared_blocks(self.block_size))
        out = []
        if num_shared:
            spans, _ = self._spans(request, 0)
            width, row_of = self._width, self._row_of
            slot = a = b = 0
            for chain_hash, first, end in spans:
                if first >= num_shared:
                    break
                at = row_of[chain_hash] * width  # block first's slot
                if at == slot + b - a and first == b and b:  # right after the stretch so far
                    b = num_shared if num_shared < end else end
                    continue
                if b:
                    out.append((slot, a, b))
                slot, a, b = at, first, num_shared if num_shared < end else end
            if b:
                out.append((slot, a, b))
        return out

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
        """Blocks holding the longest indexed stretch of the request's shared blocks [0, stop), and how
        many of them are free."""
        blocks: list[int] = []
        num_free = 0
        if not stop or not self._row_of:
            return blocks, num_free
        spans, _ = self._spans(request, 0)
        slots, state, width, row_of = self._slots, self._state, self._width, self._row_of
        live = self._head_abs
        held = HELD.__le__
        for chain_hash, first, end in spans:
            if first >= stop:
                break
            row = row_of.get(chain_hash)
            if row is None:
                break
            lo = row * width
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
