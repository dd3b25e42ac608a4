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


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "report.md"
    run = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = out.read_text()
    assert "| paged_attention (mixed batch) |" in text and "FAIL" not in text and "kernels correct" in text
    assert "## decode steps" in text and "## mixed steps" in text and "prefill step" in text


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
    free, total = torch.cuda.mem_get_info()
    assert be.num_blocks > 0 and be.kv_caches[0][0].shape[0] == be.num_blocks and free >= 0.8 * total
