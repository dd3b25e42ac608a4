"""The KV cache under asynchronous scheduling where vLLM's AsyncScheduler differs from its synchronous
Scheduler (docs/async-scheduling.md), worked by hand:

- a request finishing in the step in flight is still in vLLM's running list, in its place, so it
  can be the preemption victim: its blocks are freed at once (Scheduler.schedule's
  `self.running[-1]`, `_preempt_request`; policies/base.py `_or_finishing`);
- a block filled by a token vLLM does not know yet (sampled in the step in flight) is not cached
  when its request is preempted, so the request's prefix hit on readmission is one block shorter
  (KVCacheManager.allocate_slots caches at most `request.num_tokens`, and update_from_output caches
  `num_computed_tokens - num_in_flight_tokens`; BlockManager.num_cached_tokens).

tests/parity/ checks both against vLLM's own AsyncScheduler on random workloads (the
`bursty-tight-cached-*-async`, `sliding-300-prefix-tight-0-async` and `hybrid-300-prefix-tight-1-async`
runs differed before).
"""

from __future__ import annotations

import pytest

from policies import POLICIES
from sim.block_manager import BlockManager
from sim.config import SchedulerConfig
from sim.request import Request, Status
from sim.sliding_block_manager import SlidingWindowBlockManager
from sim.state import EngineState


def _running(state: EngineState, r: Request, num_computed: int, num_output: int) -> None:
    """`r` admitted, with `num_computed` tokens computed and `num_output` emitted, its blocks taken."""
    bm = state.block_manager
    bm.allocate(r, [], num_computed)
    r.num_computed_tokens, r.num_output_tokens = num_computed, num_output
    r.status = Status.RUNNING
    state.join_running(r)


def _two_requests(policy: str, finishing_admitted_last: bool):
    """Blocks of 4, 4 in all. A (5-token prompt, 4 tokens emitted) has computed 8 and must open a
    third block for its next decode; B (5-token prompt, max_tokens 4) emitted its last token in the
    step in flight (step 6) and holds the other 2 blocks: no block is free."""
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    state = EngineState(bm)
    a, b = Request(0, "a", 0.0, 5, 10), Request(1, "b", 0.0, 5, 4)
    first, second = (a, b) if finishing_admitted_last else (b, a)
    _running(state, first, 8, 4)
    _running(state, second, 8, 4)
    b.status = Status.FINISHED
    state.running.remove(b)
    state.finishing.append(b)
    for r in (a, b):
        r.last_scheduled_step = r.last_sampled_step = 6
    state.step_index = 7
    bm.pipelined, bm.step_in_flight = True, 6
    config = SchedulerConfig(policy, 16, 4, async_scheduling=True)
    return state, POLICIES[policy](config), a, b


@pytest.mark.parametrize("policy", ["chunked", "decode-first", "prefill-first"])
def test_a_finishing_request_admitted_last_is_vllms_preemption_victim(policy):
    state, scheduler, a, b = _two_requests(policy, finishing_admitted_last=True)
    batch = scheduler.schedule(state, 1.0)
    # vLLM's running list is [A, B]; A's decode finds no free block, so B, the last, is preempted: its
    # two blocks are freed at once and A takes one. B still finishes (its last token is a stale output).
    assert batch.requests == [a] and batch.num_scheduled_tokens == [1]
    assert (state.num_preemptions, b.num_preemptions, a.num_preemptions) == (1, 1, 0)
    assert state.finishing == [] and list(state.waiting) == [] and b.status is Status.FINISHED
    assert (len(a.block_table), b.block_table, state.block_manager.num_free_blocks) == (3, [], 1)
    state.block_manager.check_invariants(state.running)


@pytest.mark.parametrize("policy", ["chunked", "decode-first", "prefill-first"])
def test_a_finishing_request_admitted_first_is_not_the_victim(policy):
    state, scheduler, a, b = _two_requests(policy, finishing_admitted_last=False)
    batch = scheduler.schedule(state, 1.0)
    # vLLM's running list is [B, A]: A is the last, so A preempts itself; B keeps its blocks until the
    # step's output is processed.
    assert batch.requests == []
    assert (state.num_preemptions, a.num_preemptions, b.num_preemptions) == (1, 1, 0)
    assert list(state.waiting) == [a] and state.finishing == [b] and len(b.block_table) == 2


def _preempted_hit(bm: BlockManager, cached_short_step: int, pipelined: bool) -> int:
    """A request (8-token prompt, blocks of 4) that decoded to 12 computed tokens (its 4th token in
    flight), preempted while the engine schedules beside step 9; the blocks its readmission hits."""
    r = Request(0, "r", 0.0, 8, 10)
    bm.allocate(r, [], 8)
    r.num_computed_tokens, r.num_output_tokens, r.status = 8, 1, Status.RUNNING
    for token in range(3):
        bm.append(r, 1)
        r.num_computed_tokens += 1
        r.num_output_tokens += 1
    assert (r.num_computed_tokens, r.num_tokens, len(r.block_table)) == (11, 12, 3)
    bm.append(r, 1)  # its last step, 9: position 11 fills block 2 (tokens 8-11)
    r.num_computed_tokens, r.num_output_tokens = 12, 5
    r.last_scheduled_step = r.last_sampled_step = 9
    r.cached_short_step = cached_short_step
    bm.pipelined, bm.step_in_flight = pipelined, 9
    bm.free(r, preempted=True)
    r.num_computed_tokens, r.status = 0, Status.WAITING
    r.num_preemptions = 1
    bm.pipelined = False
    return len(bm.cached_prefix(r))


@pytest.mark.parametrize("make", [
    lambda: BlockManager(10, 4, True),
    lambda: SlidingWindowBlockManager(10, 4, True, (("sliding_attention", 64), ("full_attention", None)), 80),
], ids=["full-attention", "sliding-and-full"])
def test_a_block_filled_by_a_token_vllm_does_not_know_yet_is_not_cached(make):
    # Step 9 computed position 11 (the token sampled in step 8, unknown to vLLM when it scheduled step
    # 9: its placeholder) and is in flight, so vLLM cached blocks 0-1 only (tokens 0-7): the hit is 2
    # blocks. Synchronously, or when step 9 is not the step in flight (its output was processed),
    # block 2 (tokens 8-11) is cached too: 3 blocks (a hit stops at num_tokens - 1 = 12 tokens).
    assert _preempted_hit(make(), cached_short_step=9, pipelined=True) == 2
    assert _preempted_hit(make(), cached_short_step=9, pipelined=False) == 3
    assert _preempted_hit(make(), cached_short_step=8, pipelined=True) == 3  # it did not sample in step 8


def test_the_engine_records_which_steps_sampled_after_a_sampling_step():
    # Under asynchronous scheduling the engine keeps, per request, the last step it sampled in and the
    # last in which it sampled right after sampling in the step before (Request.cached_short_step), a
    # decode run's steps as a single step's; synchronously neither.
    from sim.arrivals import TraceArrivals, simulate
    from sim.engine import Engine, TokenTimes
    from tests.helpers import ConstantBackend

    for asynchronous in (False, True):
        for fast_forward in (False, True):
            requests = [Request(0, "0", 0.0, 20, 6)]
            config = SchedulerConfig("chunked", 8, 4, async_scheduling=asynchronous)
            engine = Engine(POLICIES["chunked"](config), ConstantBackend(0.01), BlockManager(20, 4, True),
                            TokenTimes(requests), 1000, fast_forward=fast_forward)
            simulate(engine, TraceArrivals(requests, engine))
            r = requests[0]
            # Steps 0-2 prefill (8, 8, 4 tokens; step 2 samples the first token), steps 3-7 decode.
            assert r.last_scheduled_step == 7
            assert (r.last_sampled_step, r.cached_short_step) == ((7, 7) if asynchronous else (-1, -1))
