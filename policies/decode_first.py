"""`decode-first` (FasterTransformer-style request-level batching, Vidur's `faster_transformer`).

While any request is decoding, only decodes run. New requests are admitted only when the batch
has drained: whole prompts, FCFS, up to the token budget and `max_num_seqs` (at least one).
"""

from __future__ import annotations

from policies.base import Policy, Promises
from sim.batch import Batch
from sim.state import EngineState


class DecodeFirstPolicy(Policy):
    name = "decode-first"
    # The promises of policies/base.py: admission only as finish_may_admit says; with none waiting, every
    # running request decodes.
    promises = Promises(fast_forward=True, decodes_all_when_none_waits=True)
    whole_prompts = True  # the first prompt of a step is admitted whole, even beyond the budget

    def schedule(self, state: EngineState, now: float) -> Batch:
        batch = Batch()
        if state.running:
            self._schedule_all_decodes(state, batch)
        else:
            self._admit_whole_prompts(state, batch, now)
        return batch

    def finish_may_admit(self, state: EngineState) -> bool:
        return False  # prompts wait until the whole batch has drained
