"""The free queue of the paged KV cache's blocks, by vLLM V1's rules (version 0.33): vLLM's
BlockPool.get_new_blocks and free_blocks (vllm/v1/core/block_pool.py) over FreeKVCacheBlockQueue
(vllm/v1/core/kv_cache_utils.py, popleft_n, prepend_n, append_n).

Free blocks form one queue, taken from the head. A freed block without a hash goes to the head
(reused first), a freed block with a hash to the tail. Blocks without a hash hold nothing anyone
can reuse, so which of them is taken makes no difference: here they are a stack (`_free_plain`)
taken before the hashed ones, which are an LRU queue in freeing order (`_lru`). A prefix hit
takes a hashed block out of the middle of the queue: it counts one more stale entry of that
block (`_lru_skip`), and its entries ahead of its live one are passed over when they reach the
head. An entry's absolute position (`_lru_offset` + its index in `_lru`) never changes, so the
prefix index (sim/prefix_index.py) names a free block's place by it, and a block is evicted when
the head passes its entry (`_head_abs`). Taking a hashed block evicts it (`_evict`).

Block tables grow only here and in sim/block_manager.py (`grow_tables`, `grow_tables_at`, `take_over`,
`allocate`, `append`): policies and fast-forward name the requests, the pool hands out the blocks.
"""

from __future__ import annotations

from operator import itemgetter

from sim.request import Request


def _gather(values: list, indices: list[int]) -> tuple | list:
    """values[i] for each i in indices, in order (itemgetter takes them in one call)."""
    return itemgetter(*indices)(values) if len(indices) > 1 else [values[i] for i in indices]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        # Hashed free blocks, evicted first to last. A hit takes a block out of the middle by counting
        # one more stale entry of it (`_lru_skip`): its entries ahead of its live one are skipped.
        self._lru: list[int] = []  # a queue: its head is at _lru_head (taken entries are dropped now and then)
        self._lru_head = 0
        self._lru_offset = 0  # entries dropped from the front: _lru[i] is at absolute position _lru_offset + i
        self._lru_skip = [0] * num_blocks
        self._num_stale = 0  # sum of _lru_skip
        self._num_lru = 0
        # Whether an evicted block may need more than the queue's head moving past it (set by the
        # prefix index while it holds duplicates or own keys: `_forget_evicted`); most evictions don't.
        self._index_may_hold_evicted = False

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + self._num_lru

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_plain) - self._num_lru  # num_free_blocks, written out (hot)

    @property
    def _head_abs(self) -> int:
        """The LRU queue head's absolute position: slot s is live while its state - s is at or past it."""
        return self._lru_offset + self._lru_head

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
            blocks += self._evict(num_blocks - take)
        return blocks

    def _evict(self, num_evict: int) -> list[int]:
        """Take `num_evict` blocks from the head of the LRU queue: moving the head past them takes
        them out of the prefix index (sim/prefix_index.py); what else it indexes forgets them
        (`_forget_evicted`). BlockPool.get_new_blocks and _maybe_evict_cached_block."""
        self._num_lru -= num_evict
        lru, start = self._lru, self._lru_head
        head = start + num_evict
        evicted = lru[start:head]
        if self._num_stale and any(_gather(self._lru_skip, evicted)):  # a hit took some out of the queue
            evicted, head = self._without_stale(start, num_evict)
        self._lru_head = head
        if self._index_may_hold_evicted:
            self._forget_evicted(evicted)
        if head >= 4096 and 2 * head >= len(lru):  # drop the entries taken
            del lru[:head]
            self._lru_offset += head
            self._lru_head = 0
        return evicted

    def _forget_evicted(self, evicted: list[int]) -> None:
        """Evicted blocks leave whatever indexes them besides the queue (the prefix index's hook)."""

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

    # Growing block tables.

    def grow_tables(self, owners: list[Request], counts: list[int] | None = None) -> None:
        """Give each of `owners` one new block (or `counts[i]` blocks), taken from the free queue in
        that order (a request named more than once gets its blocks each time): the blocks that a
        step's or a run's tokens open, in the order step-by-step scheduling takes them (the caller
        checked there are enough). The one way, with `allocate`, `append` and `take_over`, that a
        block table grows."""
        if counts is None:
            for request, block in zip(owners, self.pop_free_blocks(len(owners))):
                request.block_table.append(block)
            return
        blocks = self.pop_free_blocks(sum(counts))
        at = 0
        for request, count in zip(owners, counts):
            request.block_table += blocks[at:at + count]
            at += count

    def grow_tables_at(self, requests: list[Request], opens: list[int], n: int) -> None:
        """A decode run's opening blocks: `requests[o % n]` takes one new block for each `o` of
        `opens` (step * n + batch index, sorted: the order step-by-step scheduling takes them),
        from the free queue in that order (the caller checked there are enough). `grow_tables`
        with the owners named by their place in the run, without listing them first."""
        for o, block in zip(opens, self.pop_free_blocks(len(opens))):
            requests[o % n].block_table.append(block)

    def take_over(self, request: Request, num_tokens: int) -> None:
        """A fresh table for a request whose first `num_tokens` tokens' KV arrive from elsewhere (a
        decode replica receiving a prefilled request, sim/disagg.py): nothing indexed."""
        request.block_table = self.pop_free_blocks(self.blocks_for(num_tokens))
        request.num_hashed_blocks = 0
