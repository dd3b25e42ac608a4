"""`decode-first` (FasterTransformer-style request-level batching, Vidur's `faster_transformer`).

While any request is decoding, only decodes run. New requests are admitted only when the batch
has drained: whole prompts, FCFS, up to the token budget and `max_num_seqs` (at least one).
"""

from __future__ import annotations

from policies.base import Policy
from sim.batch import Batch
from sim.state import EngineState


class DecodeFirstPolicy(Policy):
    name = "decode-first"
    supports_fast_forward = True  # the promise of policies/base.py: admission only as finish_may_admit says
    decodes_all_when_none_waits = True  # policies/base.py: with none waiting, every running request decodes

    def schedule(self, state: EngineState, now: float) -> Batch:
        batch = Batch()
        if state.running:
            self._schedule_all_decodes(state, batch)
        else:
            self._admit_whole_prompts(state, batch, now)
        return batch

    def finish_may_admit(self, state: EngineState) -> bool:
        return False  # prompts wait until the whole batch has drained
