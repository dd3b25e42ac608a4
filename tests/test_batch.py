"""The seven arrays against the seeds' worked examples."""

from sim.batch import Batch


def seq(base, n):
    return list(range(base, base + n))


def test_seed000_three_requests_block_size_4():
    # Seed 000: A decodes position 10, B computes prompt positions 4..8, C is new with 3 tokens.
    b = Batch()
    b.add("A", 10, 1, [7, 2, 12], needs_logits=True, is_decode=True, token_source=seq(100, 11))
    # B's prompt is 20 tokens and only 9 are computed after the step: no logits (DESIGN: a
    # partial chunk needs none; seed 000 keeps a discarded row, seed 001 drops it).
    b.add("B", 4, 5, [3, 9, 5], needs_logits=False, token_source=seq(200, 20))
    b.add("C", 0, 3, [6], needs_logits=True, token_source=seq(300, 3))
    f = b.flatten(block_size=4)
    assert f.input_ids.tolist() == [110, 204, 205, 206, 207, 208, 300, 301, 302]
    assert f.positions.tolist() == [10, 4, 5, 6, 7, 8, 0, 1, 2]
    assert f.query_start_loc.tolist() == [0, 1, 6, 9]
    assert f.seq_lens.tolist() == [11, 9, 3]
    # A: block 12 offset 2 -> 50. B: positions 4..7 in block 9 (36..39), position 8 in block 5 (20).
    assert f.slot_mapping.tolist() == [50, 36, 37, 38, 39, 20, 24, 25, 26]
    assert f.block_table.tolist() == [[7, 2, 12], [3, 9, 5], [6, 0, 0]]
    assert f.logits_indices.tolist() == [0, 8]
    assert b.num_tokens == 9 and b.num_decode_tokens == 1 and b.num_prefill_tokens == 8


def test_seed000_check_yourself_slot():
    # Position 37 with block table [12, 4, 30] and block size 16 -> 30 * 16 + 5.
    b = Batch()
    b.add("x", 37, 1, [12, 4, 30], needs_logits=True, token_source=seq(0, 38))
    assert b.flatten(16).slot_mapping.tolist() == [485]


def test_seed001_exercise_1():
    b = Batch()
    b.add("r1", 30, 1, [0, 1], needs_logits=True, is_decode=True, token_source=seq(1000, 31))
    b.add("r2", 0, 6, [2], needs_logits=True, token_source=seq(2000, 6))
    b.add("r3", 16, 4, [3, 4, 5], needs_logits=False, token_source=seq(3000, 40))
    f = b.flatten(16)
    assert f.query_start_loc.tolist() == [0, 1, 7, 11]
    assert f.seq_lens.tolist() == [31, 6, 20]
    assert f.positions.tolist() == [30, 0, 1, 2, 3, 4, 5, 16, 17, 18, 19]
    assert f.logits_indices.tolist() == [0, 6]
    assert f.slot_mapping.tolist() == [1 * 16 + 14, 32, 33, 34, 35, 36, 37, 4 * 16 + 0, 65, 66, 67]


def test_seed002_mixed_batch_block_size_4():
    b = Batch()
    b.add("A", 6, 1, [5, 2], needs_logits=True, is_decode=True, token_source=seq(11, 7))
    b.add("B", 4, 3, [7, 9], needs_logits=False, token_source=seq(21, 10))
    b.add("C", 0, 4, [3], needs_logits=True, token_source=seq(31, 4))
    f = b.flatten(4)
    assert f.input_ids.tolist() == [17, 25, 26, 27, 31, 32, 33, 34]
    assert f.positions.tolist() == [6, 4, 5, 6, 0, 1, 2, 3]
    assert f.query_start_loc.tolist() == [0, 1, 4, 8]
    assert f.seq_lens.tolist() == [7, 7, 4]
    assert f.slot_mapping.tolist() == [10, 36, 37, 38, 12, 13, 14, 15]
    assert f.block_table.tolist() == [[5, 2], [7, 9], [3, 0]]
    assert f.logits_indices.tolist() == [0, 7]  # requests A and C


def test_empty_batch():
    f = Batch().flatten(16)
    assert f.input_ids.shape == (0,) and f.query_start_loc.tolist() == [0]
    assert f.slot_mapping.shape == (0,) and f.logits_indices.shape == (0,)
