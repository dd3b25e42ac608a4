"""Checks of the block manager's state, for tests: the users of each block as vLLM counts them,
what the index holds for a key, and the invariants that tie the free queue (sim/block_pool.py),
the prefix index (sim/prefix_index.py) and the running requests' block tables together."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.prefix_index import HELD
from sim.request import Request

if TYPE_CHECKING:
    from sim.block_manager import BlockManager


def ref_counts(bm: "BlockManager") -> list[int]:
    """Users of each block (0: free), as vLLM counts them; made from the state, for tests."""
    counts = [1] * bm.num_blocks
    for block in bm._free_plain + bm.cached_free_blocks():
        counts[block] = 0
    for indexed, state in zip(bm._slots, bm._state):  # an empty slot holds None
        if state >= HELD:
            assert indexed is not None, "a held slot holds no block"
            counts[indexed] = state - HELD + 1
    return counts


def indexed_blocks(bm: "BlockManager", request: Request, i: int) -> list[int]:
    """The blocks indexed with the key of the request's block i, in indexing order (a lookup
    returns the first); for tests."""
    if i < request.num_shared_blocks(bm.block_size):
        spans, k = bm._spans(request, i)
        chain_hash, first, _ = spans[k]
        row = bm._row_of.get(chain_hash)
        if row is None:
            return []
        slot = row * bm._width - first + i
        if bm._state[slot] - slot < bm._head_abs:
            return []
        return [bm._slots[slot]] + bm._duplicates.get(slot, [])  # type: ignore[return-value]
    key = request.block_hashes(bm.block_size, i + 1)[i]
    first_block = bm.hash_to_block.get(key)
    return [] if first_block is None else [first_block] + bm._duplicates.get(key, [])


def check_invariants(bm: "BlockManager", running: list[Request]) -> None:
    """Blocks add up: free + used = total, the users that the states and the free queues give
    each block match the block tables, the index's parts agree, and each free indexed block's
    state is its entry's place in the LRU queue."""
    counts = [0] * bm.num_blocks
    extra = [0] * bm.num_blocks  # a cache's other groups' blocks (`extra_blocks`): plain, each held by one request
    for r in running:
        for b in r.block_table:
            counts[b] += 1
        for b in bm.extra_blocks(r):
            extra[b] += 1
    assert max(extra, default=0) <= 1 and not any(c and e for c, e in zip(counts, extra)), "a block in two tables"
    refs = ref_counts(bm)
    assert [c + e for c, e in zip(counts, extra)] == refs, "reference counts differ from the running block tables"
    counts = [c + e for c, e in zip(counts, extra)]
    num_used = sum(1 for c in counts if c > 0)
    assert num_used + bm.num_free_blocks == bm.num_blocks, "free + used != total"
    slot_of = _check_index(bm)
    indexed = set(slot_of) | {b for b, h in enumerate(bm.block_hash) if h is not None}
    lru = bm.cached_free_blocks()
    assert len(lru) == bm._num_lru and sum(bm._lru_skip) == bm._num_stale == len(bm._lru) - bm._lru_head - len(lru)
    assert bm._num_shared == sum(c - 1 for c in counts if c > 1), "the count of shared references is off"
    skip = list(bm._lru_skip)
    for i in range(bm._lru_head, len(bm._lru)):
        block = bm._lru[i]
        if skip[block]:
            skip[block] -= 1
            continue
        slot = slot_of.get(block, 0)
        if slot:  # its state is this entry's position
            state = bm._state[slot] - slot if bm._slots[slot] == block else bm._dup_state[block]
            assert state == bm._lru_offset + i, "a free block's state is not its place in the queue"
    free = set(bm._free_plain) | set(lru)
    assert len(free) == bm.num_free_blocks, "a block is free twice"
    assert all(counts[b] == 0 for b in free), "a used block is also free"
    assert not indexed & set(bm._free_plain), "a hashed block in the plain pool"
    for block, state in bm._dup_state.items():
        assert (state == HELD) == (counts[block] == 1), "a duplicate's state is off"
    # (The LRU queue may hold blocks without a hash: finished requests' own, never indexed.)
    for r in running:
        n = r.num_hashed_blocks
        assert all(b in indexed for b in r.block_table[:n])
        assert [slot_of.get(b, 0) for b in r.block_table[:n]] == _slots_of(bm, r, n), "a block is not at its key's slot"


def _slots_of(bm: "BlockManager", request: Request, stop: int) -> list[int]:
    """The slots in the shared index of the request's indexed blocks [0, stop) (0: an own block);
    for check_invariants."""
    slots: list[int] = []
    for slot, a, b in bm._slot_spans(request, stop):
        slots += range(slot, slot + b - a)
    if stop > len(slots):
        slots += [0] * (stop - len(slots))
    return slots


def _check_index(bm: "BlockManager") -> dict[int, int]:
    """The index's parts agree: rows and their chain hashes, own keys and their blocks' keys,
    duplicates; a row that holds a block is in the index (an empty one may be too, until a
    sweep). Returns each shared block's slot."""
    width, slots, live = bm._width, bm._slots, bm._head_abs
    rows = set(bm._row_of.values())
    assert all(bm._row_hash[c] == h for h, c in bm._row_of.items()) and len(rows) == len(bm._row_of)
    assert 0 not in rows and not rows & set(bm._unused_rows)
    assert rows | set(bm._unused_rows) == set(range(1, len(bm._row_hash))), "a row is lost"
    assert len(slots) == len(bm._state) >= width * len(bm._row_hash) if width else not slots
    live_slots = [slot for slot, s in enumerate(bm._state) if s - slot >= live]
    assert all(width <= slot < width * len(bm._row_hash) for slot in live_slots), "a slot out of the rows holds a block"
    for slot in live_slots:
        assert slot // width in rows, "a row out of the index holds blocks"
    shared = [(slot, slots[slot]) for slot in live_slots]
    own = list(bm.hash_to_block.items())
    for key, blocks in bm._duplicates.items():
        assert blocks and (bm._state[key] - key >= live if key > 0 else key in bm.hash_to_block)
        (shared if key > 0 else own).extend((key, b) for b in blocks)
    assert sorted(bm._dup_state) == sorted(b for key, bs in bm._duplicates.items() if key > 0 for b in bs)
    slot_of = {b: slot for slot, b in shared}
    assert len(slot_of) == len(shared), "a block is at two slots"
    assert all(bm.block_hash[b] == key for key, b in own), "the own index and the blocks' keys disagree"
    assert sum(h is not None for h in bm.block_hash) == len(own), "an own block with a key is not indexed"
    assert not set(slot_of) & {b for _, b in own}, "a block in both indexes"
    return slot_of  # type: ignore[return-value]
