"""The GPU script on the CPU (dry run), and the GPU checks themselves, skipped without CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ENV = dict(os.environ, PYTHONPATH=str(ROOT))  # the script imports this checkout's packages


@pytest.mark.slow
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "report.md"
    run = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    assert "| paged_attention (mixed batch) |" in text and "FAIL" not in text and "kernels correct" in text
    assert "## decode steps" in text and "## mixed steps" in text and "prefill step" in text
    assert "## MoE: 8 experts, top-2" in text and "MoE kernels correct" in text and "| decode of 64 at context" in text


@pytest.mark.gpu
@needs_gpu
def test_seed001_mixed_step_on_gpu_bf16():
    from backends.real import RealBackend
    from backends.real.reference import dense_logits
    from sim.batch import Batch

    be = RealBackend("tiny", device="cuda", block_size=16, num_blocks=64)
    assert be.ops.name == "triton" and be.dtype == torch.bfloat16
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 512, n).tolist() for n in (7, 5, 22))
    tables = [[9], [33], [5, 60]]
    step1 = Batch()
    step1.add("a", 0, 7, tables[0], True, token_source=a)
    step1.add("b", 0, 5, tables[1], True, token_source=b)
    step1.add("c", 0, 10, tables[2], False, token_source=c)
    next_a, next_b = be.execute(step1).sampled_token_ids.tolist()
    a2, b2 = a + [next_a], b + [next_b]
    step2 = Batch()
    step2.add("a", 7, 1, tables[0], True, is_decode=True, token_source=a2)
    step2.add("b", 5, 1, tables[1], True, is_decode=True, token_source=b2)
    step2.add("c", 10, 12, tables[2], True, token_source=c)
    logits = be.runner.logits(step2.flatten(16))
    for row, ids in enumerate((a2, b2, c)):
        want = dense_logits(be.model, ids)[-1]
        assert (logits[row] - want).abs().max() <= 5e-2 * want.abs().max()
    result = be.execute(step2)
    assert result.seconds > 0 and set(result.breakdown) == {"prepare", "forward", "sample"}


@pytest.mark.gpu
@needs_gpu
def test_gpu_check_kernels_and_timings(tmp_path):
    out = tmp_path / "report.md"
    run = subprocess.run([sys.executable, "scripts/gpu_check.py", "--batch-sizes", "1,64", "--contexts", "512,2048",
                          "--repeats", "2", "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAIL" not in out.read_text()


@pytest.mark.gpu
@needs_gpu
def test_cuda_cache_is_sized_from_free_memory():
    from backends.real import RealBackend

    be = RealBackend("tiny", device="cuda", gpu_memory_utilization=0.05)
    _, total = torch.cuda.mem_get_info()
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in be.kv_caches)
    assert be.num_blocks > 0 and be.kv_caches[0][0].shape[0] == be.num_blocks + 1  # + the graphs' scratch block
    assert cache_bytes <= 0.05 * total


def _decode_batch(contexts, tables):
    from sim.batch import Batch

    b = Batch()
    for i, (c, t) in enumerate(zip(contexts, tables)):
        b.add(str(i), c - 1, 1, t, True, is_decode=True, token_source=list(range(100, 100 + c)))
    return b


def test_decode_steps_pick_the_smallest_graph_that_fits():
    from backends.real.cuda_graphs import graph_size_for, graph_sizes

    sizes = graph_sizes(20)
    assert sizes == [1, 2, 4, 8, 16, 20]
    assert graph_size_for(_decode_batch([5, 9, 17], [[1], [2], [3, 4, 5]]).flatten(8), sizes, 4) == 4
    assert graph_size_for(_decode_batch([5] * 20, [[1]] * 20).flatten(8), sizes, 4) == 20
    assert graph_size_for(_decode_batch([5] * 21, [[1]] * 21).flatten(8), sizes, 4) is None  # too many
    assert graph_size_for(_decode_batch([40], [[1, 2, 3, 4, 5]]).flatten(8), sizes, 4) is None  # too wide
    mixed = _decode_batch([5], [[1]])
    mixed.add("p", 0, 3, [7], True, token_source=[1, 2, 3])
    assert graph_size_for(mixed.flatten(8), sizes, 4) is None  # not decode-only
    partial = _decode_batch([5], [[1]])
    partial.add("p", 0, 1, [7], False, token_source=[1, 2, 3])
    assert graph_size_for(partial.flatten(8), sizes, 4) is None  # a row without logits


def test_padding_rows_decode_a_scratch_token_in_the_scratch_block():
    from backends.real.cuda_graphs import padded_decode_inputs

    flat = _decode_batch([5, 9], [[3], [6, 2]]).flatten(8)
    arrays = padded_decode_inputs(flat, 4, scratch_block=10, block_size=8)
    assert arrays["positions"].tolist() == [4, 8, 0, 0]
    assert arrays["seq_lens"].tolist() == [5, 9, 1, 1]
    assert arrays["slot_mapping"].tolist() == [3 * 8 + 4, 2 * 8 + 0, 80, 80]
    assert arrays["block_table"].tolist() == [[3, 0], [6, 2], [10, 10], [10, 10]]
    assert arrays["input_ids"].tolist() == [104, 108, 0, 0]


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_decode_steps_match_eager_ones():
    from backends.real import RealBackend
    from sim.batch import Batch

    graphs = RealBackend("tiny", device="cuda", block_size=16, num_blocks=64, max_num_seqs=8)
    eager = RealBackend("tiny", device="cuda", block_size=16, num_blocks=64, cuda_graphs=False)
    assert graphs.runner.graphs is not None, graphs.cuda_graph_error
    assert eager.runner.graphs is None
    rng = np.random.default_rng(1)
    for n in (1, 3, 5, 8):
        contexts = rng.integers(2, 200, n).tolist()
        tables = [list(range(13 * i, 13 * i + 13)) for i in range(n)]
        prefill = Batch()  # fill the caches: every request's prompt at once
        for i, c in enumerate(contexts):
            prefill.add(str(i), 0, c - 1, tables[i], True, token_source=list(range(100, 100 + c)))
        graphs.execute(prefill)
        eager.execute(prefill)
        step = _decode_batch(contexts, tables)
        assert graphs.runner.graphs.size_for(step.flatten(16)) is not None
        assert graphs.execute(step).sampled_token_ids.tolist() == eager.execute(step).sampled_token_ids.tolist()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_model_on_gpu_bf16_with_graphs(family):
    """The tiny MoE models on a GPU: Triton's grouped GEMM in bf16 against the torch reference, mixed
    steps against each sequence alone, and decode steps captured in CUDA graphs (the grouped GEMM's
    tile map needs no host sync) giving the eager steps' tokens."""
    from backends.real import RealBackend, moe
    from backends.real.kernels.grouped_gemm import grouped_gemm
    from backends.real.reference import dense_logits
    from sim.batch import Batch

    be = RealBackend(moe.tiny_moe(family), device="cuda", block_size=16, num_blocks=64, max_num_seqs=8)
    assert be.runner.graphs is not None, be.cuda_graph_error
    layer = be.model.layers[0]
    h = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe.route(h, layer.router, layer.moe)
    rows = moe.SortedRows(ids, layer.moe.num_experts)
    a = h[rows.token_of_row]
    got, want = grouped_gemm(a, layer.w13, rows), moe.torch_grouped_gemm(a.float(), layer.w13.float(), rows)
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()

    rng = np.random.default_rng(0)
    a_ids, c_ids = rng.integers(0, 512, 7).tolist(), rng.integers(0, 512, 22).tolist()
    step = Batch()
    step.add("a", 0, 7, [9], True, token_source=a_ids)
    step.add("c", 0, 22, [5, 60], True, token_source=c_ids)
    logits = be.runner.logits(step.flatten(16))
    for row, seq in enumerate((a_ids, c_ids)):
        want = dense_logits(be.model, seq)[-1]
        assert (logits[row] - want).abs().max() <= 5e-2 * want.abs().max()

    eager = RealBackend(moe.tiny_moe(family), device="cuda", block_size=16, num_blocks=64, cuda_graphs=False)
    eager.model.load_state_dict(be.model.state_dict())
    contexts = [5, 40, 77]
    tables = [list(range(13 * i, 13 * i + 13)) for i in range(3)]
    prefill = Batch()
    for i, c in enumerate(contexts):
        prefill.add(str(i), 0, c - 1, tables[i], True, token_source=list(range(100, 100 + c)))
    be.execute(prefill)
    eager.execute(prefill)
    decode = _decode_batch(contexts, tables)
    assert be.runner.graphs.size_for(decode.flatten(16)) is not None
    assert be.execute(decode).sampled_token_ids.tolist() == eager.execute(decode).sampled_token_ids.tolist()
