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
from sim.data_parallel import ClosedLoopClients, DataParallelGroup, DPLoadBalancer, dp_padded_tokens
from sim.engine import Engine, TokenTimes
from sim.errors import ServesimError
from sim.request import Status
from sim.sliding_block_manager import SlidingWindowBlockManager
from tests.helpers import TokenBackend, make_trace


def group(rows, dp=2, num_blocks=64, lockstep=True, budget=8, seed_policy="chunked", asynchronous=False,
          window=None, max_num_seqs=4, interval=1):
    """`window`: the ranks' caches hold a sliding group of that window and a full-attention group
    (gpt-oss's layout, sim/sliding_block_manager.py); `interval`: --prefill-schedule-interval."""
    requests = sorted(make_requests(make_trace(rows)), key=lambda r: (r.arrival_s, r.index))
    token_times = TokenTimes(requests)
    g = DataParallelGroup(requests, token_times, dp, lockstep)
    backend = TokenBackend()
    for _ in range(dp):
        policy = load_policy(seed_policy)(SchedulerConfig(seed_policy, max_num_batched_tokens=budget,
                                                          max_num_seqs=max_num_seqs, async_scheduling=asynchronous,
                                                          prefill_schedule_interval=interval))
        bm = BlockManager(num_blocks, 4) if window is None else SlidingWindowBlockManager(
            num_blocks, 4, True, (("sliding_attention", window), ("full_attention", None)),
            window - 1 + (1 + asynchronous) * budget)
        g.add_rank(Engine(policy, backend, bm, token_times, 10_000, fast_forward=False))
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
    # 3 lockstep steps run requests; then dummy batches on both ranks until the all-reduce of the 16th step
    # ends the wave (counted, not timed: no request is left to answer for).
    assert result.num_lockstep_steps == 16 and result.num_waves == 1
    assert [(r["requests"], r["steps"], r["dummy_steps"]) for r in result.per_rank] == [(2, 3, 13), (1, 1, 15)]


def test_worked_example_scheduled_asynchronously():
    """The worked example with asynchronous scheduling (vLLM's default): a rank that took a real step
    schedules its next as of that step's start; an empty schedule runs a dummy and the rank schedules
    at the next step's start (`DataParallelGroup._lockstep`). Routing is as before (R0, R2 -> rank 0).

    - step 1 at 0.0: rank 0 R0's prompt (scheduled at 0; 1.5 s), rank 1 dummy -> ends 1.5.
    - step 2 at 1.5: rank 0 scheduled as of 0.0, before R2 arrived (0.3): R0's decode alone (0.75 s);
      rank 1 was idle, so it schedules at 1.5: R1's prompt (2.0 s) -> ends 3.5; R0 and R1 end.
    - step 3 at 3.5: rank 0 scheduled as of 1.5: R2's prompt (R0, its last token in flight, holds its
      seat and blocks until then; 1.0 s); rank 1's schedule as of 1.5 is empty (R1's last token in
      flight): a dummy -> ends 4.5, R2's first token (synchronously: 3.5).
    - step 4 at 4.5: rank 0 R2's decode (scheduled as of 3.5), rank 1 dummy -> ends 5.25."""
    g = group([(0.0, 4, 2), (0.2, 6, 1), (0.3, 2, 2)], asynchronous=True)
    result = g.run()
    assert result.rank_of.tolist() == [0, 1, 0]
    assert [result.tokens_of(i).tolist() for i in range(3)] == [[1.5, 3.5], [3.5], [4.5, 5.25]]
    r2 = result.requests[2]
    assert (r2.first_scheduled_s, r2.first_step_start_s) == (1.5, 3.5)
    s = result.steps
    rows = list(zip(s.dp_rank.tolist(), s.start_s.tolist(), s.seconds.tolist(), s.num_prefill_tokens.tolist(),
                    s.num_decode_tokens.tolist(), s.dp_wait.tolist()))
    assert rows == [(0, 0.0, 1.5, 4, 0, 0.0), (0, 1.5, 2.0, 0, 1, 1.25), (1, 1.5, 2.0, 6, 0, 0.0),
                    (0, 3.5, 1.0, 2, 0, 0.0), (0, 4.5, 0.75, 0, 1, 0.0)]
    assert result.end_s == 5.25 and result.num_lockstep_steps == 16  # 4, then dummies to the 16th's all-reduce
    assert [(r["requests"], r["steps"], r["dummy_steps"]) for r in result.per_rank] == [(2, 4, 12), (1, 1, 15)]
    assert result.summary()["scheduling"] == "asynchronous"
    for rank in g.ranks:
        assert rank.engine.block_manager.num_used_blocks == 0


def test_a_new_wave_after_the_ranks_pause():
    # R3 arrives at 10: the first wave ended at its all-reduce (step 1, then every 16th) -- here at
    # the 16th lockstep step, 3 real steps and 13 dummy ones later -- and R3 starts a second one.
    g = group([(0.0, 4, 2), (0.2, 6, 1), (0.3, 2, 2), (100.0, 4, 1)])
    result = g.run()
    assert result.tokens_of(3).tolist() == [101.5]
    assert result.num_waves == 2
    assert result.num_lockstep_steps == 16 + 1


CADENCE_ROWS = [(0.0, 4, 6), (0.2, 4, 6), (0.3, 2, 1), (0.4, 2, 1), (0.5, 2, 2), (0.6, 2, 2)]


def step_rows(result):
    s = result.steps
    return list(zip(s.dp_rank.tolist(), s.start_s.tolist(), s.num_prefill_tokens.tolist(), s.num_decode_tokens.tolist()))


def test_the_prefill_cadence_shared_by_a_lockstep_group_worked_by_hand():
    """--prefill-schedule-interval 3 on a DP 2 lockstep group (vLLM's DPEngineCoreProc._should_throttle_prefills:
    a schedule is throttled when the ranks' shared step counter, 0 at a wave's first step, is not a multiple
    of 3; a throttled rank holds prefill while one of its running requests is past its prefill, unless its
    last step that could carry prefill left requests waiting). Two seats per rank, the worked example's costs
    (0.5 s + 0.25 s a token). Routing alternates: R0, R2, R4 -> rank 0; R1, R3, R5 -> rank 1.

    - step 0 (counter 0, never throttled) at 0.0: rank 0 R0's prompt (4 tokens); rank 1 dummy -> ends 1.5.
    - step 1 (counter 1, throttled) at 1.5: rank 0 holds R2 and R4 (R0 decodes); rank 1 has nothing past its
      prefill, so it is not held: R1's and R3's prompts (6 tokens); R5 finds no seat, so rank 1's queue did
      not drain (capacity bound) -> ends 3.5 (2.0 s); R3 (1 output token) finishes.
    - step 2 (counter 2, throttled) at 3.5: rank 0 R0's decode only; rank 1, capacity bound, is not held:
      R1's decode and R5's prompt in R3's seat (its queue drains) -> ends 4.75.
    - step 3 (counter 3, a release) at 4.75: rank 0 R0's decode and R2's prompt; R4 finds no seat (rank 0
      now capacity bound); rank 1 two decodes -> ends 6.0; R2 (1 token) finishes.
    - step 4 (counter 4, throttled) at 6.0: rank 0, capacity bound, admits R4 into R2's seat at once (not at
      the next release, step 6); rank 1 R1's decode -> ends 7.25.
    With interval 1, R2's first token comes at 3.5 (step 1); here at 6.0."""
    result = group(CADENCE_ROWS, max_num_seqs=2, interval=3).run()
    assert result.rank_of.tolist() == [0, 1, 0, 1, 0, 1]
    assert step_rows(result)[:9] == [(0, 0.0, 4, 0), (0, 1.5, 0, 1), (1, 1.5, 6, 0), (0, 3.5, 0, 1), (1, 3.5, 2, 1),
                                     (0, 4.75, 2, 1), (1, 4.75, 0, 2), (0, 6.0, 2, 1), (1, 6.0, 0, 1)]
    assert [result.tokens_of(i).tolist()[0] for i in range(6)] == [1.5, 3.5, 6.0, 3.5, 7.25, 4.75]
    assert group(CADENCE_ROWS, max_num_seqs=2).run().tokens_of(2).tolist() == [3.5]
    # A second wave, the same requests 100 s later: the counter restarts at 0 when the first wave ends (at its
    # 16th lockstep step), so the second repeats the first exactly. Carried on (16, 17, 18, ...), its first
    # release would come at its third step, not its fourth.
    later = [(t + 100.0, p, o) for t, p, o in CADENCE_ROWS]
    two = group(CADENCE_ROWS + later, max_num_seqs=2, interval=3).run()
    assert two.num_waves == 2
    first = step_rows(result)
    assert step_rows(two) == first + [(rank, start + 100.0, p, d) for rank, start, p, d in first]


def test_the_shared_cadence_throttles_a_schedule_beside_a_step_with_its_own_counter():
    """Asynchronously (vLLM's default), a rank's batch for lockstep step k is scheduled beside step k - 1 with
    the counter k (vLLM's turn k schedules batch k while batch k - 1 runs). Step 1 at 1.5: rank 1, idle
    before, admits R1 and R3 (6 tokens; capacity bound: R5 waits). Step 2 at 3.5, scheduled as of 1.5 with
    counter 2: rank 0 holds R2 and R4; rank 1, capacity bound, is not held, but R3's seat is still taken
    (its last token in flight): R1's decode only, the queue still not drained. Step 3 (the release) at 4.25:
    R2's and R5's prompts."""
    result = group(CADENCE_ROWS, max_num_seqs=2, interval=3, asynchronous=True).run()
    assert step_rows(result)[:7] == [(0, 0.0, 4, 0), (0, 1.5, 0, 1), (1, 1.5, 6, 0), (0, 3.5, 0, 1), (1, 3.5, 0, 1),
                                     (0, 4.25, 2, 1), (1, 4.25, 2, 1)]


def test_a_dense_models_ranks_each_run_their_own_cadence():
    """A dense model's DP ranks are independent engines (vLLM reconfigures each to data_parallel_size 1:
    ParallelConfig.reconfigure_for_independent_dp_rank), so each runs the local cadence of one engine: a
    rank alone with R0 and R2 holds R2 as one engine does, whatever the other rank does; and stepped one
    step at a time (no promises while the cadence is on)."""
    rows = [(0.0, 4, 6), (0.2, 4, 6), (0.3, 2, 2)]
    g = group(rows, lockstep=False, interval=3)
    assert all(r.engine.policy.throttle_prefills is None and not r.engine.policy.promises.fast_forward for r in g.ranks)
    result = g.run()
    assert result.rank_of.tolist() == [0, 1, 0]
    # rank 0: R0's prompt at 0.0 (executed step 1, 1.5 s), its decodes at 1.5 and 2.25 (steps 2 and 3, held);
    # step 4 at 3.0 may carry prefill (4 - 1 >= 3): R0's decode and R2's prompt (1.25 s), then both decode.
    assert result.tokens_of(2).tolist() == [4.25, 5.25]


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
       st.integers(2, 3), st.booleans(), st.integers(6, 40), st.booleans(), st.sampled_from([None, 5, 8]),
       st.sampled_from([1, 1, 2, 3]))
def test_properties(rows, dp, lockstep, num_blocks, asynchronous, window, interval):
    rows = sorted(rows)
    g = group(rows, dp=dp, num_blocks=num_blocks, lockstep=lockstep, asynchronous=asynchronous, window=window,
              interval=interval)
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


def test_the_lockstep_marks_a_schedule_beside_a_step_in_flight():
    # A sliding window's cache does not count a step in flight's tokens as computed (allocate_slots'
    # num_in_flight_tokens): the DP lockstep says when it schedules beside one, as Engine does.
    rows = [(0.0, 20, 6), (0.0, 20, 6), (0.5, 12, 4)]
    for asynchronous in (False, True):
        g = group(rows, asynchronous=asynchronous, window=5)
        marks = []
        for rank in g.ranks:
            schedule = rank.engine.policy.schedule

            def recording(state, now, schedule=schedule, bm=rank.engine.block_manager):
                marks.append(bm.pipelined)
                return schedule(state, now)
            rank.engine.policy.schedule = recording
        result = g.run()
        assert all(r.status is Status.FINISHED for r in result.requests)
        assert any(marks) == asynchronous and not any(rank.engine.block_manager.pipelined for rank in g.ranks)


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
    # the same form, and each request's rank (as the summary counts them)
    assert list(requests.columns) == [*pd.read_csv(one / "requests.csv").columns, "dp_rank"]
    assert requests["dp_rank"].value_counts().sort_index().tolist() == [r["requests"] for r in dp["ranks"]]
    assert (requests["status"] == "finished").all()
    steps = pd.read_parquet(out / "steps.parquet")
    assert set(np.unique(steps["dp_rank"])) == {0, 1}


class LockstepBackend(TokenBackend):
    """A rank's own work 0.5 + 0.25 s per token; the MoE layers of a lockstep step 0.25 s per gathered
    token plus 0.125 s of dispatch and 0.125 s of combine (the interface of MoERooflineCostModel's
    `dp_moe_parts` and `execute_in_lockstep`)."""

    def dp_moe_parts(self, tokens):
        return {"moe": 0.25 * sum(tokens), "dispatch": 0.125, "combine": 0.125}

    def execute_in_lockstep(self, batch, moe_parts):
        own = self.execute(batch)
        return StepResult(own.seconds + sum(moe_parts.values()), {**own.breakdown, **moe_parts})


def test_a_closed_loop_dp_row_exact_to_the_step():
    """`sim validate`'s DP rows: C = 2 clients send R0 (4-token prompt, 2 tokens) and R1 (6, 1) at 0,
    then R2 (2, 1) when R0 ends; the API server takes 0.25 s a request, one at a time. CUDA graphs up
    to 4 tokens, so a step whose ranks all run at most 4 tokens pads them to the largest.

    - R0 through the API server at 0.25: both ranks score 0 -> rank 0. R1 at 0.5: scan from rank 1,
      score 0 (rank 0: max(1 in flight, 1 waiting published at 0.3) = 1) -> rank 1.
    - step 1 at 0.25: rank 0 R0's prompt (4 tokens), rank 1 dummy (1): padded to 4 + 4 = 8 gathered:
      MoE 2.0 + 0.25 s; rank 0 0.5 + 1.0 + 2.25 = 3.75 s, rank 1 0.75 + 2.25 = 3.0 s -> ends 4.0.
    - step 2 at 4.0: rank 0 R0's decode (1), rank 1 R1's prompt (6 > 4: no padding): 7 gathered, MoE
      1.75 + 0.25; rank 0 0.75 + 2.0 = 2.75 s, rank 1 2.0 + 2.0 = 4.0 s -> ends 8.0: R0 and R1 end,
      and R0's client sends R2 at 8.0, through the API server at 8.25.
    - step 3 at 8.0: both ranks dummy, (1 + 1) x 0.25 + 0.25 = 0.75 s MoE: 1.5 s -> ends 9.5. R2 goes
      to rank 0 (both score 0; the scan starts at rank 0 again).
    - step 4 at 9.5: rank 0 R2's prompt (2), rank 1 dummy: padded to 2 + 2: MoE 1.25 s; rank 0
      1.0 + 1.25 = 2.25 s -> ends 11.75, R2's first and last token.
    Client TTFTs: R0 4.0 - 0 = 4.0, R1 8.0 - 0 = 8.0, R2 11.75 - 8.0 = 3.75."""
    requests = sorted(make_requests(make_trace([(0.0, 4, 2), (0.0, 6, 1), (0.0, 2, 1)])), key=lambda r: r.index)
    token_times = TokenTimes(requests)
    clients = ClosedLoopClients(requests, 2, lambda r: 0.25)
    g = DataParallelGroup(requests, token_times, 2, True, cuda_graph_sizes=(1, 2, 4), clients=clients)
    backend = LockstepBackend()
    for _ in range(2):
        policy = load_policy("chunked")(SchedulerConfig("chunked", max_num_batched_tokens=8, max_num_seqs=4,
                                                        async_scheduling=False))
        g.add_rank(Engine(policy, backend, BlockManager(64, 4), token_times, 10_000, fast_forward=False))
    result = g.run()
    assert clients.sent_s == {0: 0.0, 1: 0.0, 2: 8.0}
    assert [r.arrival_s for r in requests] == [0.25, 0.5, 8.25]
    assert result.rank_of.tolist() == [0, 1, 0]
    assert [result.tokens_of(i).tolist() for i in range(3)] == [[4.0, 8.0], [8.0], [11.75]]
    assert [r.first_token_s - clients.sent_s[r.index] for r in requests] == [4.0, 8.0, 3.75]
    s = result.steps
    rows = list(zip(s.dp_rank.tolist(), s.start_s.tolist(), s.seconds.tolist(), s.num_prefill_tokens.tolist(),
                    s.num_decode_tokens.tolist(), s.moe.tolist(), s.dp_wait.tolist()))
    assert rows == [(0, 0.25, 3.75, 4, 0, 2.0, 0.0), (0, 4.0, 4.0, 0, 1, 1.75, 1.25), (1, 4.0, 4.0, 6, 0, 1.75, 0.0),
                    (0, 9.5, 2.25, 2, 0, 1.0, 0.0)]
    assert result.end_s == 11.75 and result.num_lockstep_steps == 16 and result.num_waves == 1  # 4 + 12 dummies
    assert [(r["requests"], r["steps"], r["dummy_steps"]) for r in result.per_rank] == [(2, 3, 13), (1, 1, 15)]


def test_closed_loop_clients_through_one_api_server_per_rank():
    """vLLM >= 0.15 starts one API server per DP rank: the first wave's sends are handled two at a
    time, each taken by the server free first; their arrivals stay in order for the balancer."""
    requests = sorted(make_requests(make_trace([(0.0, 4, 1)] * 3 + [(0.0, 40, 1)])), key=lambda r: r.index)
    one, two = (ClosedLoopClients(requests, 4, lambda r: 0.01 * r.num_prompt_tokens, n) for n in (1, 2))
    one.start()
    assert [r.arrival_s for r in one.pending] == pytest.approx([0.04, 0.08, 0.12, 0.52])
    two.start()  # 0.04 and 0.04 at once, then 0.08 and (the 40-token prompt) 0.44
    assert [r.arrival_s for r in two.pending] == pytest.approx([0.04, 0.04, 0.08, 0.44])
    assert [r.index for r in two.pending] == [0, 1, 2, 3] and two.sent_s == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    late = sorted(make_requests(make_trace([(0.0, 40, 1), (0.0, 4, 1)])), key=lambda r: r.index)
    clients = ClosedLoopClients(late, 2, lambda r: 0.01 * r.num_prompt_tokens, 2)
    clients.start()  # the short prompt, sent second, is through first
    assert [(r.index, r.arrival_s) for r in clients.pending] == [(1, pytest.approx(0.04)), (0, pytest.approx(0.4))]


def test_dp_padding_and_cuda_graph_sizes():
    # vllm/v1/worker/dp_utils.py: every rank under a CUDA graph -> all padded to the largest rank's tokens.
    sizes = (1, 2, 4, 8, 16, 24, 32, 40, 48, 512)
    assert dp_padded_tokens([4, 1], sizes) == [4, 4]
    assert dp_padded_tokens([600, 1], sizes) == [600, 1]  # rank 0 runs eagerly: no padding
    assert dp_padded_tokens([3, 1], ()) == [3, 1]
    # Found by a review against vLLM: each rank rounds up to its graph size first, then all pad to the largest.
    assert dp_padded_tokens([37, 20], sizes) == [40, 40]
    assert dp_padded_tokens([600, 3], sizes) == [600, 4]  # a graph's rank keeps its rounded count
    # vllm/config/vllm.py _set_cudagraph_sizes: min(2 x max_num_seqs, 512; 1024 on data-centre Blackwell).
    from sim.config import cuda_graph_sizes

    def cuda_graph_max_tokens(*args):  # the largest size the DP lockstep pads to
        return cuda_graph_sizes(*args)[-1]

    assert cuda_graph_max_tokens(8, "H200") == 16
    assert cuda_graph_max_tokens(1024, "H200") == 512 and cuda_graph_max_tokens(1024, "B200") == 1024
    # Blackwell's 1024 came with vLLM 0.28 (vllm-project/vllm#49390): an older server captured up to 512.
    assert cuda_graph_max_tokens(1024, "B200", "0.27.0") == 512 and cuda_graph_max_tokens(1024, "B200", "0.28.0") == 1024
    assert cuda_graph_max_tokens(1024, "B300", "0.19.0") == 512 and cuda_graph_max_tokens(1024, "B200", "nightly") == 1024


def test_closed_loop_clients_are_a_lockstep_groups():
    requests = make_requests(make_trace([(0.0, 4, 1)]))
    with pytest.raises(ValueError, match="lockstep"):
        DataParallelGroup(requests, TokenTimes(requests), 2, False, clients=ClosedLoopClients(requests, 1))


@pytest.fixture(scope="module")
def package():
    pytest.importorskip("aiconfigurator_core")
    from backends.costmodel.optables.systems import require_package

    return require_package()


def test_ep_dispatch_and_combine_of_a_dp_replay_worked_by_hand(package, tmp_path):
    """`sim replay --dp 2 --enable-expert-parallel` (Qwen3-30B-A3B, hidden 2048, top-8 of 128 experts, 48
    MoE layers; TP 1, so the all-to-all's group is the DP group of 2 GPUs). The first lockstep step:
    rank 0 runs R0's 300-token prompt, rank 1 a dummy batch (1 token); both under CUDA graphs (<= 512
    tokens), so each rounds up to its graph size (300 -> 304, 1 -> 1) and both are padded to the larger,
    304: 608 tokens gathered on each GPU. Dispatch all-gathers 608 x (2048 x 2 + 8 x (4 + 4)) = 608 x
    4,160 = 2,529,280 bytes; combine reduce-scatters 608 x 2048 x 2 = 2,490,368 bytes; each once per MoE
    layer, from the NCCL tables."""
    from backends.costmodel.optables.interp import Curve
    from backends.costmodel.optables.moe import moe_table_model
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,300,3\n0.001,100,2\n")
    out = tmp_path / "dp"
    assert main(["replay", str(trace), "--model", "Qwen3-30B-A3B", "--hardware", "H200", "--dp", "2",
                 "--enable-expert-parallel", "--out", str(out), "--quiet"]) == 0
    model = moe_table_model(resolve_model("Qwen3-30B-A3B"), resolve_hardware("H200"), "h200_sxm", package / "data",
                            enable_expert_parallel=True, dp=2)
    assert (model.moe_tp, model.ep, model.moe_group) == (1, 2, 2)
    gather, scatter = model._gather, model._scatter
    dispatch = 48 * float(gather.many(np.array([2_529_280.0]))[0][0])
    combine = 48 * float(scatter.many(np.array([2_490_368.0]))[0][0])
    assert model.dp_moe_parts([304, 304]) == {"moe": model.dp_moe_parts([304, 304])["moe"], "dispatch": dispatch,
                                              "combine": combine}
    steps = pd.read_parquet(out / "steps.parquet")
    first = steps.iloc[0]
    assert (first["dp_rank"], first["num_prefill_tokens"]) == (0, 300)
    assert (first["dispatch_s"], first["combine_s"]) == (dispatch, combine)
    assert first["moe_s"] == 48 * float(Curve(*model_moe_curve(model)).many(np.array([608.0]))[0][0])
    operators = json.loads((out / "summary.json").read_text())["options"]["cost_model"]["operators"]
    assert operators["dispatch"].startswith("NCCL all_gather table among 2 GPUs (the DP group)")
    assert operators["combine"].startswith("NCCL reduce_scatter table among 2 GPUs")


def model_moe_curve(model):
    return model._moe.xs, model._moe.ys


def test_sequence_parallel_moe_gathers_over_tp_x_dp(package):
    """EP with TP 2 and DP 2 (ParallelConfig.use_sequence_parallel_moe): each GPU sends ceil(t / 2) of
    its rank's tokens over the EP group of 4 GPUs: ranks of 5 and 1 tokens gather 3 + 3 + 1 + 1 = 8."""
    from backends.costmodel.optables.moe import moe_table_model
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    model = moe_table_model(resolve_model("Qwen3-30B-A3B"), resolve_hardware("H200"), "h200_sxm", package / "data",
                            tp=2, enable_expert_parallel=True, dp=2)
    assert (model.moe_tp, model.ep, model.moe_group, model.sequence_parallel_moe) == (1, 4, 4, True)
    parts = model.dp_moe_parts([5, 1])
    assert parts["dispatch"] == 48 * float(model._gather.many(np.array([8 * 4160.0]))[0][0])
    assert parts["combine"] == 48 * float(model._scatter.many(np.array([8 * 4096.0]))[0][0])
    assert "among 4 GPUs (the EP group" in model.sources["dispatch"]


def test_a_rank_that_can_never_schedule_fails_instead_of_stepping_for_ever():
    # A 40-token prompt and gpt-oss's layout (window 8, blocks of 4): its blocks held at once under a
    # budget of 8 (11 full + 5 sliding = 16) fit 18 blocks, so it is not rejected, but prefill-first
    # computes its prompt whole, 10 + 10 blocks at once: it can never be admitted. A lone engine says
    # so (Engine._wait_for_policy); the lockstep group ran dummy batches for ever (found 2026-12-07).
    g = group([(0.0, 40, 2)], num_blocks=18, seed_policy="prefill-first", window=8)
    with pytest.raises(ServesimError, match="DP rank 0 scheduled nothing .* with 1 waiting"):
        g.run()
    chunked = group([(0.0, 40, 2)], num_blocks=18, seed_policy="chunked", window=8).run()
    assert chunked.requests[0].status is Status.FINISHED
