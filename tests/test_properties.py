"""Invariants that must hold for any small trace and configuration, under every policy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from policies import POLICIES
from policies.checked import batch_violation
from sim.app.replay import make_requests
from sim.arrivals import TraceArrivals
from sim.arrivals import simulate as run_engine
from sim.block_manager import BlockManager
from sim.config import SchedulerConfig
from sim.engine import Engine, TokenTimes
from sim.request import Status
from tests.helpers import ConstantBackend, make_trace

# Far more steps than any generated trace needs (at most 10 requests of 62 tokens, one token a
# step at the least, each recomputed after a preemption): past it the requests are not finishing
# (two requests preempting each other by turns did once), and the example fails instead of
# running for ever.
MAX_STEPS = 20_000


class CheckedPolicy:
    """Wraps a policy and checks every step it schedules."""

    def __init__(self, inner, config: SchedulerConfig):
        self.inner, self.config, self.name = inner, config, inner.name
        self.num_steps = 0

    def schedule(self, state, now):
        bm = state.block_manager
        bm.check_invariants(state.running + state.finishing)  # blocks are conserved after every step
        decoding_before = [r for r in state.running if r.is_decoding]
        running_before = list(state.running)
        num_queued_before = len(state.running) + len(state.waiting)
        num_eligible_before = state.num_seats + len(state.waiting)  # vLLM's running list holds the finishing too
        preemptions_before = {id(r): r.num_preemptions for r in running_before}
        num_preemptions = state.num_preemptions
        batch = self.inner.schedule(state, now)
        # The engine's rules, checked by the same checker that guards a user's policy in a run.
        problem = batch_violation(batch, state, self.config, state.num_preemptions > num_preemptions)
        assert problem is None, f"{self.name} at step {state.step_index}: {problem}"
        bm.check_invariants(state.running + state.finishing)
        self.num_steps += 1
        assert self.num_steps <= MAX_STEPS, f"{MAX_STEPS} steps and still running: requests are not finishing"

        # Tokens never exceed the budget, except one whole prompt admitted alone.
        assert batch.num_tokens <= self.config.max_num_batched_tokens or (
            self.name != "chunked" and len(batch) == 1 and batch.num_decode_tokens == 0)
        assert len(state.running) <= self.config.max_num_seqs
        # No admission past the admission limit (--max-num-active-seqs, else max_num_seqs), finishing seats counted.
        assert state.num_seats <= self.config.max_num_active_reqs
        for r, n, c in zip(batch.requests, batch.num_scheduled_tokens, batch.num_computed_tokens):
            assert n >= 1
            # Nothing is scheduled past the prompt and the tokens generated so far.
            assert c + n <= r.num_tokens <= r.num_prompt_tokens + r.max_tokens - 1
            assert len(r.block_table) * bm.block_size >= c + n
        # A step that preempted admits no waiting request, not even the one it preempted (vLLM V1
        # admits only `if not preempted_reqs`; so do all three policies).
        admitted = [r for r in batch.requests if preemptions_before.get(id(r)) != r.num_preemptions]
        if state.num_preemptions != num_preemptions:
            assert not admitted, f"step {state.step_index} preempted and admitted {[r.request_id for r in admitted]}"
        if self.config.scheduling_policy == "priority" and admitted:
            # Admissions take the queue's head each time: nobody left waiting comes before them.
            def key(r):
                return (r.priority, r.arrival_s, r.index)
            assert all(key(w) > max(map(key, admitted)) for w in state.waiting)
        kinds = set(batch.is_decode)
        if not batch.requests:  # asynchronously scheduled with every seat held by finishing requests, or (a
            # prefill the cadence holds) beside the step in flight while only finishing requests are past their prefill,
            # or (the cadence holding the prefills) the only decodes preempted for want of blocks
            assert (state.finishing and (not state.running or state.block_manager.pipelined)) or (
                state.num_preemptions > num_preemptions and self.config.prefill_schedule_interval > 1)
            return batch
        if self.name == "prefill-first":
            assert len(kinds) == 1  # never mixes prefill and decode
        if self.name == "decode-first":
            assert len(kinds) == 1
            if not batch.is_decode[0]:
                assert not running_before  # prompts only once the batch has drained
        threshold = self.config.long_prefill_token_threshold
        if self.name == "chunked" and not threshold:
            scheduled = set(map(id, batch.requests))
            for r in decoding_before:  # every running decode is in the step, unless preempted
                assert id(r) in scheduled or r.status is Status.WAITING
        if self.name == "chunked" and threshold and num_queued_before > 1:
            # (With the cap, prefills ahead in the running order may take the budget from a decode,
            # as in vLLM.) No request computes more than the cap in a step (adaptive: at least a fair share of
            # the budget).
            if self.config.long_prefill_token_threshold_adaptive:
                threshold = max(threshold, self.config.max_num_batched_tokens // num_eligible_before)
            assert max(batch.num_scheduled_tokens) <= threshold
        return batch


traces = st.lists(
    st.tuples(st.integers(0, 20), st.integers(1, 50), st.integers(1, 12),
              st.sampled_from([[], [0], [0, 1], [0, 1, 2, 3], [7, 8], [7, 8, 9]])),
    min_size=1, max_size=10,
)
configs = st.fixed_dictionaries({
    "policy": st.sampled_from(sorted(POLICIES)),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "num_blocks": st.integers(4, 30),
    "max_num_seqs": st.integers(1, 6),
    "extra_budget": st.integers(0, 40),
    "prefix_caching": st.booleans(),
    "reserve_full_isl": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 1, 3, 8]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "watermark": st.sampled_from([0.0, 0.0, 0.1, 0.4]),
    "active_seqs_cut": st.sampled_from([0, 0, 1, 2, 5]),  # --max-num-active-seqs: max_num_seqs less this (0: unset)
    "long_prefill_token_threshold_adaptive": st.booleans(),
    "prefill_schedule_interval": st.sampled_from([1, 1, 2, 4]),
})


def simulate(rows, cfg, check=True):
    # Arrivals in tenths of a second; shared hash ids give shared prefixes (4-token hash blocks).
    trace = make_trace([(a / 10, p, o) for a, p, o, _ in rows], hash_ids=[h for *_, h in rows],
                       hash_block_tokens=4)
    trace.hash_ids = [np.resize(np.asarray(h + [100 + i], dtype=np.int64), -(-p // 4))
                      for i, (h, (_, p, _, _)) in enumerate(zip([r[3] for r in rows], rows))]
    trace.priority = np.array([(7 * i + a) % 3 for i, (a, *_) in enumerate(rows)], dtype=np.int64)
    sched = SchedulerConfig(cfg["policy"], cfg["max_num_seqs"] + cfg["extra_budget"], cfg["max_num_seqs"],
                            reserve_full_isl=cfg.get("reserve_full_isl", True),
                            long_prefill_token_threshold=cfg.get("long_prefill_token_threshold", 0),
                            scheduling_policy=cfg.get("scheduling_policy", "fcfs"),
                            watermark=cfg.get("watermark", 0.0),
                            long_prefill_token_threshold_adaptive=cfg.get("long_prefill_token_threshold_adaptive",
                                                                          False),
                            prefill_schedule_interval=cfg.get("prefill_schedule_interval", 1),
                            max_num_active_seqs=active_seqs(cfg["max_num_seqs"], cfg.get("active_seqs_cut", 0)))
    policy = POLICIES[sched.policy](sched)
    if check:
        policy = CheckedPolicy(policy, sched)
    bm = BlockManager(cfg["num_blocks"], cfg["block_size"], cfg["prefix_caching"])
    requests = sorted(make_requests(trace), key=lambda r: (r.arrival_s, r.index))
    engine = Engine(policy, ConstantBackend(0.25), bm, TokenTimes(requests), max_model_len=10_000)
    return run_engine(engine, TraceArrivals(requests, engine)), bm


@pytest.mark.slow  # 300 random workloads, the block manager checked at every step
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces, configs)
# Found: with the prefill cadence, a step scheduled beside one in flight holds the last request's prefill
# while the only request past its prefill is finishing: an empty schedule, as vLLM's, while one runs.
@example(rows=[(0, 1, 1, []), (0, 2, 1, [])],
         cfg={"policy": "chunked", "block_size": 1, "num_blocks": 4, "max_num_seqs": 2, "extra_budget": 0,
              "prefix_caching": False, "reserve_full_isl": False, "long_prefill_token_threshold": 0,
              "scheduling_policy": "fcfs", "watermark": 0.0, "long_prefill_token_threshold_adaptive": False,
              "prefill_schedule_interval": 2, "active_seqs_cut": 0})
# Found: the cadence holds a running request's prefill chunk while the only decode is preempted for want of a block:
# an empty schedule that preempted (vLLM runs it empty and schedules again at once; servesim stopped the run).
@example(rows=[(0, 1, 1, []), (0, 22, 1, [0]), (1, 22, 2, [0])],
         cfg={"policy": "chunked", "block_size": 2, "num_blocks": 21, "max_num_seqs": 2, "extra_budget": 0,
              "prefix_caching": True, "reserve_full_isl": False, "long_prefill_token_threshold": 1,
              "scheduling_policy": "fcfs", "watermark": 0.0, "long_prefill_token_threshold_adaptive": False,
              "prefill_schedule_interval": 2, "active_seqs_cut": 0})
def test_invariants(rows, cfg):
    result, bm = simulate(rows, cfg)
    event(f"preemptions: {result.num_preemptions > 0}")
    event(f"prefix hits: {result.num_prefix_hit_tokens > 0}")
    event(f"prefix hits under preemption: {result.num_prefix_hit_tokens > 0 and result.num_preemptions > 0}")
    for i, r in enumerate(result.requests):
        if bm.blocks_for(r.max_kv_tokens) > bm.num_blocks:
            assert r.status is Status.REJECTED and "KV blocks" in r.reject_reason
            continue
        # Every admitted request finishes with exactly its output tokens, preempted or not.
        assert r.status is Status.FINISHED
        assert r.num_output_tokens == r.max_tokens
        times = result.tokens_of(i)
        assert not np.isnan(times).any() and (np.diff(times) > 0).all()
        assert r.arrival_s <= r.first_scheduled_s < r.first_token_s == times[0] and r.finish_s == times[-1]
        assert not r.block_table
    assert bm.num_free_blocks == bm.num_blocks  # everything freed at the end
    assert sum(result.steps.num_preemptions) == result.num_preemptions


shared_prefix_traces = st.lists(
    st.tuples(st.integers(0, 10), st.integers(8, 40), st.integers(1, 12),
              st.sampled_from([[0, 1, 2, 3], [0, 1, 2, 9], [0, 1, 5], [7, 8, 9]])),
    min_size=3, max_size=10,
)
tight_configs = st.fixed_dictionaries({
    "policy": st.sampled_from(sorted(POLICIES)),
    "block_size": st.sampled_from([2, 4]),
    "num_blocks": st.integers(6, 16),
    "max_num_seqs": st.integers(2, 6),
    "extra_budget": st.integers(0, 24),
    "prefix_caching": st.just(True),
    "reserve_full_isl": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 2, 5]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "active_seqs_cut": st.sampled_from([0, 0, 1, 3]),
})


def active_seqs(max_num_seqs: int, cut: int) -> int:
    """A drawn --max-num-active-seqs: `cut` below max_num_seqs, at least 1; 0 (unset) for a cut of 0."""
    return max(max_num_seqs - cut, 1) if cut else 0


@pytest.mark.slow  # 150 random workloads, checked at every step
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prefix_traces, tight_configs)
def test_invariants_with_shared_prefixes_under_tight_memory(rows, cfg):
    # Long shared prefixes, few blocks: hits, evictions of cached blocks and preemptions together,
    # with the block manager's invariants checked at every step.
    test_invariants.hypothesis.inner_test(rows, cfg)


@settings(max_examples=60, deadline=None)
@given(traces, configs)
def test_same_seed_same_result(rows, cfg):
    a, _ = simulate(rows, cfg, check=False)
    b, _ = simulate(rows, cfg, check=False)
    assert np.array_equal(a.token_times, b.token_times, equal_nan=True)
    ca, cb = a.steps.columns(), b.steps.columns()
    assert ca.keys() == cb.keys() and all(np.array_equal(ca[k], cb[k]) for k in ca)


def test_preemption_happens_and_loses_nothing():
    # Three long requests and a cache too small for all of them to grow: preemption must kick in.
    rows = [(0, 30, 12, []), (0, 30, 12, []), (0, 30, 12, [])]
    for policy in POLICIES:
        cfg = {"policy": policy, "block_size": 4, "num_blocks": 20, "max_num_seqs": 3, "extra_budget": 100,
               "prefix_caching": False}
        result, _ = simulate(rows, cfg)
        assert result.num_preemptions > 0, policy
        assert all(r.num_output_tokens == 12 for r in result.requests)
