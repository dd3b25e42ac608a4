"""The paged KV cache's block manager, vLLM-style, with prefix caching.

Blocks are handed out as a request's context grows. A full prompt block is keyed by a chained
hash (parent hash + its tokens); when its last user frees it, it stays in the cache until it is
evicted, least recently used first, so a later request with the same prefix reuses it.

Free blocks live in two pools: blocks holding nothing reusable (taken first) and freed blocks
that still hold a cached prefix (an LRU queue). Every block is in exactly one place: referenced
by at least one running request, or in one of the free pools.
"""

from __future__ import annotations

from collections import OrderedDict

from sim.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.num_queried_tokens = 0  # tokens looked up in the prefix cache at admissions
        self.num_hit_tokens = 0  # of which found cached

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pop_free_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks for growing requests (the caller checked there are enough):
        the plain pool's first, then evictions of cached blocks, least recently used first."""
        plain = self._free_plain
        take = min(num_blocks, len(plain))
        blocks = plain[:-take - 1:-1] if take else []
        del plain[len(plain) - take:]
        if num_blocks > take:
            evict = self._free_cached.popitem
            block_hash, hash_to_block = self.block_hash, self.hash_to_block
            for _ in range(num_blocks - take):
                block, _ = evict(last=False)
                del hash_to_block[block_hash[block]]  # a cached free block is its hash's block
                block_hash[block] = None
                blocks.append(block)
        ref_counts = self.ref_counts
        for block in blocks:
            ref_counts[block] = 1
        return blocks

    # Admission of a waiting request.

    def cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's prompt.

        At least one token is always left to compute, so a fully cached prompt gives back its
        last block (vLLM does the same)."""
        if not self.enable_prefix_caching or request.hash_ids is None:
            return []
        blocks = []
        for h in request.prompt_block_hashes(self.block_size):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        while blocks and len(blocks) * self.block_size >= request.num_tokens:
            blocks.pop()
        return blocks

    def num_cached_blocks(self, request: Request) -> int:
        """Leading full blocks of the request's prompt that the cache holds now (what a router
        may ask of a replica; unlike `cached_prefix`, a fully cached prompt counts whole)."""
        if not self.enable_prefix_caching or request.hash_ids is None:
            return 0
        num = 0
        hash_to_block = self.hash_to_block
        for h in request.prompt_block_hashes(self.block_size):
            if h not in hash_to_block:
                break
            num += 1
        return num

    def can_allocate(self, cached_blocks: list[int], num_new_tokens: int) -> bool:
        num_new = self.blocks_for(len(cached_blocks) * self.block_size + num_new_tokens) - len(cached_blocks)
        num_taken_from_free = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        return num_new + num_taken_from_free <= self.num_free_blocks

    def allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> None:
        """Give an admitted request its cached prefix and blocks for `num_new_tokens` more tokens."""
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self._free_cached[block]
            self.ref_counts[block] += 1
        num_hit = len(cached_blocks) * self.block_size
        if self.enable_prefix_caching:
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
        """Make room for `num_new_tokens` more tokens of the request (the caller checked can_append)."""
        table = request.block_table
        num_new = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        if num_new > 0:
            table.extend(self.pop_free_blocks(num_new))
        if self.enable_prefix_caching and request.hash_ids is not None:
            self._register_full_prompt_blocks(request, request.num_computed_tokens + num_new_tokens)

    def _register_full_prompt_blocks(self, request: Request, num_tokens_after: int) -> None:
        hashes = request.prompt_block_hashes(self.block_size)
        num_full = min(num_tokens_after // self.block_size, len(hashes))
        table = request.block_table
        hash_to_block, block_hash = self.hash_to_block, self.block_hash
        for i in range(request.num_hashed_blocks, num_full):
            h = hashes[i]
            if h not in hash_to_block:  # a duplicate computed alongside stays uncached
                hash_to_block[h] = table[i]
                block_hash[table[i]] = h
        request.num_hashed_blocks = max(request.num_hashed_blocks, num_full)

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks. The tail is freed first, so it is
        evicted before the prefix, which is the part other requests are likelier to share."""
        ref_counts = self.ref_counts
        if request.hash_ids is None or not self.enable_prefix_caching:
            # Nothing of it was cached or shared: every block goes back to the plain pool.
            for block in request.block_table:
                ref_counts[block] = 0
            self._free_plain.extend(reversed(request.block_table))
        else:
            block_hash, cached, plain = self.block_hash, self._free_cached, self._free_plain
            for block in reversed(request.block_table):
                count = ref_counts[block] - 1
                ref_counts[block] = count
                if not count:
                    if block_hash[block] is not None:
                        cached[block] = None
                    else:
                        plain.append(block)
        request.block_table = []
        request.num_hashed_blocks = 0

    def check_invariants(self, running: list[Request]) -> None:
        """Blocks add up: free + used = total, and reference counts match the block tables."""
        counts = [0] * self.num_blocks
        for r in running:
            for b in r.block_table:
                counts[b] += 1
        assert counts == self.ref_counts, "reference counts differ from the running block tables"
        num_used = sum(1 for c in counts if c > 0)
        assert num_used + self.num_free_blocks == self.num_blocks, "free + used != total"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, "the hash index and the blocks' hashes disagree"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
        free = set(self._free_plain) | set(self._free_cached)
        assert len(free) == self.num_free_blocks, "a block is free twice"
        assert all(counts[b] == 0 for b in free), "a used block is also free"
