"""The vLLM side of async-scheduling parity: tests/parity/vllm_driver.py's `run_vllm_async` drives vLLM's own
`AsyncScheduler` as `EngineCore.step_with_batch_queue` does (docs/async-scheduling.md). Worked by hand.

Skipped where vLLM is not installed (the `parity` extra).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is first imported
pytest.importorskip("vllm.v1.core.sched.async_scheduler", reason="vLLM is not installed (pip install '.[parity]')")

from tests.parity.vllm_driver import EngineSetup, TraceRequest, run_vllm, run_vllm_async


def step_time(scheduled: list[int], contexts: list[int]) -> float:
    return float(10 * len(scheduled) + sum(scheduled))


REQUESTS = [TraceRequest(0.0, tuple(range(1, 31)), (1, 2, 3)), TraceRequest(25.0, tuple(range(50, 55)), (4, 5))]
SETUP = EngineSetup(max_num_batched_tokens=32, max_num_seqs=4)


def test_synchronous_reference():
    """The same trace through the synchronous Scheduler: request 1 (arrived at 25, during step 1) joins step 2."""
    t = run_vllm(REQUESTS, SETUP, step_time)
    assert t.steps == [(30, 0, 0), (5, 1, 0), (0, 2, 0)]
    assert (t.first_token_s, t.finish_s) == ([40.0, 66.0], [88.0, 88.0])


def test_async_schedules_one_step_ahead():
    """Step 1 (request 0's prompt, 0-40 on the GPU) and step 2 (its first decode, on a placeholder) are both
    scheduled at 0. Request 1 arrives at 25 but is first seen when the CPU, done waiting for step 1 at 40,
    schedules step 3, which runs after step 2 (51-77). Step 4 (51) leaves request 0 out: its last token is in
    flight. At 77 the scheduler finds nothing to schedule (request 1's last token in flight): an empty batch."""
    t = run_vllm_async(REQUESTS, replace(SETUP, async_scheduling=True), step_time)
    assert t.steps == [(30, 0, 0), (0, 1, 0), (5, 1, 0), (0, 1, 0)]
    assert t.step_times == [(0.0, 0.0, 40.0), (0.0, 40.0, 51.0), (40.0, 51.0, 77.0), (51.0, 77.0, 88.0)]
    assert t.first_scheduled_s == [0.0, 40.0]
    assert t.first_token_s == [40.0, 77.0]
    assert t.finish_s == [77.0, 88.0]


def test_async_host_time_before_launch():
    """4 s of CPU before each launch: the first step starts at 4; later steps are launched while the GPU is
    busy, so they start when the previous one ends, and each token is seen when its step ends."""
    t = run_vllm_async(REQUESTS, replace(SETUP, async_scheduling=True), step_time, host_time=lambda s, c: 4.0)
    assert t.step_times == [(4.0, 4.0, 44.0), (8.0, 44.0, 55.0), (48.0, 55.0, 81.0), (59.0, 81.0, 92.0)]
    assert t.first_scheduled_s == [0.0, 44.0]
    assert (t.first_token_s, t.finish_s) == ([44.0, 81.0], [81.0, 92.0])


def test_async_output_time_after_the_gpu():
    """2 s of CPU to process each step's output once the GPU is done: tokens are seen 2 s after their step
    ends, and the CPU, busy with that, sees request 1 (arrived at 25) at 42 and schedules step 3 then."""
    t = run_vllm_async(REQUESTS, replace(SETUP, async_scheduling=True), step_time, output_time=lambda s, c: 2.0)
    assert t.step_times == [(0.0, 0.0, 40.0), (0.0, 40.0, 51.0), (42.0, 51.0, 77.0), (53.0, 77.0, 88.0)]
    assert t.first_scheduled_s == [0.0, 42.0]
    assert (t.first_token_s, t.finish_s) == ([42.0, 79.0], [79.0, 90.0])


def test_async_matches_sync_without_arrivals_or_host_time():
    """A chunked prompt alone, no host time: the GPU never waits, so every step and time is the synchronous one."""
    requests = [TraceRequest(0.0, tuple(range(1, 41)), (7, 8, 9, 10, 11))]
    setup = EngineSetup(max_num_batched_tokens=16, max_num_seqs=4)
    sync = run_vllm(requests, setup, step_time)
    asynchronous = run_vllm_async(requests, replace(setup, async_scheduling=True), step_time)
    assert asynchronous.steps == sync.steps == [(16, 0, 0), (16, 0, 0), (8, 0, 0)] + [(0, 1, 0)] * 4
    assert (asynchronous.first_token_s, asynchronous.finish_s) == (sync.first_token_s, sync.finish_s)
    assert [end for _, _, end in asynchronous.step_times] == [26.0, 52.0, 70.0, 81.0, 92.0, 103.0, 114.0]


@pytest.mark.slow
def test_async_driver_invariants_on_a_bursty_trace():
    """A tight cache (preemptions) and bursts of arrivals: every request finishes, scheduled before its first
    token, its first token no later than its finish; the GPU runs one step at a time, each launched before
    it starts; every token the trace asks for is computed (preempted work recomputed on top)."""
    from tests.parity.cases import all_cases, async_variant
    from tests.parity.servesim_driver import vllm_requests

    case = async_variant(next(c for c in all_cases() if c.name == "bursty-tight-1"))
    requests = vllm_requests(case.trace, case.setup, case.priority)
    t = run_vllm_async(requests, case.setup, step_time)
    assert all(f is not None for f in t.finish_s)
    for r, scheduled, first, finish in zip(requests, t.first_scheduled_s, t.first_token_s, t.finish_s):
        assert r.arrival_s <= scheduled < first <= finish
    assert sum(p for _, _, p in t.steps) > 0, "the tight cache preempts"
    for (launched, start, end), (_, previous_start, previous_end) in zip(t.step_times[1:], t.step_times):
        assert launched <= start and start >= previous_end and end > start
    computed = sum(p + d for p, d, _ in t.steps)
    assert computed >= sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in requests)
