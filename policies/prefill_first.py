"""`prefill-first` (vLLM V0's default, Vidur's `vllm`).

If waiting requests can be admitted, the step is prefill-only: whole prompts, FCFS, up to the
token budget (the first even when it alone exceeds it). Otherwise every running request decodes
one token. Decodes stall while prompts are admitted.
"""

from __future__ import annotations

from policies.base import Policy, Promises
from sim.batch import Batch
from sim.state import EngineState


class PrefillFirstPolicy(Policy):
    name = "prefill-first"
    # The promises of policies/base.py: admission only as finish_may_admit says; with none waiting, every
    # running request decodes.
    promises = Promises(fast_forward=True, decodes_all_when_none_waits=True)
    whole_prompts = True  # the first prompt of a step is admitted whole, even beyond the budget

    def schedule(self, state: EngineState, now: float) -> Batch:
        batch = Batch()
        if self._admit_whole_prompts(state, batch, now):
            return batch
        self._schedule_all_decodes(state, batch)
        return batch
