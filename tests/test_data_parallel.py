"""--dp N (sim/data_parallel.py): vLLM's DP load balancer and the ranks' lockstep, worked by hand;
properties over random traces; `sim replay --dp 2` end to end.

The worked example: 2 ranks, chunked, token budget 8, block size 4; every step costs
0.5 + 0.25 s per scheduled token (a dummy batch, one token: 0.75 s).

    R0 arrives at 0.0: 4-token prompt, 2 output tokens
    R1 arrives at 0.2: 6-token prompt, 1 output token
    R2 arrives at 0.3: 2-token prompt, 2 output tokens

Routing (core_client.py get_core_engine_for_request; the coordinator publishes at 0.1 s steps):
- R0 at 0.0: nothing reported, nothing in flight: both score 0, the scan starts at rank 0 -> rank 0
  (its snapshot waiting count becomes 1; the scan start moves to 1).
- At 0.1 the coordinator publishes what the ranks sent at the first step's start: rank 0 waiting 1.
- R1 at 0.2: scan from rank 1: score max(0, 0) = 0; rank 0 max(1 in flight, 1 + 0) = 1 -> rank 1.
- R2 at 0.3: scan from rank 0: max(1, 1) = 1; rank 1 max(1, 0 + 1 local) = 1, not lower -> rank 0.
Lockstep (core.py DPEngineCoreProc.run_busy_loop):
- step 1 at 0.0: rank 0 R0's prompt (4 tokens: 1.5 s), rank 1 idle: dummy (0.75 s) -> ends 1.5.
- step 2 at 1.5: rank 0 R0's decode + R2's prompt (3 tokens: 1.25 s), rank 1 R1's prompt (6: 2.0 s)
  -> ends 3.5 (rank 0 waited 0.75 s); R0 and R1 finish, R2 has its first token.
- step 3 at 3.5: rank 0 R2's decode (0.75 s), rank 1 dummy (0.75 s) -> ends 4.25; R2 finishes.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import load_policy
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.app.replay import make_requests
from sim.backend import StepResult
from sim.block_manager import BlockManager
from sim.config import CacheConfig, SchedulerConfig
from sim.data_parallel import DataParallelGroup, DPLoadBalancer
from sim.engine import Engine, TokenTimes
from sim.errors import ServesimError
from sim.request import Status
from tests.helpers import make_trace


class TokenBackend:
    """0.5 s plus 0.25 s per scheduled token."""

    name = "tokens"
    device = device_name = "cpu"
    dtype = "float32"
    num_blocks = None
    supports_fast_forward = False

    def execute(self, batch) -> StepResult:
        return StepResult(0.5 + 0.25 * sum(batch.num_scheduled_tokens), {"work": 0.25 * sum(batch.num_scheduled_tokens)})


def group(rows, dp=2, num_blocks=64, lockstep=True, budget=8, seed_policy="chunked"):
    requests = sorted(make_requests(make_trace(rows)), key=lambda r: (r.arrival_s, r.index))
    token_times = TokenTimes(requests)
    g = DataParallelGroup(requests, token_times, dp, lockstep)
    backend = TokenBackend()
    for _ in range(dp):
        policy = load_policy(seed_policy)(SchedulerConfig(seed_policy, max_num_batched_tokens=budget, max_num_seqs=4))
        g.add_rank(Engine(policy, backend, BlockManager(num_blocks, 4), token_times, 10_000, fast_forward=False))
    return g


def test_worked_example_exact_to_the_step():
    g = group([(0.0, 4, 2), (0.2, 6, 1), (0.3, 2, 2)])
    result = g.run()
    assert result.rank_of.tolist() == [0, 1, 0]
    assert [result.tokens_of(i).tolist() for i in range(3)] == [[1.5, 3.5], [3.5], [3.5, 4.25]]
    assert result.end_s == 4.25
    s = result.steps
    rows = list(zip(s.dp_rank.tolist(), s.start_s.tolist(), s.seconds.tolist(), s.num_prefill_tokens.tolist(),
                    s.num_decode_tokens.tolist(), s.dp_wait.tolist()))
    assert rows == [(0, 0.0, 1.5, 4, 0, 0.0), (0, 1.5, 2.0, 2, 1, 0.75), (1, 1.5, 2.0, 6, 0, 0.0),
                    (0, 3.5, 0.75, 0, 1, 0.0)]
    assert result.num_lockstep_steps == 3 and result.num_waves == 1
    assert [(r["requests"], r["steps"], r["dummy_steps"]) for r in result.per_rank] == [(2, 3, 0), (1, 1, 2)]


def test_a_new_wave_after_the_ranks_pause():
    # R3 arrives at 10: the first wave ended at its all-reduce (step 1, then every 16th) -- here at
    # the 16th lockstep step, 3 real steps and 13 dummy ones later -- and R3 starts a second one.
    g = group([(0.0, 4, 2), (0.2, 6, 1), (0.3, 2, 2), (100.0, 4, 1)])
    result = g.run()
    assert result.tokens_of(3).tolist() == [101.5]
    assert result.num_waves == 2
    assert result.num_lockstep_steps == 16 + 1


def test_load_balancer_score_penalises_waiting_on_a_full_cache():
    # core_client.py: score = max(in flight, waiting + running) + waiting x 6 x max(0, usage - 0.5).
    lb = DPLoadBalancer(2)

    class Rank:
        def __init__(self, n):
            self.num_in_flight = n

    lb.lb_engines = [[1, 1, 1.0], [0, 4, 0.0]]  # rank 0: 2 + 1 x 6 x 0.5 = 5; rank 1: 4
    assert lb.route(None, [Rank(2), Rank(4)]) == 1
    assert lb.lb_engines[1][0] == 1 and lb.eng_start_index == 1
    lb.lb_engines = [[1, 1, 0.5], [1, 1, 0.5]]  # a tie: the first scanned from eng_start_index (1)
    assert lb.route(None, [Rank(0), Rank(0)]) == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=25),
       st.integers(2, 3), st.booleans(), st.integers(6, 40))
def test_properties(rows, dp, lockstep, num_blocks):
    rows = sorted(rows)
    g = group(rows, dp=dp, num_blocks=num_blocks, lockstep=lockstep)
    result = g.run()
    for r in result.requests:  # every request ends once, finished or rejected as too big for a rank
        assert r.status in (Status.FINISHED, Status.REJECTED)
        if r.status is Status.FINISHED:
            assert len(result.tokens_of(result.requests.index(r))) == r.max_tokens
    assert sum(rank["requests"] for rank in result.per_rank) == len(rows)
    for rank in g.ranks:  # blocks conserved per rank: all free again, the pool and the index agree
        bm = rank.engine.block_manager
        assert bm.num_used_blocks == 0
        bm.check_invariants([])
    s = result.steps
    if lockstep and len(s):
        own = s.seconds - s.dp_wait
        assert (s.dp_wait >= 0).all() and (s.seconds >= own).all()
        by_start: dict = {}
        for start, seconds in zip(s.start_s.tolist(), s.seconds.tolist()):
            assert by_start.setdefault(start, seconds) == seconds  # one lockstep step, one length
        for rank in range(dp):  # a rank's steps follow one another without overlap
            starts = s.start_s[s.dp_rank == rank]
            ends = starts + s.seconds[s.dp_rank == rank]
            assert (starts[1:] >= ends[:-1] - 1e-9).all()


def test_options_and_refusals():
    assert ReplayOptions(dp=2).dp == 2
    with pytest.raises(ServesimError, match="--dp"):
        ReplayOptions(dp=0)
    with pytest.raises(ServesimError, match="--dp 2"):
        ReplayOptions(dp=2, backend="real")


def test_plan_kv_per_rank_with_dp():
    base = dict(model="Qwen3-30B-A3B", hardware="H200", enable_expert_parallel=True,
                cache=CacheConfig(), scheduler=SchedulerConfig())
    one = resolve(ReplayOptions(**base), build_backend=False)
    two = resolve(ReplayOptions(**base, dp=2), build_backend=False)
    # The experts split over 2 GPUs: each holds fewer weights, so more KV blocks per rank.
    assert two.kv.terms["weights"] < one.kv.terms["weights"]
    assert two.num_blocks > one.num_blocks
    assert "dp" not in one.as_dict() and two.as_dict()["dp"] == 2


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    rows = [(round(0.05 * i, 3), 100 + 37 * (i % 7), 5 + (i % 9)) for i in range(40)]
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{a},{p},{o}\n" for a, p, o in rows))
    out = tmp_path / "dp"
    main(["replay", str(trace), "--model", "Qwen3-30B-A3B", "--dp", "2", "--enable-expert-parallel",
          "--hardware", "H200", "--out", str(out), "--quiet"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["options"]["dp"] == 2
    dp = summary["data_parallel"]
    assert dp["dp"] == 2 and sum(r["requests"] for r in dp["ranks"]) == 40
    assert all(r["kv_blocks"] == summary["kv_cache"]["num_gpu_blocks"] for r in dp["ranks"])
    requests = pd.read_csv(out / "requests.csv")
    one = tmp_path / "one"
    main(["replay", str(trace), "--model", "Qwen3-30B-A3B", "--hardware", "H200", "--out", str(one), "--quiet"])
    assert list(requests.columns) == list(pd.read_csv(one / "requests.csv").columns)  # the same form
    assert (requests["status"] == "finished").all()
    steps = pd.read_parquet(out / "steps.parquet")
    assert set(np.unique(steps["dp_rank"])) == {0, 1}
