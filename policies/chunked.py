"""`chunked`: Sarathi-Serve stall-free batching, as vLLM V1 schedules.

Every running decode gets its token first, then partially done prefills continue, then new
requests are admitted, each prefill chunked to the budget that remains. Steps mix prefill
chunks and decodes. New requests are not admitted in a step that had to preempt.
"""

from __future__ import annotations

from policies.base import Policy
from sim.batch import Batch
from sim.request import Status
from sim.state import EngineState


class ChunkedPolicy(Policy):
    name = "chunked"
    supports_fast_forward = True  # the promise of policies/base.py: admission only as finish_may_admit says

    def schedule(self, state: EngineState, now: float) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        # Decodes first; budget >= max_num_seqs (checked in SchedulerConfig) leaves room for all.
        num_preemptions = state.num_preemptions
        decoders, prefills = self._split_running(state)
        self._schedule_decodes(state, batch, decoders)
        budget -= len(batch)
        # Then partially done prefills, chunked to the budget left.
        for request in prefills:
            if budget == 0:
                break
            if request.status is not Status.RUNNING:
                continue  # preempted to make room for an earlier request
            num_tokens = min(request.num_tokens_to_compute, budget)
            if self._schedule_running(state, batch, request, num_tokens):
                budget -= num_tokens
        # Then new requests, unless this step had to preempt (any request: vLLM V1's Scheduler.schedule
        # admits waiting requests only `if not preempted_reqs`).
        if state.num_preemptions == num_preemptions:
            while state.waiting and budget > 0 and len(state.running) < self.config.max_num_seqs:
                admitted = self._try_admit(state, batch, now, max_chunk=budget)
                if not admitted:
                    break
                budget -= admitted
        return batch
