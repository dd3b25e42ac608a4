"""Fast-forward never changes an answer: replays with it and with plain step-by-step simulation
give the same per-request results and the same step tables.

Times are bitwise equal, and asserted so: a run's steps are costed by the same numpy expressions,
row by row, as single steps, and the clock adds them in the same order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.costmodel.fitted import FEATURES, CalibratedCostModel, Calibration
from backends.costmodel.roofline import RooflineCostModel
from backends.hardware import HARDWARE
from backends.model_config import ModelConfig
from policies import POLICIES
from policies.base import Promises
from sim.app.plan import resolve
from sim.app.replay import ReplayOptions, replay
from sim.config import CacheConfig, SchedulerConfig
from sim.fast_forward import Run
from tests.helpers import make_trace

# Seconds per unit of each calibrated term: all of them at work, at plausible magnitudes.
CALIBRATION = Calibration(tuple(1e-3 / (10.0 ** (3 + i)) for i in range(len(FEATURES))), ridge_flops_per_byte=50.0)


def compare(trace, options, hardware="H100-SXM", calibrated=False):
    def backend():
        if calibrated:
            return CalibratedCostModel(ModelConfig.from_preset(options.model), CALIBRATION)
        return RooflineCostModel(ModelConfig.from_preset(options.model), HARDWARE[hardware])

    results = [replay(trace, resolve(options, backend=backend()), fast_forward=ff) for ff in (True, False)]
    fast, slow = results
    assert np.array_equal(fast.token_times, slow.token_times, equal_nan=True)
    for a, b in zip(fast.requests, slow.requests):
        assert (a.status, a.num_output_tokens, a.num_preemptions, a.num_prefix_hit_tokens, a.block_table) == \
               (b.status, b.num_output_tokens, b.num_preemptions, b.num_prefix_hit_tokens, b.block_table)
        assert (a.first_scheduled_s, a.first_token_s, a.finish_s) == (b.first_scheduled_s, b.first_token_s, b.finish_s)
    fc, sc = fast.steps.columns(), slow.steps.columns()
    assert fc.keys() == sc.keys()
    for key in fc:
        assert np.array_equal(fc[key], sc[key], equal_nan=True), key
    assert fast.num_preemptions == slow.num_preemptions
    assert fast.end_s == slow.end_s
    return fast, slow


@pytest.mark.slow  # 200 random workloads, each replayed twice (the bundled sample stays in the fast subset)
@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.floats(0, 2), st.integers(1, 300), st.integers(1, 80),
                            st.sampled_from([[], [0], [0, 1], [2, 3]])), min_size=1, max_size=14),
    policy=st.sampled_from(sorted(POLICIES)),
    block_size=st.sampled_from([1, 4, 16]),
    num_blocks=st.integers(8, 200),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(8, 512),
    caching=st.booleans(),
    calibrated=st.booleans(),
    v1_options=st.fixed_dictionaries({
        "reserve_full_isl": st.booleans(),
        "long_prefill_token_threshold": st.sampled_from([0, 0, 7, 64]),
        "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
        "watermark": st.sampled_from([0.0, 0.0, 0.2]),
        "long_prefill_token_threshold_adaptive": st.booleans(),
        "prefill_schedule_interval": st.sampled_from([1, 1, 3]),
    }),
    active_seqs_cut=st.sampled_from([0, 0, 1, 3]),  # --max-num-active-seqs: max_num_seqs less this (0: unset)
)
def test_fast_forward_gives_the_same_answers(rows, policy, block_size, num_blocks, max_num_seqs, budget, caching,
                                             calibrated, v1_options, active_seqs_cut):
    trace = make_trace([(a, p, o) for a, p, o, _ in rows],
                       hash_ids=[np.resize(np.array(h + [50 + i]), -(-p // 16)) for i, (_, p, _, h) in enumerate(rows)],
                       hash_block_tokens=16)
    trace.priority = np.arange(len(rows), dtype=np.int64) % 3
    if policy != "chunked":  # the prefill cadence and the long-prefill cap are chunked's (vLLM's scheduler)
        v1_options = {**v1_options, "prefill_schedule_interval": 1, "long_prefill_token_threshold": 0,
                      "long_prefill_token_threshold_adaptive": False}
    if not v1_options["long_prefill_token_threshold"]:  # the adaptive floor raises a cap: refused without one
        v1_options = {**v1_options, "long_prefill_token_threshold_adaptive": False}
    options = ReplayOptions(
        scheduler=SchedulerConfig(policy, max_num_batched_tokens=max(budget, max_num_seqs), max_num_seqs=max_num_seqs,
                                  max_num_active_seqs=max(max_num_seqs - active_seqs_cut, 1) if active_seqs_cut else 0,
                                  **v1_options),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
        model="Qwen3-0.6B")
    compare(trace, options, calibrated=calibrated)


@pytest.mark.slow
def test_fast_forward_on_the_bundled_sample_is_bitwise_identical():
    from traces import AZURE_CONV_SAMPLE, read_trace
    from traces.trace import Trace

    full = read_trace(AZURE_CONV_SAMPLE)
    n = 300
    trace = Trace(full.arrival_s[:n], full.prompt_tokens[:n], full.output_tokens[:n], source="sample")
    for policy in POLICIES:
        options = ReplayOptions(scheduler=SchedulerConfig(policy), cache=CacheConfig(num_blocks=3000))
        fast, slow = compare(trace, options)
        assert np.array_equal(fast.token_times, slow.token_times)
        assert len(fast.steps) == len(slow.steps) > 1000


def test_a_run_folds_the_step_that_admitted_a_request_and_answers_stay_the_same(monkeypatch):
    """With the policy's second promise (`decodes_all_when_none_waits`) a run begins with the mixed
    step that admitted a request; without it that step is a single step and the run begins after
    it. Every answer is the same in all three ways, and step by step."""
    from policies.chunked import ChunkedPolicy
    from sim.fast_forward import FastForward
    from traces import AZURE_CONV_SAMPLE, read_trace
    from traces.trace import Trace

    full = read_trace(AZURE_CONV_SAMPLE)
    n = 200
    trace = Trace(full.arrival_s[:n], full.prompt_tokens[:n], full.output_tokens[:n], source="sample")
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=2048),
                            cache=CacheConfig(num_blocks=1500))
    folded = []
    plan = FastForward.plan

    def counting_plan(self, batch, now, first=None):
        run = plan(self, batch, now, first)
        if run is not None:
            assert len(run) == len(Run._fields) and run.chunks is None  # (made field by field: sim/fast_forward.py)
        if run is not None and first is not None:
            folded.append(len(run.ends))
        return run

    monkeypatch.setattr(FastForward, "plan", counting_plan)
    fast, slow = compare(trace, options)
    assert len(folded) > 50 and min(folded) >= 2

    monkeypatch.setattr(ChunkedPolicy, "promises", Promises(fast_forward=True, repeats_full_chunk_steps=True))
    folded.clear()
    unfolded = replay(trace, resolve(options, backend=RooflineCostModel(ModelConfig.from_preset(options.model),
                                                                HARDWARE["H100-SXM"])))
    assert not folded
    for a, b in ((fast, unfolded), (fast, slow)):
        assert np.array_equal(a.token_times, b.token_times, equal_nan=True)
        fa, fb = a.steps.columns(), b.steps.columns()
        assert fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


@pytest.mark.parametrize("num_tokens", [1, 2, 31, 32, 33, 500])
def test_a_finished_requests_token_times_are_stored_exactly(num_tokens):
    """TokenTimes.store packs long lists of times through `struct`: the same doubles, bit for bit,
    as numpy's own conversion (the short ones take numpy's)."""
    from sim.engine import TokenTimes
    from sim.request import Request

    rng = np.random.default_rng(num_tokens)
    requests = [Request(i, str(i), 0.0, 10, num_tokens) for i in range(3)]
    store = TokenTimes(requests)
    values = [(rng.random(num_tokens) * 10.0 ** rng.integers(-3, 5, num_tokens)).tolist() for _ in requests]
    values[1][0] = 5e-324  # the smallest subnormal double
    for r, times in zip(requests, values):
        r.token_times = list(times)
        store.store(r)
    for r, times in zip(requests, values):
        assert store.of(r).tobytes() == np.array(times, dtype=np.float64).tobytes()


def _same_replays(a, b):
    """Two replays' answers are bitwise the same: token times, requests (block tables too), steps."""
    assert np.array_equal(a.token_times, b.token_times, equal_nan=True)
    for x, y in zip(a.requests, b.requests):
        assert (x.status, x.num_output_tokens, x.num_preemptions, x.num_prefix_hit_tokens, x.first_scheduled_s,
                x.first_token_s, x.finish_s, x.block_table) == \
               (y.status, y.num_output_tokens, y.num_preemptions, y.num_prefix_hit_tokens, y.first_scheduled_s,
                y.first_token_s, y.finish_s, y.block_table)
    fa, fb = a.steps.columns(), b.steps.columns()
    assert fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k], equal_nan=True) for k in fa)
    assert (a.end_s, a.num_preemptions, a.num_prefix_hit_tokens) == (b.end_s, b.num_preemptions, b.num_prefix_hit_tokens)


def _count_chunk_runs(monkeypatch, folded: list | None = None, through: list | None = None):
    """The lengths of the chunk runs taken; `folded` gets, for each, whether its step 0 did more
    than decode all but the last request (it ended a prompt and began the next one's prefill, say),
    and `through` whether a decode finished before its last step (the others went on)."""
    from sim.fast_forward import FastForward

    lengths = []
    plan_chunks = FastForward.plan_chunks

    def counting(self, batch, now, first, budget):
        run = plan_chunks(self, batch, now, first, budget)
        if run is not None:
            assert len(run) == len(Run._fields) and run.chunks is not None  # (made field by field: sim/fast_forward.py)
            lengths.append(len(run.ends))
            if folded is not None:
                folded.append(batch.num_leading_decodes < len(batch) - 1)
                through.append(min(run.active_steps, default=len(run.ends)) < len(run.ends))
        return run

    monkeypatch.setattr(FastForward, "plan_chunks", counting)
    return lengths


@pytest.mark.slow
def test_chunk_runs_carry_long_prefills_beside_the_decodes_with_the_same_answers(monkeypatch):
    """The Mooncake sample (prompts of thousands of tokens, prefix caching, a queue all along)
    under chunked with the operator tables: most steps carry a prefill chunk forward beside the
    decodes, and runs of them are taken in one go (the policy's third promise) with exactly the
    answers of stepping one by one. Without the promise, or with a chunk cap below the budget
    (which arrivals can switch on and off), there are no chunk runs and the answers are the same."""
    from policies.chunked import ChunkedPolicy
    from traces import MOONCAKE_SAMPLE, read_trace

    trace = read_trace(MOONCAKE_SAMPLE)
    # Chunk runs are taken under synchronous scheduling (sim/engine.py: asynchronously they are stepped).
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=2048, async_scheduling=False),
                            cache=CacheConfig(num_blocks=6000))
    folded, through = [], []
    lengths = _count_chunk_runs(monkeypatch, folded, through)
    fast = replay(trace, resolve(options))
    runs = list(lengths)
    slow = replay(trace, resolve(options), fast_forward=False)
    assert len(lengths) == len(runs), "no chunk runs step by step"
    assert len(runs) > 100 and min(runs) >= 2 and sum(runs) > len(fast.steps) / 2
    # Both kinds: from a step of decodes and a chunk, and from one that ends a prompt and begins the next.
    assert 10 < sum(folded) < len(folded)
    assert 10 < sum(through) < len(through)  # and runs that go on past decodes' finishes
    assert fast.num_prefix_hit_tokens > 0 and max(fast.steps.num_waiting) > 10
    _same_replays(fast, slow)

    lengths.clear()
    monkeypatch.setattr(ChunkedPolicy, "promises", Promises(fast_forward=True, decodes_all_when_none_waits=True))
    _same_replays(replay(trace, resolve(options)), slow)
    assert not lengths
    monkeypatch.undo()

    lengths = _count_chunk_runs(monkeypatch)
    capped = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=2048, async_scheduling=False,
                                                     long_prefill_token_threshold=1024),
                           cache=CacheConfig(num_blocks=6000))
    _same_replays(replay(trace, resolve(capped)), replay(trace, resolve(capped), fast_forward=False))
    assert not lengths
    assert ChunkedPolicy(SchedulerConfig("chunked", 2048, long_prefill_token_threshold=4096)).chunk_run_budget() == 2048


def test_chunk_runs_stop_where_blocks_run_short_and_preemptions_begin(monkeypatch):
    """A cache too small for the sample's queue: chunk runs end before a step whose blocks do not
    fit, which is then scheduled normally (and preempts); the answers are those of step by step."""
    from traces import MOONCAKE_SAMPLE, read_trace
    from traces.trace import Trace

    full = read_trace(MOONCAKE_SAMPLE)
    n = 80
    trace = Trace(full.arrival_s[:n], full.prompt_tokens[:n], full.output_tokens[:n], source="sample",
                  hash_ids=full.hash_ids[:n], hash_block_tokens=full.hash_block_tokens)
    # Admitted on their first chunk's blocks (not reserving the whole prompt's), so prefills run out.
    # Chunk runs are taken under synchronous scheduling (sim/engine.py: asynchronously they are stepped).
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=1024, reserve_full_isl=False,
                                                      async_scheduling=False),
                            cache=CacheConfig(num_blocks=2600))
    lengths = _count_chunk_runs(monkeypatch)
    fast = replay(trace, resolve(options))
    assert len(lengths) > 20 and fast.num_preemptions > 0
    _same_replays(fast, replay(trace, resolve(options), fast_forward=False))


@settings(max_examples=150, deadline=None)
@given(num_decodes=st.integers(0, 300), first_context=st.integers(1, 40_000), spread=st.integers(0, 5_000),
       chunk=st.integers(2, 8192), before=st.integers(0, 200_000), num_steps=st.integers(1, 6),
       tp=st.sampled_from([1, 2]))
def test_a_chunk_runs_steps_cost_what_execute_gives_each(num_decodes, first_context, spread, chunk, before,
                                                          num_steps, tp):
    """Both cost models' chunk_steps give, step by step, bitwise the seconds and parts that
    `execute` gives the same batch built by hand (decodes one token each, then the chunk)."""
    from sim.batch import Batch

    computed = [first_context + (i * 7919) % (spread + 1) for i in range(num_decodes)]
    for profile in (None, "roofline"):
        backend = resolve(ReplayOptions(tp=tp, profile=profile), None).backend
        seconds, parts = backend.chunk_steps(computed, chunk, before, num_steps)
        assert len(seconds) == num_steps and all(len(v) == num_steps for v in parts.values())
        for j in range(num_steps):
            batch = Batch()
            for i, c in enumerate(computed):
                batch.add(str(i), c + j, 1, [], True, is_decode=True)
            batch.add("p", before + chunk * j, chunk, [], False)
            result = backend.execute(batch)
            assert seconds[j] == result.seconds
            assert {k: v[j] for k, v in parts.items()} == result.breakdown


def _same_result_bitwise(a, b):
    assert np.array_equal(a.token_times, b.token_times, equal_nan=True)
    for x, y in zip(a.requests, b.requests):
        assert (x.status, x.first_scheduled_s, x.first_token_s, x.finish_s, x.num_preemptions, x.block_table) == \
               (y.status, y.first_scheduled_s, y.first_token_s, y.finish_s, y.num_preemptions, y.block_table)
    ac, bc = a.steps.columns(), b.steps.columns()
    assert ac.keys() == bc.keys()
    for key in ac:
        assert np.array_equal(ac[key], bc[key], equal_nan=True), key
    assert a.end_s == b.end_s


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.floats(0, 2), st.integers(1, 300), st.integers(1, 80)), min_size=1, max_size=14),
    policy=st.sampled_from(sorted(POLICIES)),
    num_blocks=st.integers(8, 200),
    budget=st.integers(8, 512),
    fast_forward=st.booleans(),
)
def test_a_lone_engines_own_clock_gives_what_simpys_clock_gives_step_by_step(rows, policy, num_blocks, budget,
                                                                            fast_forward):
    """A lone engine keeps its own clock through a busy period (Engine.run, `busy_engine_alone`);
    with SimPy's clock moved at every step or run instead, every answer is the same, bit for bit."""
    from sim.arrivals import TraceArrivals

    trace = make_trace(rows)
    options = ReplayOptions(scheduler=SchedulerConfig(policy, max_num_batched_tokens=budget, max_num_seqs=6),
                            cache=CacheConfig(block_size=4, num_blocks=num_blocks), model="Qwen3-0.6B")
    own = replay(trace, resolve(options), fast_forward=fast_forward)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TraceArrivals, "busy_engine_alone", False)
        stepped = replay(trace, resolve(options), fast_forward=fast_forward)
    _same_result_bitwise(own, stepped)


def test_a_closed_loops_engine_keeps_its_own_clock_with_the_same_bench(monkeypatch):
    from sim.app.bench import BenchSpec, run_bench
    from sim.arrivals import ClosedLoop

    spec = BenchSpec(concurrency=6, input_len=300, output_len=90, num_prompts=60, request_rate=40.0)
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=512),
                            cache=CacheConfig(block_size=16, num_blocks=400), model="Qwen3-0.6B")
    own, _ = run_bench(spec, resolve(options))
    monkeypatch.setattr(ClosedLoop, "busy_engine_alone", False)
    stepped, _ = run_bench(spec, resolve(options))
    _same_result_bitwise(own, stepped)
