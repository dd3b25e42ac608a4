"""Hand-computed timelines of the places where `chunked` follows vLLM V1's scheduler and KV cache
(vllm/v1/core/sched/scheduler.py, vllm/v1/core/block_pool.py, version 0.33), every step 1 s."""

from __future__ import annotations

import numpy as np
import pytest

from sim.app.plan import resolve
from sim.app.replay import ReplayOptions, replay
from sim.config import CacheConfig, SchedulerConfig
from tests.helpers import ConstantBackend, make_trace


def run(rows, num_blocks, budget, max_num_seqs=4, block_size=16, caching=True, hash_ids=None,
        hash_block_tokens=16, priority=None, **scheduler):
    options = ReplayOptions(
        scheduler=SchedulerConfig("chunked", max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  **({"async_scheduling": False, "host_time": False} | scheduler)),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching))
    trace = make_trace(rows, hash_ids, hash_block_tokens)
    if priority is not None:
        trace.priority = np.asarray(priority, dtype=np.int64)
    result = replay(trace, resolve(options, backend=ConstantBackend(1.0)))
    steps = list(zip(result.steps.num_prefill_tokens.tolist(), result.steps.num_decode_tokens.tolist(),
                     result.steps.num_preemptions.tolist()))
    return result, steps


def test_a_step_that_preempted_another_request_admits_no_one():
    # Issue 16's reproduction. Block size 16, 3 blocks, budget 16. R0 (prompt 7, output 11) and R1
    # (prompt 10, output 13) arrive at 0. Step 0: R0's prompt and 9 tokens of R1's (one block each).
    # Step 1: R0 decodes, R1's last prompt token. R1 computes position 16 at step 8 and takes the
    # last free block; R0 computes position 16 at step 10 and finds none: it preempts R1, the most
    # recently admitted. vLLM admits no waiting request in that step, so R1 does not come straight
    # back in (servesim used to re-admit it with a 15-token chunk).
    # R0 finishes at t=11. Step 11: R1 (19 tokens known) takes back its first block, which it filled
    # before the preemption and which stayed cached, and recomputes 3 tokens (whole-sequence
    # admission: 2 blocks, 1 of them its cached one, of 3 free).
    result, steps = run([(0.0, 7, 11), (0.0, 10, 13)], num_blocks=3, budget=16)
    assert steps == [(16, 0, 0), (1, 1, 0)] + [(0, 2, 0)] * 8 + [(0, 1, 1), (3, 0, 0)] + [(0, 1, 0)] * 3
    assert [(r.first_token_s, r.finish_s) for r in result.requests] == [(1.0, 11.0), (2.0, 15.0)]
    assert [r.num_prefix_hit_tokens for r in result.requests] == [0, 16]
    # The re-admission's hit is counted apart, as vLLM's PrefixCacheStats counts preempted requests.
    assert (result.num_prefix_queried_tokens, result.num_prefix_hit_tokens) == (17, 0)


def test_generated_blocks_are_cached_so_eviction_takes_another_prefix():
    # Block size 4, 6 blocks, budget 16. D (prompt 8, hash ids [1, 2], output 1) and A (prompt 4,
    # hash id [9], output 6) are prefilled at t=0 on blocks 0, 1 (D) and 2 (A). D finishes at
    # t=1: its blocks join the free queue's tail (1 then 0). A decodes positions 4..8 on blocks 3
    # and 4 and finishes at t=6; its full blocks 2 and 3 (3 holds generated tokens) join the
    # tail after D's; block 4 (partly filled) goes to the head. B (12 tokens, its own) takes
    # blocks 4, 5 and evicts the queue's first hashed block: D's block 1. E, sharing D's 8-token
    # prefix, then hits D's block 0 only and computes 8 tokens. (Caching prompt blocks only, A's
    # block 3 would have been free without a hash and taken first: E would have hit 8 tokens.)
    rows = [(0.0, 8, 1), (0.0, 4, 6), (6.0, 12, 1), (6.5, 12, 1)]
    hashes = [[1, 2], [9], [20, 21, 22], [1, 2, 7]]
    result, steps = run(rows, num_blocks=6, budget=16, hash_ids=hashes, hash_block_tokens=4, block_size=4)
    assert steps == [(12, 0, 0)] + [(0, 1, 0)] * 5 + [(12, 0, 0), (8, 0, 0)]
    assert [r.finish_s for r in result.requests] == [1.0, 6.0, 7.0, 8.0]
    assert [r.num_prefix_hit_tokens for r in result.requests] == [0, 0, 0, 4]
    assert (result.num_prefix_queried_tokens, result.num_prefix_hit_tokens) == (36, 4)


def test_priority_preempts_the_lowest_priority_request_even_one_already_scheduled():
    # Block size 4, 4 blocks, budget 16. A (prompt 1, output 8, priority 1) runs from t=0; B
    # (prompt 4, output 8, priority 0) arrives at t=1 and is admitted behind it. B opens its second
    # block at step 2, A at step 4: no block is free. At step 6 A is scheduled first (position 6
    # fits its block), then B computes position 8 and needs a block: vLLM preempts the running
    # request with the largest priority value, A, takes it back out of the step, and B gets
    # A's partly filled block. A (7 tokens known) waits: its cached first block plus one more
    # would need 2 free blocks while B holds 3 of 4. B finishes at t=9; A takes back its first
    # block and recomputes 3 tokens.
    rows = [(0.0, 1, 8), (1.0, 4, 8)]
    result, steps = run(rows, num_blocks=4, budget=16, block_size=4, priority=[1, 0], scheduling_policy="priority")
    assert steps == [(1, 0, 0), (4, 1, 0)] + [(0, 2, 0)] * 4 + [(0, 1, 1), (0, 1, 0), (0, 1, 0), (3, 0, 0),
                                                                 (0, 1, 0)]
    assert [(r.first_token_s, r.finish_s, r.num_preemptions) for r in result.requests] == [(1.0, 11.0, 1),
                                                                                           (2.0, 9.0, 0)]
    # First come, first served: B, the last admitted, preempts itself instead.
    _, fcfs = run(rows, num_blocks=4, budget=16, block_size=4, priority=[1, 0])
    assert fcfs[6] == (0, 1, 1) and fcfs[:6] == steps[:6] and fcfs != steps


@pytest.mark.timeout(60)  # it used to run for ever
def test_priority_breaks_a_tie_of_arrival_by_trace_order_so_tied_requests_cannot_livelock():
    # Block size 1, 17 blocks, budget 2, threshold 1: R0 and R1 (prompt 13, output 3, priority 0)
    # arrive together and both fit only at first. Steps 0-7: one prompt token each, 16 blocks
    # used. Step 8: R0 takes the last block, R1 finds none: vLLM preempts max(running, key=(priority,
    # arrival)), and with the tie its max was the first in running order (R0 here, the request
    # itself; then R1 once it is re-admitted behind R0, and so on): the two preempted each other by
    # turns for ever. Ties go by trace order: R1 is the victim each time (steps 8 and 13), R0 is
    # never preempted and finishes at t=15 (its prompt done at step 12, decodes at 13 and 14); alone,
    # R1 gets the whole budget and finishes at t=23.
    rows = [(0.0, 13, 3), (0.0, 13, 3)]
    result, steps = run(rows, num_blocks=17, budget=2, max_num_seqs=2, block_size=1, caching=False,
                        priority=[0, 0], scheduling_policy="priority", long_prefill_token_threshold=1,
                        reserve_full_isl=False)
    assert steps == [(2, 0, 0)] * 8 + [(1, 0, 1)] + [(2, 0, 0)] * 4 + [(0, 1, 1), (1, 1, 0)] + [(2, 0, 0)] * 6 \
        + [(0, 1, 0)] * 2
    assert [(r.first_token_s, r.finish_s, r.num_preemptions) for r in result.requests] == [(13.0, 15.0, 0),
                                                                                           (21.0, 23.0, 2)]


def test_priority_orders_the_waiting_queue_then_arrival():
    # Budget 8: one 8-token prompt per step. Lower priority first, ties by arrival, then trace order.
    rows = [(0.0, 8, 1), (0.0, 8, 1), (0.0, 8, 1), (0.5, 8, 1)]
    result, _ = run(rows, num_blocks=64, budget=8, priority=[2, 1, 2, 0], scheduling_policy="priority")
    # At t=0 three wait: 1 (priority 1) goes first; then at t=1 request 3 (priority 0) has arrived.
    assert [r.finish_s for r in result.requests] == [3.0, 1.0, 4.0, 2.0]


def test_long_prefill_token_threshold_caps_each_chunk_unless_one_request_is_left():
    # Budget 16, threshold 4. Step 0: R0 and R1 get 4 tokens each. Step 1: R0 4 more, R1 its last
    # 2 (its only token comes out: it finishes). Step 2: R0 is alone, so the cap is lifted: its
    # last 6 prompt tokens. Step 3: R0 decodes.
    rows = [(0.0, 14, 2), (0.0, 6, 1)]
    result, steps = run(rows, num_blocks=64, budget=16, long_prefill_token_threshold=4)
    assert steps == [(8, 0, 0), (6, 0, 0), (6, 0, 0), (0, 1, 0)]
    assert [(r.first_token_s, r.finish_s) for r in result.requests] == [(3.0, 4.0), (2.0, 2.0)]
    _, uncapped = run(rows, num_blocks=64, budget=16)
    assert uncapped == [(16, 0, 0), (4, 1, 0)]  # R1 gets the 2 tokens left, then its last 4


def test_the_adaptive_threshold_floors_the_cap_at_a_fair_share_of_the_budget():
    # The rows above with --long-prefill-token-threshold-adaptive: two requests share the budget of 16, so
    # the cap of 4 is raised to 16 // 2 = 8. Step 0: R0 8 tokens, R1 its whole 6 (it finishes). Step 1: R0,
    # alone, its last 6. Step 2: R0 decodes.
    rows = [(0.0, 14, 2), (0.0, 6, 1)]
    result, steps = run(rows, num_blocks=64, budget=16, long_prefill_token_threshold=4,
                        long_prefill_token_threshold_adaptive=True)
    assert steps == [(14, 0, 0), (6, 0, 0), (0, 1, 0)]
    assert [(r.first_token_s, r.finish_s) for r in result.requests] == [(2.0, 3.0), (1.0, 1.0)]


# vLLM 0.34's cache-aware admission (Scheduler._reorder_waiting_by_cached_prefix).

CACHE_AWARE_ROWS = [(0.0, 64, 30), (0.5, 64, 4), (0.5, 64, 4)]
CACHE_AWARE_HASHES = [[1, 2, 3, 4], [7, 8, 9, 10], [1, 2, 3, 11]]


@pytest.mark.parametrize("window, threshold, a_times, b_times", [
    (0, 0.5, (2.0, 5.0), (6.0, 9.0)),  # off: strictly in arrival order
    (2, 0.0, (6.0, 9.0), (2.0, 5.0)),  # B's three cached blocks put it ahead of A
    (2, 0.5, (2.0, 5.0), (6.0, 9.0)),  # 4 of 100 blocks in use: below the threshold, no reordering
    (1, 0.0, (2.0, 5.0), (6.0, 9.0)),  # a window of one request reorders nothing
])
def test_cache_aware_admission_puts_a_cached_prefix_first(window, threshold, a_times, b_times):
    # Block size 16, 100 blocks, budget 128, two seats. R0 (prompt 64, hash ids [1, 2, 3, 4], output 30)
    # prefills at t=0 and decodes to t=30. A ([7, 8, 9, 10]) and B ([1, 2, 3, 11]) arrive at 0.5, A first,
    # with one seat free. Whoever goes first at t=1 runs to t=5 (B computes 16 tokens, 48 cached; A 64),
    # the other is admitted at t=5 and runs to t=9. B hits R0's three blocks either way.
    result, _ = run(CACHE_AWARE_ROWS, num_blocks=100, budget=128, max_num_seqs=2, hash_ids=CACHE_AWARE_HASHES,
                    cache_aware_admission_window=window, cache_aware_admission_threshold=threshold)
    r0, a, b = result.requests
    assert (r0.first_token_s, r0.finish_s) == (1.0, 30.0)
    assert (a.first_token_s, a.finish_s) == a_times and (b.first_token_s, b.finish_s) == b_times
    assert (a.num_prefix_hit_tokens, b.num_prefix_hit_tokens) == (0, 48)


def test_cache_aware_admission_plans_no_runs_of_steps():
    # The queue's order follows the cache at every step, so the engine steps one by one: the same answers
    # with fast-forward on and off (tests/parity runs it against vLLM 0.34 itself).
    rng = np.random.default_rng(5)
    rows = [(float(t), int(rng.integers(16, 200)), int(rng.integers(1, 40))) for t in np.sort(rng.integers(0, 60, 60))]
    # Three shared documents: each prompt's full blocks are the leading blocks of one of them.
    hashes = [list(range(f * 100, f * 100 + p // 16)) for f, (_, p, _) in zip(rng.integers(0, 3, len(rows)), rows)]
    options = ReplayOptions(
        scheduler=SchedulerConfig("chunked", max_num_batched_tokens=128, max_num_seqs=8, async_scheduling=False,
                                  host_time=False, cache_aware_admission_window=8,
                                  cache_aware_admission_threshold=0.0),
        cache=CacheConfig(block_size=16, num_blocks=60))
    trace = make_trace(rows, hashes, 16)
    plan = resolve(options, backend=ConstantBackend(1.0))
    on, off = (replay(trace, plan, fast_forward=ff) for ff in (True, False))
    assert [(r.first_token_s, r.finish_s) for r in on.requests] == [(r.first_token_s, r.finish_s) for r in off.requests]
    assert on.steps.num_prefill_tokens.tolist() == off.steps.num_prefill_tokens.tolist()


@pytest.mark.parametrize("watermark, r1_times", [(0.0, (2.0, 5.0)), (0.15, (2.0, 5.0)), (0.2, (41.0, 44.0)),
                                                  (0.3, (41.0, 44.0))])
def test_watermark_keeps_blocks_free_while_a_request_runs(watermark, r1_times):
    # Block size 16, 20 blocks (vLLM's pool: 21 with its null block). R0 (prompt 160: 10 blocks, output 40)
    # runs from t=0 and holds 11 blocks from t=1 (13 at its end); R1 (prompt 96: 6 blocks) arrives at 0.5
    # and finds 9 free at t=1. The watermark keeps int(W x 21) blocks free besides R1's 6 while R0 runs:
    # 0.15 keeps 3 (6 + 3 = 9: admitted at t=1); 0.2 keeps 4 and 0.3 keeps 6 (10 and 12 > 9): R1 waits
    # until R0 finishes at t=40, when nothing runs and no watermark applies.
    result, _ = run([(0.0, 160, 40), (0.5, 96, 4)], num_blocks=20, budget=256, watermark=watermark)
    r0, r1 = result.requests
    assert (r0.first_token_s, r0.finish_s) == (1.0, 40.0)
    assert (r1.first_token_s, r1.finish_s) == r1_times


@pytest.mark.parametrize("interval, r1_times", [(1, (3.0, 4.0)), (2, (3.0, 4.0)), (3, (4.0, 5.0)), (4, (5.0, 6.0))])
def test_prefill_cadence_holds_prefill_until_the_interval_has_passed(interval, r1_times):
    # R0 (prompt 8, output 10) is prefilled at t=0 (executed step 1, the last to carry prefill) and decodes
    # from t=1. R1 (prompt 8, output 2) arrives at 1.5. Step k + 1 may carry prefill once k + 1 - 1 >= the
    # interval: at t=2 (step 3) with an interval of 2, t=3 (step 4) with 3, t=4 (step 5) with 4.
    result, _ = run([(0.0, 8, 10), (1.5, 8, 2)], num_blocks=64, budget=64, prefill_schedule_interval=interval)
    r0, r1 = result.requests
    assert (r0.first_token_s, r0.finish_s) == (1.0, 10.0)
    assert (r1.first_token_s, r1.finish_s) == r1_times


def test_prefill_cadence_lifts_once_a_release_step_leaves_requests_waiting():
    # Two seats, interval 3. R1 and R2 arrive at 1.5 while R0 decodes; the release step at t=3 admits R1 only
    # (no seat for R2), so the queue did not drain: the cadence is lifted (vLLM's prefill_capacity_bound) and
    # R2 gets in at t=5, as soon as R1's seat frees, not at the next release (t=7).
    rows = [(0.0, 8, 10), (1.5, 8, 2), (1.5, 8, 2)]
    result, _ = run(rows, num_blocks=64, budget=64, max_num_seqs=2, prefill_schedule_interval=3)
    assert [(r.first_token_s, r.finish_s) for r in result.requests] == [(1.0, 10.0), (4.0, 5.0), (6.0, 7.0)]


@pytest.mark.parametrize("active, times, steps", [
    (0, [(1.0, 3.0), (1.0, 5.0), (1.0, 2.0)], [(30, 0, 0), (0, 3, 0), (0, 2, 0), (0, 1, 0), (0, 1, 0)]),
    (3, [(1.0, 3.0), (1.0, 5.0), (1.0, 2.0)], [(30, 0, 0), (0, 3, 0), (0, 2, 0), (0, 1, 0), (0, 1, 0)]),
    (2, [(1.0, 3.0), (1.0, 5.0), (4.0, 5.0)], [(20, 0, 0), (0, 2, 0), (0, 2, 0), (10, 1, 0), (0, 2, 0)]),
    (1, [(1.0, 3.0), (4.0, 8.0), (9.0, 10.0)], [(10, 0, 0), (0, 1, 0), (0, 1, 0), (10, 0, 0)] + [(0, 1, 0)] * 4
     + [(10, 0, 0), (0, 1, 0)]),
])
def test_max_num_active_seqs_caps_admission_below_max_num_seqs(active, times, steps):
    # Four seats (max_num_seqs), budget 64. R0 (prompt 10, output 3), R1 (10, 5) and R2 (10, 2) arrive at 0.
    # Unset (0) or 3, all three are admitted at t=0. With 2, R2 waits for a seat although max_num_seqs has
    # two more: R0 finishes at t=3 and R2 is admitted beside R1's decode in the step at t=3 (vLLM's WAITING
    # loop: `if num_running >= self.max_num_active_reqs: break`). With 1, one request runs at a time.
    result, got = run([(0.0, 10, 3), (0.0, 10, 5), (0.0, 10, 2)], num_blocks=64, budget=64,
                      max_num_active_seqs=active)
    assert [(r.first_token_s, r.finish_s) for r in result.requests] == times
    assert got == steps
