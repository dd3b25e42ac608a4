"""The Triton kernels against their torch references, run by Triton's interpreter on the CPU (fp32).

TRITON_INTERPRET must be set before any kernel is defined, and must not reach the other tests: so
the one test collected in a normal run starts pytest on this file again, in a subprocess with
TRITON_INTERPRET=1, where the kernel cases below are collected instead.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:

    @pytest.mark.slow  # about 15 s: the Triton kernels under its CPU interpreter
    def test_triton_kernels_match_torch_references_under_the_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                             cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        assert "passed" in run.stdout and "failed" not in run.stdout

else:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from backends.real import reference as ref
    from backends.real.kernels import elementwise, kv_write, paged_attention
    from backends.real.reference import AttentionMetadata

    def make_batch(rng, q_lens, ctx_lens, block_size, num_kv_heads, group, head_dim=16):
        """Random q and caches, and the metadata of requests with those query and cached lengths,
        their blocks scattered over the cache."""
        q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
        seq_lens = (q_lens + ctx_lens).astype(np.int32)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_blocks_per_req = -(-seq_lens // block_size)
        num_blocks = int(num_blocks_per_req.sum()) + 3
        perm = rng.permutation(num_blocks)
        table = np.zeros((len(seq_lens), num_blocks_per_req.max()), dtype=np.int32)
        start = 0
        for r, k in enumerate(num_blocks_per_req):
            table[r, :k] = perm[start:start + k]
            start += k
        gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        q = torch.randn(int(qsl[-1]), num_kv_heads * group, head_dim, generator=gen)
        meta = AttentionMetadata(torch.from_numpy(qsl), torch.from_numpy(seq_lens), torch.from_numpy(table), None,
                                 int(q_lens.max()), int(seq_lens.max()), qsl, seq_lens)
        return q, k_cache, v_cache, meta

    def check_attention(rng, q_lens, ctx_lens, block_size, group, num_kv_heads=2, num_splits=1):
        q, k_cache, v_cache, meta = make_batch(rng, q_lens, ctx_lens, block_size, num_kv_heads, group)
        scale = q.shape[-1] ** -0.5
        got = paged_attention.paged_attention(q, k_cache, v_cache, meta, scale, num_splits=num_splits)
        want = ref.paged_attention(q, k_cache, v_cache, meta, scale)
        err = (got - want).abs().max().item()
        assert err < 1e-4, err

    @pytest.mark.parametrize("block_size", [16, 32])
    @pytest.mark.parametrize("group", [1, 4, 8])
    def test_paged_attention_mixed_batch(block_size, group):
        rng = np.random.default_rng(block_size * 10 + group)
        # A decode, a fresh prefill, a later chunk of a prefill, a long decode.
        q_lens = [1, int(rng.integers(2, 30)), int(rng.integers(2, 20)), 1]
        ctx_lens = [int(rng.integers(1, 60)), 0, int(rng.integers(1, 50)), int(rng.integers(60, 90))]
        check_attention(rng, q_lens, ctx_lens, block_size, group)

    def test_paged_attention_long_prefill_chunk_tile():
        # A chunk of 130 queries takes the 128-row tile; with a decode beside it.
        check_attention(np.random.default_rng(9), [130, 1], [20, 33], 16, 8)

    @pytest.mark.parametrize("group", [1, 4, 8])
    def test_paged_attention_split_kv_decodes(group):
        # Flash decoding: each context cut into 3 segments, rounded up to 64 keys (block_n); the
        # short requests' last segments are empty, and the merge must ignore them.
        rng = np.random.default_rng(group)
        check_attention(rng, [1, 1, 1], [150, 20, 70], 16, group, num_splits=3)

    def test_split_count_heuristic():
        assert paged_attention.num_kv_splits(8, 1, 8192, 132) == 16  # batch 1, Llama-8B's 8 KV heads
        assert paged_attention.num_kv_splits(8 * 64, 1, 8192, 132) == 1  # enough programs already
        assert paged_attention.num_kv_splits(8, 1, 600, 132) == 1  # too short to split
        assert paged_attention.num_kv_splits(8, 2, 8192, 132) == 1  # mixed batches are not split

    @settings(max_examples=6, deadline=None)
    @given(st.integers(0, 2**20), st.sampled_from([16, 32]), st.sampled_from([1, 4, 8]),
           st.lists(st.tuples(st.integers(1, 24), st.integers(0, 70)), min_size=1, max_size=4),
           st.integers(1, 3))
    def test_paged_attention_random_lengths(seed, block_size, group, lengths, num_splits):
        q_lens, ctx_lens = zip(*lengths)  # the kernel splits any batch; the heuristic only decode-only ones
        check_attention(np.random.default_rng(seed), q_lens, ctx_lens, block_size, group, num_splits=num_splits)

    @pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 16), (3, 24)])
    def test_write_kv_at_slots(num_kv_heads, head_dim):
        rng = np.random.default_rng(num_kv_heads)
        shape = (6, 16, num_kv_heads, head_dim)
        k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
        num_tokens = 21
        kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim)
        k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # strided views, as split from the QKV matmul
        slots = torch.from_numpy(rng.permutation(6 * 16)[:num_tokens].astype(np.int64))
        kv_write.write_kv(k, v, k_cache, v_cache, slots)
        want_k, want_v = torch.zeros(shape), torch.zeros(shape)
        ref.write_kv(k, v, want_k, want_v, slots)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)

    def test_rms_norms():
        x, residual, w = torch.randn(9, 40), torch.randn(9, 40), torch.randn(40)
        assert (elementwise.rms_norm(x, w, 1e-6) - ref.rms_norm(x, w, 1e-6)).abs().max() < 1e-5
        want, want_sum = ref.add_rms_norm(x, residual, w, 1e-6)
        got, got_sum = elementwise.add_rms_norm(x, residual.clone(), w, 1e-6)
        assert (got - want).abs().max() < 1e-5 and (got_sum - want_sum).abs().max() < 1e-6

    @pytest.mark.parametrize("qk_norm", [True, False])
    @pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (8, 1, 12)])
    def test_qk_norm_rope(qk_norm, num_heads, num_kv_heads, head_dim):
        num_tokens = 11
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
        positions = torch.randint(0, 200, (num_tokens,))
        cos_sin = ref.rope_cos_sin(256, head_dim, 10000.0)
        norms = (torch.randn(head_dim), torch.randn(head_dim)) if qk_norm else (None, None)
        want = ref.qk_norm_rope(q, k, positions, cos_sin, *norms, 1e-6)
        got = elementwise.qk_norm_rope(q, k, positions, cos_sin, *norms, 1e-6)
        for g, w in zip(got, want):
            assert (g - w).abs().max() < 1e-5

    def test_silu_mul():
        gate_up = torch.randn(7, 2 * 48)
        assert (elementwise.silu_mul(gate_up) - ref.silu_mul(gate_up)).abs().max() < 1e-6

    def test_whole_model_with_triton_kernels_matches_dense_reference():
        from backends.real import RealBackend
        from backends.real.ops import triton_ops
        from backends.real.reference import dense_logits
        from backends.real.runner import ModelRunner
        from sim.batch import Batch

        backend = RealBackend("tiny", device="cpu", block_size=16, num_blocks=32, seed=3)
        runner = ModelRunner(backend.model, triton_ops(), backend.kv_caches, 16, backend.device)
        rng = np.random.default_rng(5)
        a, c = rng.integers(0, 512, 6).tolist(), rng.integers(0, 512, 40).tolist()
        b = Batch()
        b.add("a", 0, 5, [7], True, token_source=a)
        b.add("c", 0, 17, [20, 3, 11], False, token_source=c)
        runner.logits(b.flatten(16))
        b = Batch()  # a decode and the second chunk of C, one mixed step
        b.add("a", 5, 1, [7], True, is_decode=True, token_source=a)
        b.add("c", 17, 23, [20, 3, 11], True, token_source=c)
        logits = runner.logits(b.flatten(16))
        for row, ids in enumerate((a, c)):
            assert (logits[row] - dense_logits(backend.model, ids)[-1]).abs().max() <= 1e-3

    # The experts' grouped GEMM (kernels/grouped_gemm.py).

    def grouped_case(seed, num_tokens, num_experts, top_k, hidden, inter, skew=False):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(num_tokens, num_experts, generator=gen)
        if skew:  # most tokens to expert 0, some experts get none
            logits[:, 0] += 6.0
        ids = torch.topk(logits, top_k, dim=-1).indices
        weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
        h = torch.randn(num_tokens, hidden, generator=gen)
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
        w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
        return h, w13, w2, weights, ids

    def test_tile_map_worked_example():
        from backends.real.kernels.grouped_gemm import tile_map

        # Experts' rows: e0 [0, 20), e1 none, e2 [20, 23), e3 [23, 40); tiles of 16 rows.
        counts = torch.tensor([20, 0, 3, 17])
        starts = torch.tensor([0, 20, 20, 23])
        experts, first, end = tile_map(starts, counts, 16, 7)
        assert experts[:5].tolist() == [0, 0, 2, 3, 3]
        assert first.tolist() == [0, 16, 20, 23, 39, 0, 0] and end.tolist() == [16, 20, 23, 39, 40, 0, 0]

    @pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,skew", [
        (1, 8, 2, 64, 32, False),  # one decode token
        (37, 8, 2, 64, 32, False),
        (150, 4, 2, 40, 24, True),  # a ragged hidden size, experts left empty, tiles of 64 rows
        (9, 16, 4, 16, 16, False),
        (0, 4, 1, 16, 16, False),
    ])
    def test_grouped_gemm_experts_match_torch(num_tokens, num_experts, top_k, hidden, inter, skew):
        from backends.real import moe
        from backends.real.kernels.grouped_gemm import grouped_gemm

        h, w13, w2, weights, ids = grouped_case(num_tokens, num_tokens, num_experts, top_k, hidden, inter, skew)
        rows = moe.SortedRows(ids, num_experts)
        a = h[rows.token_of_row]
        assert torch.allclose(grouped_gemm(a, w13, rows), moe.torch_grouped_gemm(a, w13, rows), atol=1e-4)
        got = moe.experts(h, w13, w2, weights, ids, grouped_gemm, elementwise.silu_mul)
        want = moe.experts(h, w13, w2, weights, ids, moe.torch_grouped_gemm, ref.silu_mul)
        assert got.shape == (num_tokens, hidden) and torch.allclose(got, want, atol=1e-4)

    def test_whole_moe_model_with_triton_kernels_matches_dense_reference():
        from backends.real import RealBackend
        from backends.real.moe import tiny_moe
        from backends.real.ops import triton_ops
        from backends.real.reference import dense_logits
        from backends.real.runner import ModelRunner
        from sim.batch import Batch

        backend = RealBackend(tiny_moe("qwen3_moe"), device="cpu", block_size=16, num_blocks=32, seed=3)
        runner = ModelRunner(backend.model, triton_ops(), backend.kv_caches, 16, backend.device)
        rng = np.random.default_rng(6)
        a, c = rng.integers(0, 512, 6).tolist(), rng.integers(0, 512, 30).tolist()
        b = Batch()
        b.add("a", 0, 5, [7], True, token_source=a)
        b.add("c", 0, 17, [20, 3], False, token_source=c)
        runner.logits(b.flatten(16))
        b = Batch()
        b.add("a", 5, 1, [7], True, is_decode=True, token_source=a)
        b.add("c", 17, 13, [20, 3], True, token_source=c)
        logits = runner.logits(b.flatten(16))
        for row, ids in enumerate((a, c)):
            assert (logits[row] - dense_logits(backend.model, ids)[-1]).abs().max() <= 1e-3
