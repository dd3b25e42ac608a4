"""A user's policy, loaded with --policy tests/data/policies/patient.py:PatientPolicy: chunked
prefill that admits the head of the queue only once it has waited 0.05 s. It changes admission
and does not declare fast-forward support, so the engine steps it one by one."""

from policies.base import Policy
from sim.batch import Batch


class PatientPolicy(Policy):
    name = "patient"

    def schedule(self, state, now: float) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        decoders, prefills = self._split_running(state)
        preempted = self._schedule_decodes(state, batch, decoders)
        budget -= len(batch)
        for request in prefills:
            if budget and request.status.value == "running":
                num_tokens = min(request.num_tokens_to_compute, budget)
                if self._schedule_running(state, batch, request, num_tokens):
                    budget -= num_tokens
        if not preempted:
            while (state.waiting and budget > 0 and state.num_seats < self.config.max_num_active_reqs
                   and now >= state.waiting[0].arrival_s + 0.05):  # retry_s's own sum: no rounding gap
                admitted = self._try_admit(state, batch, now, max_chunk=budget)
                if not admitted:
                    break
                budget -= admitted
        return batch

    def retry_s(self, state, now: float) -> float | None:
        return state.waiting[0].arrival_s + 0.05 if state.waiting else None
