"""The block manager of a model with sliding-window layers, as vLLM 0.33 runs it (vllm/v1/core/):
one pool of blocks shared by the model's KV cache groups (each a block table per request), the
groups' managers (single_type_kv_cache_manager.py: FullAttentionManager, SlidingWindowManager)
under one coordinator (kv_cache_coordinator.py: UnitaryKVCacheCoordinator for a model whose every
layer slides, Mistral-7B-v0.1; HybridKVCacheCoordinator for sliding and full-attention layers,
gpt-oss, Gemma 2 and 3), KVCacheManager.get_computed_blocks and allocate_slots
(kv_cache_manager.py) and the BlockPool (block_pool.py). tests/parity/ checks it step by step
against vLLM's own scheduler.

Each rule, and where vLLM implements it (W is the window, B the block size). The groups' tables
have one entry per block of the request's tokens; a sliding group's entries wholly before its
window hold nothing (vLLM's null block; None here):

- **Skipped blocks.** Once C of a request's tokens are computed, a sliding group skips
  max(0, C - W + 1) // B leading blocks (SlidingWindowManager.get_num_skipped_tokens). They are
  freed when the request is next scheduled, in every group before any counting
  (KVCacheManager.allocate_slots calls remove_skipped_blocks first; _remove_blocks_in_range frees
  them last first and stops at an entry already freed). So a step's decodes grow one request at a
  time (`frees_when_scheduled`, `grow_decodes`): each frees, then takes, in the running order.
  Under asynchronous scheduling the tokens of the step in flight do not count as computed
  (allocate_slots: num_computed_tokens - num_in_flight_tokens): the engine says when it schedules
  beside a step in flight (`pipelined`).
- **Caching.** In every group, every full block is cached when the step that fills it is scheduled
  (BlockPool.cache_full_blocks, with the group in the key; how, below), and keeps its hash until it is evicted:
  held, or freed to the free queue's tail (free_blocks). A freed block without a hash goes to the
  head. Taking a hashed free block evicts it (get_new_blocks, _maybe_evict_cached_block). Equal keys
  may index several blocks; a lookup gets the first indexed that is left (get_one_block).
- **A waiting request's prefix hit**, at most (num_tokens - 1) // B blocks
  (HybridKVCacheCoordinator.find_longest_cache_hit: full attention first, then the sliding groups
  within its hit, one round for one window): the full-attention groups hit the blocks cached in every
  one of them from the start (FullAttentionManager.find_longest_cache_hit); the sliding groups, from
  the right, the first stretch of cdiv(W - 1, B) blocks cached in each of them, the hit ending with
  it and null before it, or without one the cached blocks from the start
  (SlidingWindowManager.find_longest_cache_hit); the full groups' hit is cut to the sliding one's.
  A hit block wholly before the window of the hit's end is not taken; the others are
  (BlockPool.touch: a free one leaves the free queue) (add_local_computed_blocks).
- **Admission** (allocate_slots, get_num_blocks_to_allocate summed over the groups): with the whole
  sequence reserved (`--reserve-full-isl`, the default), each group's cdiv(tokens, B) blocks (a
  sliding group's at most max_admission_blocks) less the hit's, plus the hit's free blocks, must
  fit first; then the first chunk's, uncapped. max_admission_blocks is
  SlidingWindowSpec.max_admission_blocks_per_request, cdiv(min(W - 1 + the tokens in flight,
  max_model_len), B) + 1. A running request needs cdiv(C + new tokens, B) entries in each group.
- **Order.** Hits are taken, then new blocks, then blocks cached, group after group in vLLM's
  group order (the coordinator's loops); a request leaving frees each group's held blocks, last
  first, group after group (SingleTypeKVCacheManager.free).

The index is one dict entry per group and key, vLLM's own rendering. As in BlockManager (a model
without sliding windows), a request's own blocks (its tokens alone: generated ones, a prompt
without trace hashes) are indexed only when it is preempted, since only it can ever find them: the
blocks a window skipped too, while their key is still theirs (not evicted). They are counted cached
(`num_hashed_blocks`) and freed to the free queue's tail as vLLM's hashed blocks are, so the queue
and every lookup are the same. Under asynchronous scheduling a block filled by a token vLLM does
not know yet (sampled in the step in flight) is not cached when its request leaves beside that step:
`free` counts one token less (BlockManager.num_cached_tokens).
"""

from __future__ import annotations

from sim.block_manager import BlockManager, CachedPrefix
from sim.request import Request

FULL, SLIDING = "full_attention", "sliding_attention"


class GroupHit(CachedPrefix):
    """`cached_prefix`'s answer: the hit's entries in the first group (its length is the hit in
    blocks), each group's (`per_group`), and how many of the blocks it takes are free."""

    __slots__ = ("per_group",)

    def __init__(self, per_group: list[list], num_free: int):
        super().__init__(per_group[0] if per_group else [], num_free)
        self.per_group = per_group


class SlidingWindowBlockManager(BlockManager):
    """vLLM's KV cache of a model with sliding-window layers (module docstring). Its free queue is
    BlockPool's (sim/block_pool.py); its index and reference counts are its own.

    `groups`: the layout as plain data, one (kind, sliding_window) per group in vLLM's order
    (backends/kv_capacity.py kv_cache_groups; sim/app/plan.py passes it): "full_attention" (window
    None) or "sliding_attention", at least one sliding. `max_admission_tokens`: W - 1 + the tokens in
    flight, at most max_model_len (SlidingWindowSpec.max_admission_blocks_per_request's)."""

    slides_windows = True  # no fast-forward: a run hands out blocks in one go
    frees_when_scheduled = True  # a request frees its skipped blocks when it is scheduled

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 groups: tuple[tuple[str, int | None], ...], max_admission_tokens: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        kinds = [kind for kind, _ in groups]
        windows = {w for kind, w in groups if kind == SLIDING}
        if SLIDING not in kinds or any(k not in (FULL, SLIDING) for k in kinds) or len(windows) != 1:
            raise ValueError(f"a sliding-window KV cache needs sliding groups of one window, and full ones, got {groups}")
        self.window: int = windows.pop()  # type: ignore[assignment]  # a sliding group's is a whole number
        if self.window < 1:
            raise ValueError(f"a sliding window of {self.window} tokens")
        self.groups = tuple(groups)
        self.sliding = [kind == SLIDING for kind in kinds]  # per group
        self.full_groups = [g for g, s in enumerate(self.sliding) if not s]
        self.sliding_groups = [g for g, s in enumerate(self.sliding) if s]
        self.blocks_per_opening = len(groups)
        self.max_admission_blocks = -(-max_admission_tokens // block_size) + 1
        # A sliding hit's stretch: cdiv(W - 1, B) blocks (_contiguous_blocks_for_hit, no EAGLE).
        self.hit_blocks = -(-(self.window - 1) // block_size)
        # Asynchronous scheduling: the tokens each request was given in the step being scheduled, and
        # in the step before it (in flight while the engine sets `pipelined`); they move at each
        # step's end (`slide`).
        self._scheduled: dict[int, int] = {}
        self._in_flight: dict[int, int] = {}
        self.refs = [0] * num_blocks  # users of each block (BlockPool's ref_cnt)
        self.key_of: list[int | None] = [None] * num_blocks  # each indexed (or own, skipped) block's key ...
        self.group_of = [0] * num_blocks  # ... and group
        # A request's own blocks (its tokens alone: generated ones, a prompt without trace hashes) are
        # indexed only when it is preempted: nobody else can look them up (module docstring). Those a
        # window skipped before: (group, position, block), indexed then if still cached.
        self._skipped_own: dict[int, list[tuple[int, int, int]]] = {}
        self.blocks_of: list[dict[int, list[int]]] = [{} for _ in groups]  # per group: key -> blocks, first indexed first
        self._tables: dict[int, list[list]] = {}  # request index -> its table in each group (the first: block_table)
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
        key_of, group_of, blocks_of = self.key_of, self.group_of, self.blocks_of
        for block in evicted:
            key = key_of[block]
            if key is not None:
                key_of[block] = None
                index = blocks_of[group_of[block]]
                same = index.get(key)
                if same is None or block not in same:  # an own block skipped by its window, not indexed
                    continue
                if len(same) == 1:  # (no duplicate: the usual case)
                    del index[key]
                else:
                    same.remove(block)

    def _free_blocks(self, blocks: list[int], hashed: bool) -> None:
        """BlockPool.free_blocks, `blocks` in eviction order, all full (`hashed`: vLLM cached them)
        or none: each loses a user; one left with none goes to the queue's tail with a hash, to its
        head without."""
        refs = self.refs
        free = self._lru if hashed else self._free_plain
        n = len(free)
        for block in blocks:
            refs[block] -= 1
            if not refs[block]:
                free.append(block)
        if hashed:
            self._num_lru += len(free) - n

    def _touch(self, blocks: list[int]) -> None:
        """A hit's blocks gain a user; a free one leaves the free queue (BlockPool.touch)."""
        refs, skip = self.refs, self._lru_skip
        for block in blocks:
            if not refs[block]:
                skip[block] += 1  # its queue entry goes stale (sim/block_pool.py)
                self._num_stale += 1
                self._num_lru -= 1
            refs[block] += 1

    def tables(self, request: Request) -> list[list]:
        """The request's table in each group (entries None where a sliding group freed the block)."""
        return self._tables.get(request.index) or [request.block_table]

    def _cache(self, request: Request, num_tokens: int) -> None:
        """Cache, in every group, the full blocks the first `num_tokens` tokens fill, past those
        cached already (KVCacheManager.cache_blocks): `num_hashed_blocks` counts them; those shared
        with other requests' prompts are indexed now, the request's own when it is preempted."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        start = request.num_hashed_blocks
        if num_full <= start:
            return
        request.num_hashed_blocks = num_full
        num_full = min(num_full, request.num_shared_blocks(self.block_size))
        if num_full <= start:
            return
        keys = request.block_hashes(self.block_size, num_full)
        for g, table in enumerate(self.tables(request)):
            for i in range(start, num_full):
                if table[i] is not None:
                    self._index(g, keys[i], table[i])

    def _index(self, g: int, key: int, block: int) -> None:
        """Put a cached block in group g's index under `key`, after any indexed before with it
        (BlockHashToBlockMap.insert)."""
        self.key_of[block] = key
        self.group_of[block] = g
        same = self.blocks_of[g].get(key)
        if same is None:
            self.blocks_of[g][key] = [block]
        elif block not in same:
            same.append(block)

    def _num_skipped(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1) // self.block_size

    def _skip(self, request: Request, num_computed: int) -> None:
        """Free each sliding group's blocks wholly before the window of `num_computed` tokens
        (remove_skipped_blocks), last first, down to an entry already freed; less the tokens in
        flight when `pipelined`."""
        if self.pipelined:
            num_computed = max(0, num_computed - self._in_flight.get(request.index, 0))
        num_skipped = self._num_skipped(num_computed)
        if num_skipped <= 0:
            return
        tables = self._tables.get(request.index) or (request.block_table,)
        caching = self.enable_prefix_caching
        for g in self.sliding_groups:
            table = tables[g]
            end = min(num_skipped, len(table))
            start = end
            while start > 0 and table[start - 1] is not None:
                start -= 1
            if start == end:
                continue
            freed = table[start:end]
            table[start:end] = [None] * (end - start)  # type: ignore[list-item]  # vLLM's null block
            freed.reverse()  # last first
            if caching:
                own = max(start, request.num_shared_blocks(self.block_size))
                if own < end:  # its own blocks: findable by their keys if it is preempted
                    keys = request.block_hashes(self.block_size, end)
                    key_of, group_of = self.key_of, self.group_of
                    record = self._skipped_own.setdefault(request.index, [])
                    for i in range(end - 1, own - 1, -1):
                        block = freed[end - 1 - i]
                        key_of[block] = keys[i]
                        group_of[block] = g
                        record.append((g, i, block))
            self._free_blocks(freed, caching)  # (full blocks: cached when their tokens were scheduled)

    # Admission of a waiting request.

    def _cached(self, keys: list[int], i: int, groups: list[int]) -> list[int] | None:
        """The block cached with keys[i] in each of `groups` (the first indexed), or None if one
        misses (BlockPool.get_cached_block)."""
        out = []
        for g in groups:
            same = self.blocks_of[g].get(keys[i])
            if same is None:
                return None
            out.append(same[0])
        return out

    def _hit(self, request: Request, num_blocks: int) -> list[list]:
        """Each group's entries of the longest cache hit within the request's first `num_blocks`
        blocks (HybridKVCacheCoordinator.find_longest_cache_hit; module docstring); [] per group
        without a hit."""
        per_group: list[list] = [[] for _ in self.groups]
        if not num_blocks or not any(self.blocks_of):
            return per_group
        keys = request.block_hashes(self.block_size, num_blocks)
        limit = num_blocks
        if self.full_groups:  # FullAttentionManager.find_longest_cache_hit: from the start
            full = self.full_groups
            limit = 0
            while limit < num_blocks:
                blocks = self._cached(keys, limit, full)
                if blocks is None:
                    break
                for g, block in zip(full, blocks):
                    per_group[g].append(block)
                limit += 1
        sliding, need = self.sliding_groups, self.hit_blocks
        run, start, found = 0, 0, False
        for i in range(limit - 1, -1, -1):  # SlidingWindowManager.find_longest_cache_hit: from the right
            if self._cached(keys, i, sliding) is not None:
                run += 1
                if run >= need:
                    start, found = i, True
                    break
            else:
                run = 0
        length = start + run if found else run  # without a window's stretch: the cached blocks from the start
        for g in sliding:
            per_group[g] = [None] * start + [self.blocks_of[g][k][0] for k in keys[start:start + run]]
        for g in self.full_groups:
            del per_group[g][length:]
        return per_group

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """The request's prefix hit (`_hit`) within num_tokens - 1 tokens, and how many of the
        blocks it takes are free."""
        if not self.enable_prefix_caching:
            return GroupHit([[] for _ in self.groups], 0)
        num_blocks = (request.num_tokens - 1) // self.block_size
        if not request.num_preemptions:  # only its shared prompt blocks can be cached before it ran
            num_blocks = min(num_blocks, request.num_shared_blocks(self.block_size))
        per_group = self._hit(request, num_blocks)
        skipped = self._num_skipped(len(per_group[0]) * self.block_size)
        refs = self.refs
        num_free = sum(1 for g, hit in enumerate(per_group) for b in (hit[skipped:] if self.sliding[g] else hit)
                       if not refs[b])
        return GroupHit(per_group, num_free)

    def num_cached_blocks(self, request: Request) -> int:
        """The hit a router would find for the request's shared prompt blocks (the whole prompt's)."""
        if not self.enable_prefix_caching or request.hash_ids is None:
            return 0
        return len(self._hit(request, request.num_shared_blocks(self.block_size))[0])

    def can_allocate(self, cached: CachedPrefix, num_new_tokens: int, num_first_tokens: int = 0, reserve: int = 0) -> bool:
        """allocate_slots' checks for a waiting request with this hit: each group's blocks for
        `num_new_tokens` more (a sliding group's capped at max_admission_blocks) when
        `num_first_tokens` (the first chunk's tokens) is given; then blocks for the first chunk,
        uncapped. Each less the hit's blocks, plus its free blocks taken."""
        num_hit = len(cached)
        hit_tokens = num_hit * self.block_size
        num_groups = len(self.groups)
        if num_first_tokens:
            blocks = self.blocks_for(hit_tokens + num_new_tokens)
            capped = min(blocks, self.max_admission_blocks)
            needed = (len(self.full_groups) * max(blocks - num_hit, 0)
                      + len(self.sliding_groups) * max(capped - num_hit, 0))
            if needed + cached.num_free + reserve > self.num_free_blocks:
                return False
            num_new_tokens = num_first_tokens
        needed = num_groups * max(self.blocks_for(hit_tokens + num_new_tokens) - num_hit, 0)
        return needed + cached.num_free + reserve <= self.num_free_blocks

    def allocate(self, request: Request, cached_blocks: list[int], num_new_tokens: int) -> int:
        """Give an admitted request its hit (`cached_prefix`'s, looked up just before): in each
        group, null entries for the blocks before the hit's window, the others taken; then blocks
        for `num_new_tokens` more in each group, caching those they fill. Returns the hit in tokens."""
        per_group = cached_blocks.per_group if isinstance(cached_blocks, GroupHit) else [[] for _ in self.groups]
        num_hit = len(per_group[0]) * self.block_size
        skipped = self._num_skipped(num_hit)
        tables = []
        for g, hit in enumerate(per_group):  # add_local_computed_blocks, group after group
            if self.sliding[g]:
                kept = hit[skipped:]
                table: list = [None] * min(skipped, len(hit))
                table += kept
            else:
                kept, table = hit, list(hit)
            self._touch(kept)
            tables.append(table)
        self._count_hit(request, num_hit)
        request.block_table = tables[0]
        if len(tables) > 1:
            self._tables[request.index] = tables
        request.num_hashed_blocks = len(tables[0])
        num_after = num_hit + num_new_tokens
        for table in tables:  # allocate_new_blocks, group after group
            table += self._take(self.blocks_for(num_after) - len(table))
        self._cache(request, min(num_after, request.num_tokens))
        self._scheduled[request.index] = num_new_tokens
        return num_hit

    # Growth of a running request.

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        """allocate_slots for a running request: its skipped blocks are freed first (whether or not
        the rest fits), then its new entries in every group must fit."""
        self._skip(request, request.num_computed_tokens)
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        return len(self.groups) * max(needed, 0) <= self.num_free_blocks

    def append(self, request: Request, num_new_tokens: int) -> None:
        self._skip(request, request.num_computed_tokens)
        num_after = request.num_computed_tokens + num_new_tokens
        for table in self.tables(request):
            table += self._take(self.blocks_for(num_after) - len(table))
        self._cache(request, min(num_after, request.num_tokens))
        self._scheduled[request.index] = num_new_tokens

    def index_full_blocks(self, request: Request, num_tokens: int) -> None:
        self._cache(request, num_tokens)

    def grow_decodes(self, decoders: list[Request]) -> None:
        """A step's decodes, one token each, in order: each frees its skipped blocks, takes a block
        in every group if its token opens one (group after group), and caches the blocks its token
        fills (`append`'s work, written out: this runs for every decode of every step; the caller
        checked the free blocks cover the openings)."""
        bs, window, caching = self.block_size, self.window, self.enable_prefix_caching
        scheduled, tables_of, first = self._scheduled, self._tables, self.sliding_groups[0]
        num_groups = len(self.groups)
        refs = self.refs
        in_flight = self._in_flight if self.pipelined else None
        for r in decoders:
            computed = r.num_computed_tokens
            scheduled[r.index] = 1
            tables = tables_of[r.index] if num_groups > 1 else None
            # (`_skip` frees what the tokens done pass: here only whether it has anything to free.)
            n = ((computed if in_flight is None else computed - in_flight.get(r.index, 0)) - window + 1) // bs
            if n > 0:
                table = tables[first] if tables is not None else r.block_table
                if table[n - 1 if n <= len(table) else -1] is not None:
                    self._skip(r, computed)
            if len(r.block_table) * bs <= computed:
                blocks = self.pop_free_blocks(num_groups)  # one per group, in group order (`_take`)
                for block in blocks:
                    refs[block] = 1
                if tables is None:
                    r.block_table.append(blocks[0])
                else:
                    for table, block in zip(tables, blocks):
                        table.append(block)
            if caching and (computed + 1) // bs > r.num_hashed_blocks:
                self._cache(r, computed + 1)  # (its own block: only counted, indexed if it is preempted)

    def grow_tables(self, owners: list[Request], counts: list[int] | None = None) -> None:
        raise AssertionError("a sliding-window cache grows a step's decodes with grow_decodes")

    def grow_tables_at(self, requests: list[Request], opens: list[int], n: int) -> None:
        raise AssertionError("a sliding-window cache takes no fast-forward runs")

    def take_over(self, request: Request, num_tokens: int) -> None:
        """Fresh tables for a request whose first `num_tokens` tokens' KV arrive from elsewhere (a
        disaggregated decode replica): in a sliding group null entries before the window, blocks for
        the rest (allocate_external_computed_blocks); cached once the KV is in."""
        skipped = self._num_skipped(num_tokens)
        tables = []
        for sliding in self.sliding:
            table: list = [None] * skipped if sliding else []
            table += self._take(self.blocks_for(num_tokens) - len(table))
            tables.append(table)
        request.block_table = tables[0]
        if len(tables) > 1:
            self._tables[request.index] = tables
        request.num_hashed_blocks = 0
        self._cache(request, num_tokens)

    # A request leaves.

    def free(self, request: Request, preempted: bool = False, num_scheduled: int = 0) -> None:
        """Its held blocks, group after group, each last first: its full blocks (cached when
        scheduled) to the free queue's tail, its last one to the head. A preempted request's own
        blocks are indexed first, those a window skipped too while still cached: only it can find
        them, once it is admitted again."""
        tables = self.tables(request)
        skipped_own = self._skipped_own.pop(request.index, None)
        if self.pipelined:  # the block of a token vLLM does not know yet is not cached (`num_cached_tokens`):
            # its own blocks only; the prompt's shared blocks were indexed when scheduled (their tokens known)
            bs = self.block_size
            known = max(self.num_cached_tokens(request, num_scheduled) // bs, request.num_shared_blocks(bs))
            request.num_hashed_blocks = min(request.num_hashed_blocks, known)
        if preempted and self.enable_prefix_caching:
            self._index_own(request, tables, skipped_own)
        num_hashed = request.num_hashed_blocks if self.enable_prefix_caching else 0
        for table in tables:
            self._free_blocks([b for b in reversed(table[num_hashed:]) if b is not None], False)
            self._free_blocks([b for b in reversed(table[:num_hashed]) if b is not None], bool(num_hashed))
        self._tables.pop(request.index, None)
        request.block_table = []
        request.num_hashed_blocks = 0
        self._scheduled.pop(request.index, None)
        self._in_flight.pop(request.index, None)

    def _index_own(self, request: Request, tables: list[list], skipped_own: list | None) -> None:
        """Index the request's own full blocks, held or skipped by its window and still cached
        (their key still theirs), in the order vLLM cached them: by position, group after group."""
        bs = self.block_size
        num_shared, num_full = request.num_shared_blocks(bs), request.num_hashed_blocks
        keys = request.block_hashes(bs, num_full)
        found = [(i, g, block) for g, i, block in skipped_own or () if self.key_of[block] == keys[i]]
        found += [(i, g, table[i]) for g, table in enumerate(tables)
                  for i in range(num_shared, num_full) if table[i] is not None]
        for i, g, block in sorted(found):
            self._index(g, keys[i], block)

    def slide(self, running: list[Request]) -> None:
        """At a step's end nothing is freed (a request frees its skipped blocks when it is next
        scheduled); the step's tokens become the ones in flight while the next is scheduled."""
        self._in_flight, self._scheduled = self._scheduled, {}

    def extra_blocks(self, request: Request) -> list[int]:
        return [b for table in self.tables(request)[1:] for b in table if b is not None]

    # Limits.

    def max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks one request of `num_tokens` tokens may hold at once, every group together: all of
        them in a full-attention group, a window's and the tokens in flight's (max_admission_blocks)
        in a sliding one."""
        blocks = self.blocks_for(num_tokens)
        return len(self.full_groups) * blocks + len(self.sliding_groups) * min(blocks, self.max_admission_blocks)

    def max_request_tokens(self) -> int:
        """Any length runs when every group slides and their windows' blocks fit the cache (the
        engine's --max-model-len bounds it)."""
        if not self.full_groups and len(self.sliding_groups) * self.max_admission_blocks <= self.num_blocks:
            return 1 << 62
        return super().max_request_tokens()

    # For tests.

    def held_by_group(self, request: Request) -> list[int]:
        """Blocks the request holds in each group, vLLM's group order."""
        return [sum(b is not None for b in table) for table in self.tables(request)]

    @property
    def ref_counts(self) -> list[int]:
        return list(self.refs)

    def indexed_blocks(self, request: Request, i: int) -> list[int]:
        """The blocks cached with the key of the request's block i in its first group."""
        key = request.block_hashes(self.block_size, i + 1)[i]
        return list(self.blocks_of[0].get(key, []))

    def check_invariants(self, running: list[Request]) -> None:
        """Blocks add up: the running tables' users are the reference counts, free + used = total,
        the free queue holds exactly the unused blocks, the index and the blocks' keys agree."""
        counts = [0] * self.num_blocks
        for r in running:
            tables = self.tables(r)
            assert tables[0] is r.block_table and len({len(t) for t in tables}) == 1, "the groups' tables differ"
            for table in tables:
                for block in table:
                    if block is not None:
                        counts[block] += 1
            assert r.num_hashed_blocks <= len(r.block_table)
        assert counts == self.refs, "reference counts differ from the running block tables"
        free = self._free_plain + self.cached_free_blocks()
        assert len(free) == len(set(free)) == self.num_free_blocks, "a block is free twice"
        assert sorted(free) == [b for b in range(self.num_blocks) if not counts[b]], "free blocks differ from unused ones"
        assert all(self.key_of[b] is None for b in self._free_plain), "a cached block at the head of the queue"
        indexed = [(g, k, b) for g, index in enumerate(self.blocks_of) for k, bs in index.items() for b in bs]
        assert len(indexed) == len({b for _, _, b in indexed}), "a block indexed twice"
        assert all(self.key_of[b] == k and self.group_of[b] == g for g, k, b in indexed), "the index is off"
        in_index = {b for _, _, b in indexed}
        assert all(k < 0 for b, k in enumerate(self.key_of) if k is not None and b not in in_index), \
            "a shared block with a key outside the index"  # (an own block a window skipped: indexed if preempted)
        assert all(all(index.values()) for index in self.blocks_of), "an empty key in the index"
