"""Shared test helpers: tiny traces and a constant-time backend."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from sim.backend import StepResult
from sim.batch import Batch
from traces.trace import Trace


def make_trace(rows, hash_ids=None, hash_block_tokens=512) -> Trace:
    """rows: [(arrival_s, prompt_tokens, output_tokens)]"""
    arrival = np.array([r[0] for r in rows], dtype=np.float64)
    prompt = np.array([r[1] for r in rows], dtype=np.int64)
    output = np.array([r[2] for r in rows], dtype=np.int64)
    hashes = None if hash_ids is None else [np.asarray(h, dtype=np.int64) for h in hash_ids]
    return Trace(arrival, prompt, output, hash_ids=hashes, hash_block_tokens=hash_block_tokens, source="test")


def shared_dir() -> Path:
    """`../shared` beside this checkout, or beside the main checkout when this is a git worktree
    (where it need not exist: tests that read it skip without it)."""
    root = Path(__file__).resolve().parents[1]
    candidates = [root.parent / "shared"]
    try:
        common = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=root,
                                capture_output=True, text=True, check=True).stdout.strip()
        candidates.append(Path(common).parent.parent / "shared")
    except (OSError, subprocess.CalledProcessError):
        pass  # not a git checkout
    return next((c for c in candidates if c.is_dir()), candidates[0])


class ConstantBackend:
    """Every step takes the same time; records every batch it executes."""

    name = "constant"
    device = device_name = "cpu"
    dtype = "float32"
    num_blocks = None  # the run's KV plan decides
    supports_fast_forward = False

    def __init__(self, seconds: float = 1.0, on_execute=None):
        self.seconds = seconds
        self.on_execute = on_execute
        self.batches = []

    def execute(self, batch) -> StepResult:
        self.batches.append(batch)
        if self.on_execute is not None:
            self.on_execute(batch)
        return StepResult(self.seconds, {})


class TokenBackend:
    """0.5 s plus 0.25 s per scheduled token (its `work` in the breakdown): steps that carry more tokens take
    longer, as a GPU's do (the data-parallel and admission-limit tests)."""

    name = "tokens"
    device = device_name = "cpu"
    dtype = "float32"
    num_blocks = None
    supports_fast_forward = False

    def execute(self, batch) -> StepResult:
        work = 0.25 * sum(batch.num_scheduled_tokens)
        return StepResult(0.5 + work, {"work": work})


def replay_with_blocks(bm, rows, config, check) -> None:
    """Random workloads against a block manager (tests/test_sliding_blocks.py, test_hybrid_blocks.py):
    rows (arrival, prompt, output, hash seed) through one `chunked` engine on `bm` with `config`,
    `check(batch, running)` at every step; then every request ended once, a finished one with all
    its tokens, and every block free again with the manager's invariants holding."""
    from policies import load_policy
    from sim.arrivals import TraceArrivals, simulate
    from sim.engine import Engine, TokenTimes
    from sim.request import Request, Status

    requests = [Request(i, str(i), float(t), p, o, hash_ids=np.array([h, h + 1] * (p // 8 + 1)), hash_block_tokens=4)
                for i, (t, p, o, h) in enumerate(sorted(rows))]
    engine = None
    backend = ConstantBackend(on_execute=lambda batch: check(batch, engine.state.running))
    engine = Engine(load_policy("chunked")(config), backend, bm, TokenTimes(requests), 10_000)
    result = simulate(engine, TraceArrivals(requests, engine))
    for i, r in enumerate(result.requests):
        assert r.status in (Status.FINISHED, Status.REJECTED)
        if r.status is Status.FINISHED:
            assert len(result.tokens_of(i)) == r.max_tokens
    assert bm.num_used_blocks == 0
    bm.check_invariants([])


# The real backend's tests (tests/test_real_model.py, tests/test_real_moe.py): paged batches of
# token ids, run through a real backend's model.

def tokens(seed, n, vocab=512):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def run(backend, items):
    """items: (token_ids, num_computed, num_scheduled, block_table, needs_logits) -> logits [n, vocab]."""
    b = Batch()
    for i, (ids, computed, scheduled, table, needs_logits) in enumerate(items):
        b.add(str(i), computed, scheduled, table, needs_logits, is_decode=scheduled == 1 and computed > 0,
              token_source=ids)
    return backend.runner.logits(b.flatten(backend.block_size))


def sim(*args) -> int:
    """`sim ARGS...` in this process (each argument as text); its exit code."""
    from sim.app.cli import main

    return main([str(a) for a in args])


def one_error_line(capsys) -> str:
    """The one line `sim: error: ...` a refused command printed, without its prefix."""
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and err.count("\n") == 1, err
    return err.removeprefix("sim: error: ").rstrip("\n")
