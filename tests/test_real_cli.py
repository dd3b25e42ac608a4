"""A real replay end to end on the CPU: the CLI, the engine feeding sampled tokens back, the block
manager and the KV cache agreeing on block ids."""

import json

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")

from backends.real import RealBackend  # noqa: E402
from backends.real.reference import dense_logits  # noqa: E402
from reports.run_tables import read_run_table  # noqa: E402
from sim.app.cli import main  # noqa: E402
from sim.app.plan import resolve  # noqa: E402
from sim.app.replay import ReplayOptions, replay  # noqa: E402
from sim.config import CacheConfig, SchedulerConfig  # noqa: E402
from sim.request import Status  # noqa: E402
from traces import read_trace  # noqa: E402

TRACE = "arrival_s,prompt_tokens,output_tokens\n0.0,40,6\n0.001,70,4\n0.002,7,1\n0.004,90,9\n0.005,20,12\n"


@pytest.fixture()
def trace_file(tmp_path):
    path = tmp_path / "tiny.csv"
    path.write_text(TRACE)
    return path


# Every request arrives at once, so the schedule (and the preemption it forces) does not depend
# on how long the real steps take on this machine: with staggered arrivals a fast CPU finishes
# the first requests before the last arrive and nothing is preempted.
AT_ONCE = "arrival_s,prompt_tokens,output_tokens\n0.0,40,6\n0.0,70,4\n0.0,7,1\n0.0,90,9\n0.0,20,12\n"


def test_cli_real_replay_on_cpu(trace_file, tmp_path, capsys):
    out = tmp_path / "real"
    rc = main(["replay", str(trace_file), "--backend", "real", "--device", "cpu", "--model", "tiny",
               "--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert "real" in capsys.readouterr().out
    steps = read_run_table(out, "steps")
    requests = pd.read_csv(out / "requests.csv")
    assert (requests["status"] == "finished").all()
    assert (steps["seconds"] > 0).all()
    assert np.allclose(steps["seconds"], steps[["prepare_s", "forward_s", "sample_s"]].sum(axis=1))
    # The same base columns as a cost-model run; the breakdown columns are the backend's own.
    rc = main(["replay", str(trace_file), "--model", "tiny", "--max-num-batched-tokens", "32",
               "--max-num-seqs", "4", "--out", str(tmp_path / "cm"), "--quiet"])
    cm = read_run_table(tmp_path / "cm", "steps")
    base = [c for c in cm.columns if c not in ("linear_s", "attention_s", "kv_write_s", "elementwise_s",
                                                "lm_head_s", "overhead_s", "gpu_s", "host_s")]
    assert list(steps.columns[:len(base)]) == base
    summary = json.loads((out / "summary.json").read_text())
    # The summary reports the cache the backend really allocated (the CPU default: 1 GiB for tiny).
    assert summary["options"]["cache"]["num_blocks"] == (1 << 30) // (2 * 2 * 16 * 2 * 16 * 4)
    assert summary["options"]["backend"] == "real" and summary["options"]["device"] == "cpu"


def test_generated_tokens_are_the_models_greedy_continuation(tmp_path):
    """Chunked prefills, mixed steps, and preemption by recompute (a cache of 14 blocks of 8
    tokens): every request's output must still be the greedy continuation that the dense
    reference computes for it alone."""
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", 24, 4), cache=CacheConfig(8, 14),
                            model="tiny", backend="real", seed=3)
    backend = RealBackend("tiny", block_size=8, num_blocks=14, seed=3)
    trace_file = tmp_path / "at_once.csv"
    trace_file.write_text(AT_ONCE)
    result = replay(read_trace(trace_file), resolve(options, backend=backend))
    assert result.num_preemptions > 0
    for r in result.requests:
        assert r.status is Status.FINISHED
        assert len(r.sampled_token_ids) == r.max_tokens
        ids = r.token_ids(0, r.num_prompt_tokens + r.max_tokens, backend.runner.token_spec)
        logits = dense_logits(backend.model, ids[:-1])
        want = logits[r.num_prompt_tokens - 1:].argmax(-1).tolist()
        assert r.sampled_token_ids == want, r.request_id


def test_replay_sizes_the_block_manager_from_the_backend(trace_file):
    backend = RealBackend("tiny", block_size=16, num_blocks=40)
    options = ReplayOptions(model="tiny", backend="real", cache=CacheConfig(16, None))
    result = replay(read_trace(trace_file), resolve(options, backend=backend))
    assert max(result.steps.num_kv_blocks_used) <= 40
    assert all(r.status is Status.FINISHED for r in result.requests)


def test_without_torch_the_real_backend_names_the_pip_extra(trace_file, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; sys.modules['torch'] = None\n"
            "from sim.app.cli import main\n"
            f"sys.exit(main(['replay', {str(trace_file)!r}, '--backend', 'real', '--model', 'tiny', "
            f"'--out', {str(tmp_path / 'o')!r}, '--quiet']))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "pip install -e '.[real]'" in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1


def test_prefix_cache_hits_read_the_blocks_another_request_wrote(tmp_path):
    """Requests sharing leading hash ids share token runs; the later ones reuse the earlier ones'
    KV blocks, and their outputs are still their greedy continuations."""
    path = tmp_path / "shared.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,hash_ids,hash_block_tokens\n"
                    "0.0,30,3,1 2 3 4,8\n"
                    "0.5,29,4,1 2 3 9,8\n"
                    "0.6,20,2,1 2 7,8\n")
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", 16, 4), cache=CacheConfig(4, 40),
                            model="tiny", backend="real", seed=1)
    backend = RealBackend("tiny", block_size=4, num_blocks=40, seed=1)
    result = replay(read_trace(path), resolve(options, backend=backend))
    assert result.num_prefix_hit_tokens >= 24 + 16
    for r in result.requests:
        ids = r.token_ids(0, r.num_prompt_tokens + r.max_tokens, backend.runner.token_spec)
        want = dense_logits(backend.model, ids[:-1])[r.num_prompt_tokens - 1:].argmax(-1).tolist()
        assert r.sampled_token_ids == want, r.request_id
