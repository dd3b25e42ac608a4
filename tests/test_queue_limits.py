"""vLLM's front-end admission limits (--max-num-queued-reqs, --max-num-queued-tokens; sim/admission.py):
worked examples by hand, the decisions checked against the finished run's own times (every arrival
counted as AsyncLLM.check_admission counts it) for a lone engine, a cluster's replicas and a DP group,
the command line end to end, and the refusals."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.costmodel.roofline import RooflineCostModel
from backends.hardware import HARDWARE
from backends.model_config import ModelConfig
from policies import load_policy
from sim.admission import QueueLimits
from sim.app.cluster_options import ClusterOptions
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.app.replay import make_requests, replay
from sim.block_manager import BlockManager
from sim.config import CacheConfig, SchedulerConfig
from sim.data_parallel import DataParallelGroup
from sim.engine import Engine, TokenTimes
from sim.errors import ServesimError
from sim.request import Request, Status
from tests.helpers import ConstantBackend, TokenBackend, make_trace, one_error_line, sim
from traces import AZURE_CONV_SAMPLE

MODEL = "Qwen3-0.6B"
HTTP_503 = "HTTP 503"


def options(reqs=None, tokens=None, asynchronous=False, num_blocks=64, cluster=None, dp=1, budget=8) -> ReplayOptions:
    return ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=budget, max_num_seqs=4,
                                                   async_scheduling=asynchronous, host_time=False,
                                                   max_num_queued_reqs=reqs, max_num_queued_tokens=tokens),
                         cache=CacheConfig(block_size=4, num_blocks=num_blocks), model=MODEL,
                         cluster=cluster or ClusterOptions(), dp=dp)


# A burst: R0 and R1 at 0 (4-token prompts, 2 tokens each), R2 at 0, R3 at 1.5, R4 at 2.0 and R5 at
# 2.5 (4-token prompts, 1 token each). Every step takes 1 s, synchronously, budget 8: the step at 0
# prefills R0 and R1 (their first tokens at 1.0), the step at 1 decodes them (both finish at 2.0).
BURST = [(0.0, 4, 2), (0.0, 4, 2), (0.0, 4, 1), (1.5, 4, 1), (2.0, 4, 1), (2.5, 4, 1)]


def outcome(result) -> dict[str, str]:
    """request id -> 'finished at T' or the limit that rejected it."""
    out = {}
    for r in result.requests:
        if r.status is Status.FINISHED:
            out[r.request_id] = f"finished at {r.finish_s:g}"
        else:
            out[r.request_id] = r.reject_reason.split(")")[0].removeprefix("HTTP 503 (")
    return out


def run_burst(**limits):
    return replay(make_trace(BURST), resolve(options(**limits), backend=ConstantBackend(1.0)))


def test_max_num_queued_reqs_worked_by_hand():
    # Limit 2. R0, R1 admitted; R2 finds 2 unfinished: 503. R3 (1.5): R0 and R1 finish at 2.0, still 2: 503.
    # R4 (2.0): their finishes at the very instant of its arrival are seen after it: 2, 503.
    # R5 (2.5): none unfinished: admitted, prefilled alone 2.5-3.5.
    result = run_burst(reqs=2)
    assert outcome(result) == {"0": "finished at 2", "1": "finished at 2", "2": "max_num_queued_reqs",
                               "3": "max_num_queued_reqs", "4": "max_num_queued_reqs", "5": "finished at 3.5"}
    assert result.requests[2].reject_reason == ("HTTP 503 (max_num_queued_reqs): 2 requests unfinished, "
                                                "the limit is 2")


def test_max_num_queued_tokens_worked_by_hand():
    # Limit 8 prompt tokens. R0 (0 before it), R1 (4) admitted; R2 finds 8 >= 8: 503. R3 (1.5): R0 and
    # R1 had their first tokens at 1.0: 0, admitted. R4 (2.0): R3 (4 tokens, no token yet): admitted.
    # The engine takes R3 and R4 at 2.0 (it was busy 1-2) and prefills both 2-3. R5 (2.5): R3 + R4 = 8: 503.
    result = run_burst(tokens=8)
    assert outcome(result) == {"0": "finished at 2", "1": "finished at 2", "2": "max_num_queued_tokens",
                               "3": "finished at 3", "4": "finished at 3", "5": "max_num_queued_tokens"}
    assert result.requests[5].reject_reason == ("HTTP 503 (max_num_queued_tokens): 8 prompt tokens in prefill, "
                                                "the limit is 8")


def test_both_limits_worked_by_hand():
    # 3 requests, 8 tokens. R2: 2 unfinished + 1 <= 3, but 8 tokens: 503 (tokens). R3 (1.5): 2 + 1 <= 3,
    # 0 tokens: admitted, prefilled alone 2-3. R4 (2.0): R0, R1 (finishing at 2.0) and R3: 3 + 1 > 3: 503
    # (the requests' limit is checked first, as vLLM does). R5 (2.5): R3 only (4 tokens): admitted, 3-4.
    result = run_burst(reqs=3, tokens=8)
    assert outcome(result) == {"0": "finished at 2", "1": "finished at 2", "2": "max_num_queued_tokens",
                               "3": "finished at 3", "4": "max_num_queued_reqs", "5": "finished at 4"}


def test_zero_rejects_every_request_as_vllms_zero_does():
    for limits in ({"reqs": 0}, {"tokens": 0}):
        result = run_burst(**limits)
        assert all(r.status is Status.REJECTED and r.reject_reason.startswith(HTTP_503) for r in result.requests)


def test_a_request_too_long_is_rejected_for_that_and_not_counted():
    # Under the limit, R1 passes vLLM's check_admission and is then rejected as too long (400: its prompt is
    # rendered after the check), never counted, and R2 still fits.
    rows = [(0.0, 4, 2), (0.0, 100, 2), (0.0, 4, 1)]
    result = replay(make_trace(rows), resolve(options(reqs=2, num_blocks=8), backend=ConstantBackend(1.0)))
    reasons = [r.reject_reason for r in result.requests]
    assert reasons[0] is None and reasons[2] is None and "KV blocks" in reasons[1]


@pytest.mark.parametrize("dp", [1, 2])
def test_a_request_too_long_over_the_limit_is_answered_503(dp):
    """vLLM's API server checks admission (OpenAIServing._preflight, calling check_admission) before it
    renders the prompt, where a prompt too long is found (a 400): with the queue full, a request too long
    is answered 503 like any other, and not counted either way."""
    rows = [(0.0, 4, 2), (0.0, 100, 2), (0.0, 4, 1)]
    result = replay(make_trace(rows), resolve(options(reqs=1, num_blocks=8, dp=dp), backend=ConstantBackend(1.0)))
    reasons = [r.reject_reason for r in result.requests]
    assert reasons[0] is None
    assert reasons[1] == reasons[2] == ("HTTP 503 (max_num_queued_reqs): 1 requests unfinished, the limit is 1")


# The decisions against the run's own times.

def expected_rejections(requests: list[Request], reqs: int | None, tokens: int | None, group_of) -> list[bool]:
    """Which requests check_admission rejects, from the times the run gave every request: at each
    arrival (in arrival order, ties in trace order), the requests of its API server admitted before it
    that finish at or after it (unfinished), and the prompt tokens of those whose first token comes at
    or after it (in prefill). Requests rejected for their length are not counted. Also checks that the
    unfinished count never passes the limit."""
    admitted: dict[int, list[Request]] = {}
    rejected = []
    for r in requests:
        if r.reject_reason is not None and not r.reject_reason.startswith(HTTP_503):
            rejected.append(False)
            continue
        mine = admitted.setdefault(group_of(r), [])
        at = r.arrival_s
        unfinished = sum(1 for q in mine if q.finish_s >= at)
        queued = sum(q.num_prompt_tokens for q in mine if q.first_token_s >= at)
        if reqs is not None:
            assert unfinished <= reqs
        no = (reqs is not None and unfinished + 1 > reqs) or (tokens is not None and queued >= tokens)
        rejected.append(no)
        if not no:
            mine.append(r)
    return rejected


ROWS = st.lists(st.tuples(st.floats(0, 0.3), st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=30)
LIMIT = st.one_of(st.none(), st.integers(0, 8))
TOKEN_LIMIT = st.one_of(st.none(), st.integers(0, 900))


def check_run(result, reqs, tokens, group_of) -> None:
    for r in result.requests:  # none lost: each finished, or rejected with a reason
        assert r.status in (Status.FINISHED, Status.REJECTED)
        assert (r.status is Status.REJECTED) == (r.reject_reason is not None)
    got = [r.reject_reason is not None and r.reject_reason.startswith(HTTP_503) for r in result.requests]
    assert got == expected_rejections(result.requests, reqs, tokens, group_of)
    if reqs is None and tokens is None:
        assert not any(got)


@pytest.fixture(scope="module")
def costmodel():
    return RooflineCostModel(ModelConfig.from_preset(MODEL), HARDWARE["H100-SXM"])


@settings(max_examples=60, deadline=None)
@given(rows=ROWS, reqs=LIMIT, tokens=TOKEN_LIMIT, asynchronous=st.booleans(), fast_forward=st.booleans())
def test_a_lone_engine_rejects_exactly_as_counted(costmodel, rows, reqs, tokens, asynchronous, fast_forward):
    opts = options(reqs, tokens, asynchronous, num_blocks=400, budget=256)
    result = replay(make_trace(rows), resolve(opts, backend=costmodel), fast_forward=fast_forward)
    check_run(result, reqs, tokens, lambda r: 0)


@settings(max_examples=40, deadline=None)
@given(rows=ROWS, reqs=LIMIT, tokens=TOKEN_LIMIT, asynchronous=st.booleans(),
       router=st.sampled_from(["round-robin", "least-requests"]))
def test_each_replica_counts_its_own_requests(costmodel, rows, reqs, tokens, asynchronous, router):
    opts = options(reqs, tokens, asynchronous, num_blocks=400, budget=256,
                   cluster=ClusterOptions(num_replicas=2, router=router))
    result = replay(make_trace(rows), resolve(opts, backend=costmodel))
    replica = {r.index: int(result.replica_of[i]) for i, r in enumerate(result.requests)}
    check_run(result, reqs, tokens, lambda r: replica[r.index])


@settings(max_examples=40, deadline=None)
@given(rows=ROWS, reqs=LIMIT, asynchronous=st.booleans())
def test_a_dp_group_counts_every_rank(costmodel, rows, reqs, asynchronous):
    # A dense model's ranks, each its own engine (with fast-forward), behind vLLM's DP load balancer.
    opts = options(reqs, None, asynchronous, num_blocks=400, budget=256, dp=2)
    result = replay(make_trace(rows), resolve(opts, backend=costmodel))
    check_run(result, reqs, None, lambda r: 0)
    for i, r in enumerate(result.requests):  # a request answered 503 reached no rank
        assert (result.rank_of[i] == -1) == (r.reject_reason is not None and r.reject_reason.startswith(HTTP_503))


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(st.floats(0, 5), st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=25),
       reqs=LIMIT, asynchronous=st.booleans())
def test_a_lockstep_dp_group_counts_every_rank(rows, reqs, asynchronous):
    rows = sorted(rows)
    requests = sorted(make_requests(make_trace(rows)), key=lambda r: (r.arrival_s, r.index))
    token_times = TokenTimes(requests)
    group = DataParallelGroup(requests, token_times, 2, lockstep=True)
    for _ in range(2):
        config = SchedulerConfig("chunked", max_num_batched_tokens=8, max_num_seqs=4, async_scheduling=asynchronous,
                                 max_num_queued_reqs=reqs)
        group.add_rank(Engine(load_policy("chunked")(config), TokenBackend(), BlockManager(40, 4), token_times,
                              10_000, fast_forward=False))
    assert group.ranks[0].engine.queue_limits is group.ranks[1].engine.queue_limits is group.queue_limits
    check_run(group.run(), reqs, None, lambda r: 0)


def test_queue_limits_prune_what_has_had_its_first_token():
    limits = QueueLimits(None, 10)
    made = [Request(i, str(i), float(i), 4, 2) for i in range(200)]
    for r in made:
        assert limits.check(r) is None
        limits.count(r)
        r.first_token_s = r.arrival_s + 0.5  # each has its first token before the next arrives
    assert len(limits._prefilling) < 140  # pruned as it grows, not kept for the whole trace
    assert limits.num_queued_tokens(1000.0) == 0


# The command line.

def test_cli_replay_writes_the_rejections(tmp_path, capsys):
    trace = tmp_path / "burst.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n"
                     + "".join(f"{a},{p},{o}\n" for a, p, o in BURST))
    out = tmp_path / "run"
    assert sim("replay", str(trace), "--model", MODEL, "--max-num-queued-reqs", "2", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "rejected" in printed and "HTTP 503 (max_num_queued_reqs)" in printed
    table = pd.read_csv(out / "requests.csv")
    summary = json.loads((out / "summary.json").read_text())
    rejected = table[table.status == "rejected"]
    assert len(rejected) == summary["rejected"] >= 1
    assert summary["completed"] + summary["rejected"] == len(BURST)
    assert all(reason.startswith("HTTP 503 (max_num_queued_reqs)") for reason in rejected.reject_reason)
    # (the request's figure reads N; the run's own limit, the same for every rejection, is kept)
    assert summary["reject_reasons"] == {"HTTP 503 (max_num_queued_reqs): N requests unfinished, the limit is 2":
                                         summary["rejected"]}
    assert summary["options"]["scheduler"]["max_num_queued_reqs"] == 2
    assert "max_num_queued_tokens" not in summary["options"]["scheduler"]  # (left out when unset)


def test_cli_bench_counts_rejections_as_failed_requests(tmp_path, capsys):
    out = tmp_path / "bench"
    assert sim("bench", "--model", MODEL, "--input-len", "64", "--output-len", "32", "--num-prompts", "40",
               "--concurrency", "40", "--max-num-queued-reqs", "8", "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rejected"] >= 1 and summary["completed"] + summary["rejected"] == 40
    assert "Failed requests:" in capsys.readouterr().out


def test_a_closed_loop_sees_the_finish_that_sent_its_next_request():
    """vLLM's client sends its next request when it has a request's last output, which the API server's
    OutputProcessor handed it after counting the request finished: a send at that instant finds it
    finished (and the first tokens of the same step seen). With --max-num-queued-reqs C at --concurrency
    C nothing is ever over the limit, the test request's finish included (the benchmark's first wave is
    sent at it). Without vLLM's API server (no time between the send and the arrival) every later send
    came at its cause's instant and found it unfinished: 37 of 40 rejected."""
    from sim.app.bench import BenchSpec, run_bench

    for asynchronous in (False, True):
        opts = dataclasses.replace(options(reqs=4, asynchronous=asynchronous, num_blocks=400, budget=256),
                                   api_server="off")
        for num_warmups in (0, 4):
            result, loop = run_bench(BenchSpec(4, 64, 8, 40, num_warmups=num_warmups, test_request=True),
                                     resolve(opts, backend=ConstantBackend(0.01)))
            assert [r.reject_reason for r in result.requests + loop.warmup_requests] == [None] * (41 + num_warmups)
            assert loop.max_in_flight == 4


@pytest.mark.parametrize("args, message", [
    (["--max-num-queued-reqs", "-1"], "--max-num-queued-reqs must be a whole number from 0"),
    (["--max-num-queued-tokens", "-5"], "--max-num-queued-tokens must be a whole number from 0"),
    (["--max-num-queued-tokens", "100", "--dp", "2"], "with --dp 2: vLLM starts one API server per rank"),
    (["--max-num-queued-reqs", "4", "--prefill-replicas", "1", "--decode-replicas", "1"],
     "a disaggregated cluster's requests pass"),
])
def test_refusals(tmp_path, capsys, args, message):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,4,2\n")
    assert sim("replay", str(trace), "--model", MODEL, "--out", str(tmp_path / "run"), *args) == 2
    assert message in one_error_line(capsys)


def test_capacity_refuses_them(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,4,2\n")
    assert sim("capacity", str(trace), "--model", MODEL, "--slo", "tbt=0.1", "--max-num-queued-reqs", "4",
               "--out", str(tmp_path / "cap")) == 2
    assert "does not apply to sim capacity" in one_error_line(capsys)


def test_options_refuse_the_combinations_in_python_too():
    with pytest.raises(ServesimError, match="--dp 2"):
        options(tokens=10, dp=2)
    assert options(reqs=10, dp=2).scheduler.max_num_queued_reqs == 10


def test_a_run_that_rejected_every_request_prints_no_throughput(tmp_path, capsys):
    # Nothing completed: summary.json's throughputs are null, and the terminal says "-", not 0.
    assert sim("replay", AZURE_CONV_SAMPLE, "--limit", 5, "--max-num-queued-reqs", 0, "--out", tmp_path / "r") == 0
    out = capsys.readouterr().out
    assert "requests 0 completed, 5 rejected" in out and "throughput - req/s, - output tok/s, - tok/s" in out
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["request_throughput"] is None
