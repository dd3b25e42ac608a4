"""The block manager: allocation as context grows, prefix caching and LRU reuse."""

import numpy as np

from sim.block_manager import BlockManager
from sim.request import Request


def req(index, prompt, output=4, hash_ids=None):
    return Request(index, str(index), 0.0, prompt, output,
                   hash_ids=None if hash_ids is None else np.asarray(hash_ids), hash_block_tokens=8)


def test_blocks_grow_with_context():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = req(0, 10)
    bm.allocate(r, [], 10)
    assert r.block_table == [0, 1, 2] and bm.num_free_blocks == 5
    r.num_computed_tokens = 10
    assert bm.can_append(r, 2)
    bm.append(r, 2)  # positions 10, 11 fit in block 2
    assert r.block_table == [0, 1, 2]
    r.num_computed_tokens = 12
    bm.append(r, 1)  # position 12 needs a fourth block
    assert r.block_table == [0, 1, 2, 3] and bm.num_used_blocks == 4
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.block_table == []


def test_can_append_counts_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = req(0, 8)
    bm.allocate(r, [], 8)
    r.num_computed_tokens = 8
    assert not bm.can_append(r, 1)


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req(0, 16, hash_ids=[1, 2])  # 4 full blocks, hashed
    bm.allocate(a, [], 16)
    b = req(1, 12, hash_ids=[1, 2])  # same first 12 tokens (hash block 8 tokens: ids 1, 2)
    cached = bm.cached_prefix(b)
    # All 3 of b's blocks are cached, but one token must be computed: the last block is given back.
    assert cached == a.block_table[:2]
    assert bm.can_allocate(cached, 4)
    assert bm.allocate(b, cached, 4) == 8  # the hit, in tokens: it leaves the request's fields to the policy
    assert b.num_computed_tokens == 0 and b.block_table[:2] == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    assert bm.num_used_blocks == 5
    c = req(2, 16, hash_ids=[1, 3])  # shares only the first hash block (8 tokens = 2 blocks)
    assert bm.cached_prefix(c) == a.block_table[:2]
    bm.check_invariants([a, b])


def test_freed_cached_blocks_are_reused_lru_and_plain_blocks_first():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = req(0, 8, hash_ids=[1])
    bm.allocate(a, [], 8)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6
    # A new unrelated request takes the never-cached blocks before evicting a's prefix.
    x = req(1, 16)
    bm.allocate(x, [], 16)
    assert not set(x.block_table) & set(a_blocks)
    # a's prefix is still there for a request with the same hash.
    again = req(2, 9, hash_ids=[1, 5])
    assert bm.cached_prefix(again) == a_blocks
    # Growing x evicts the least recently used cached block: a's tail was freed first.
    x.num_computed_tokens = 16
    bm.append(x, 1)
    assert x.block_table[-1] == a_blocks[1]
    assert bm.cached_prefix(again) == a_blocks[:1]
    bm.check_invariants([x])


def test_no_caching_when_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = req(0, 8, hash_ids=[1])
    bm.allocate(a, [], 8)
    assert bm.cached_prefix(req(1, 8, hash_ids=[1])) == []
    assert bm.hash_to_block == {}


def test_every_full_block_is_cached_and_a_preempted_request_hits_its_own():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = req(0, 6, output=8)  # no trace hashes: its blocks are its own
    bm.allocate(r, [], 6)
    r.num_computed_tokens, r.num_output_tokens = 6, 1
    for _ in range(4):  # four decodes: positions 6..9
        bm.append(r, 1)
        r.num_computed_tokens += 1
        r.num_output_tokens += 1
    assert r.num_computed_tokens == 10 and r.block_table == [0, 1, 2]
    bm.free(r, preempted=True)  # blocks 0 and 1 are full (8 of 10 computed tokens)
    assert bm.hash_to_block == {r.block_hashes(4, 2)[0]: 0, r.block_hashes(4, 2)[1]: 1}
    assert bm.cached_free_blocks() == [1, 0] and bm._free_plain[-1] == 2  # tail first; block 2 is reused first
    r.num_computed_tokens = 0
    r.num_preemptions = 1
    # 11 tokens known: at most 10 may hit, so both full blocks do.
    assert bm.cached_prefix(r) == [0, 1]
    bm.allocate(r, [0, 1], 3)
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (6, 0)  # the first admission only
    assert (bm.num_preempted_queried_tokens, bm.num_preempted_hit_tokens) == (11, 8)
    bm.check_invariants([r])


def test_duplicate_blocks_stay_indexed_and_the_first_is_found():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req(0, 9, hash_ids=[1, 2])
    b = req(1, 9, hash_ids=[1, 2])  # the same 8-token prefix
    bm.allocate(a, [], 4)  # a's first chunk fills block 0
    bm.allocate(b, bm.cached_prefix(b), 5)  # b hits block 0 and fills block 1 (tokens 4..7) itself
    a.num_computed_tokens = 4
    bm.append(a, 5)  # a fills its own copy of tokens 4..7: block 3, indexed after block 1
    assert b.block_table == [0, 1, 2] and a.block_table == [0, 3, 4]
    assert bm.indexed_blocks(a, 1) == [1, 3]
    bm.free(b)
    bm.free(a)  # hashed blocks to the queue's tail in freeing order: b's 1, a's 3, then the shared 0
    assert bm.cached_free_blocks() == [1, 3, 0]
    x = req(2, 24)
    bm.allocate(x, [], 24)  # 6 blocks: the 5 without a hash, then evicts block 1: block 3 is found now
    assert bm.indexed_blocks(a, 1) == [3] and not bm._duplicates
    assert bm.cached_prefix(req(3, 9, hash_ids=[1, 2])) == [0, 3]
    bm.check_invariants([x])


def test_empty_chunks_stay_until_a_sweep_takes_them_out_for_reuse():
    bm = BlockManager(num_blocks=40, block_size=4)  # trace blocks of 8 tokens: 2 slots a row
    a = req(0, 80, hash_ids=list(range(1, 11)))
    bm.allocate(a, [], 80)  # 20 full blocks indexed in 10 rows
    bm.free(a)
    x = req(1, 160)
    bm.allocate(x, [], 160)  # the 20 plain blocks, then evicts all of a's
    assert len(bm._row_of) == 10 and all(bm.indexed_blocks(a, i) == [] for i in range(20))  # empty, still in
    assert bm.cached_prefix(req(2, 81, hash_ids=list(range(1, 12)))) == []
    bm.free(x)
    b = req(3, 80, hash_ids=list(range(101, 111)))
    bm.allocate(b, [], 80)  # 5 new rows make 16 (row 0 counted), then a sweep frees a's 10 for b's other 5
    assert len(bm._row_hash) == 16 and len(bm._row_of) == 10 and len(bm._unused_rows) == 5
    assert not set(a.prefix_chain(4)) & set(bm._row_of)
    assert bm.cached_prefix(req(4, 81, hash_ids=list(range(101, 112)))) == b.block_table
    bm.check_invariants([b])


def test_trace_blocks_new_to_the_index_take_chunks_in_a_row_and_their_slots_are_one_stretch():
    """A prompt's trace blocks that the index has not seen get rows numbered in a row, new ones
    or (after a sweep) emptied ones, so its blocks' slots follow one another: indexing them, and
    freeing them, is one slice store per stretch (`_slot_spans`), with the lookups of one by one."""
    bm = BlockManager(num_blocks=40, block_size=4)  # trace blocks of 8 tokens: 2 slots a row
    a = req(0, 80, hash_ids=list(range(1, 11)))
    bm.allocate(a, [], 80)  # 20 full blocks in rows 1..10
    assert [bm._row_of[h] for h in a.prefix_chain(4)] == list(range(1, 11))
    assert bm._slot_spans(a, 20) == [(2, 0, 20)]  # row 1's first slot, blocks 0..19
    assert bm._slot_spans(a, 7) == [(2, 0, 7)]
    assert bm.cached_prefix(req(1, 81, hash_ids=list(range(1, 12)))) == a.block_table
    bm.free(a)
    x = req(2, 160)
    bm.allocate(x, [], 160)  # evicts all of a's blocks: its rows are empty
    bm.free(x)
    b = req(3, 80, hash_ids=list(range(101, 111)))
    bm.allocate(b, [], 80)  # 5 new rows (11..15), then a sweep empties a's 10 for b's other 5
    rows = [bm._row_of[h] for h in b.prefix_chain(4)]
    assert rows[:5] == list(range(11, 16)) and rows[5:] == list(range(1, 6))  # the smallest emptied first
    assert bm._slot_spans(b, 20) == [(22, 0, 10), (2, 10, 20)]
    assert bm.cached_prefix(req(4, 81, hash_ids=list(range(101, 112)))) == b.block_table
    c = req(5, 81, hash_ids=list(range(101, 112)))
    bm.allocate(c, bm.cached_prefix(c), 1)  # shares b's 20 blocks
    bm.free(b)  # shared: freed block by block; c still holds them
    assert bm.cached_prefix(req(6, 81, hash_ids=list(range(101, 112)))) == c.block_table[:20]
    bm.check_invariants([c])


def test_grow_tables_at_hands_out_blocks_as_grow_tables_does():
    """A run's opening blocks named by place (step * n + batch index) go to the same requests, in
    the same order, as the owners listed one by one."""
    opens = [1, 3, 4, 7, 9, 10]  # n = 3: steps 0..3
    tables = []
    for by_place in (True, False):
        bm = BlockManager(num_blocks=12, block_size=4)
        reqs = [req(i, 4) for i in range(3)]
        for r in reqs:
            bm.allocate(r, [], 4)
        if by_place:
            bm.grow_tables_at(reqs, opens, 3)
        else:
            bm.grow_tables([reqs[o % 3] for o in opens])
        tables.append([r.block_table for r in reqs])
        assert bm.num_used_blocks == 3 + len(opens)
    assert tables[0] == tables[1] == [[0, 4, 7], [1, 3, 5, 6, 8], [2]]
