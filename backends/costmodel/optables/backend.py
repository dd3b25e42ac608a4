"""The operator-table backend: a step's time is the sum of measured operator times.

It answers the engine as the cost-model backend does (`execute`, `decode_run`, `breakdown`,
`step_seconds`), from an `OperatorModel` (backends/costmodel/optables/model.py) built from a profile written by
`sim calibrate --from-ops` (backends/costmodel/optables/profile.py). Decode-only runs are costed in one
vectorised call whose every step has exactly the seconds `execute` gives that step.
"""

from __future__ import annotations

import numpy as np

from backends.costmodel.optables.model import OperatorModel
from sim.backend import StepResult
from sim.batch import Batch


class OpTableBackend:
    name = "costmodel"  # a cost model: it predicts, it does not run the batch
    num_blocks = None  # the run's KV plan decides
    supports_fast_forward = True

    def __init__(self, op_model: OperatorModel, device: str = "gpu", profile_name: str | None = None):
        self.ops = op_model
        self.device = device  # the system the tables were measured on
        self.device_name = f"{device} (operator tables)"
        self.dtype = {"bf16": "bfloat16", "fp8": "float8", "fp4": "nvfp4"}[op_model.dtype]
        self.profile_name = profile_name

    def _total(self, parts: dict):
        return self.ops.total(parts)

    def execute(self, batch: Batch) -> StepResult:
        seconds, parts = self.ops.batch_step(batch.num_scheduled_tokens, batch.num_computed_tokens,
                                             sum(batch.needs_logits))
        return StepResult(seconds, parts)  # floats (OperatorModel.batch_step)

    def decode_run(self, context_lens, num_steps: int, active_steps=None) -> tuple[np.ndarray, dict]:
        """Seconds and parts of `num_steps` decode-only steps of the same requests, whose contexts
        after the first step are `context_lens` and grow by one token per step; request i takes
        part in the first `active_steps[i]` steps only (default: all)."""
        if active_steps is None or min(active_steps) >= num_steps:  # the same requests throughout
            return self.ops.decode_run_of(len(context_lens), int(sum(context_lens)), num_steps)
        # Step j has the requests with active > j: stretches of steps with the same requests,
        # each with its number of requests and the sum of their contexts at its first step.
        leaving = sorted([(a, c) for a, c in zip(active_steps, context_lens) if a < num_steps])
        num_running, sum_running = len(context_lens), int(sum(context_lens))
        ns, lengths, sums = [], [], []
        step = 0
        for active, context in leaving:  # in the order they leave
            if active > step:  # the stretch up to its last step
                ns.append(num_running)
                lengths.append(active - step)
                sums.append(sum_running)  # their contexts at step j sum to this + num_running * j
                step = active
            num_running -= 1
            sum_running -= context
        if not num_running:  # steps with no request left: the general path
            return self._decode_run_arrays(context_lens, num_steps, active_steps, np.arange(num_steps, dtype=np.int64))
        ns.append(num_running)
        lengths.append(num_steps - step)
        sums.append(sum_running)
        return self.ops.decode_pieces(ns, lengths, sums)

    def chunk_steps(self, decode_computed: list[int], chunk: int, before: int,
                    num_steps: int) -> tuple[list[float], dict[str, list[float]]]:
        """See sim.backend.ChunkStepsBackend: from the decodes' number and their contexts' sum."""
        n = len(decode_computed)
        return self.ops.chunk_steps(n, sum(decode_computed) + n, chunk, before, num_steps)

    def _decode_run_arrays(self, context_lens, num_steps: int, active_steps, steps: np.ndarray) -> tuple[np.ndarray, dict]:
        contexts = np.asarray(context_lens, dtype=np.int64)
        active = np.minimum(np.asarray(active_steps, dtype=np.int64), num_steps)
        # Step j has the requests with active > j: their number and the sum of their contexts.
        order = np.argsort(active, kind="stable")
        leave = active[order]
        left_before = np.searchsorted(leave, steps, side="right")  # requests gone by step j
        num_running = len(contexts) - left_before
        tail_sums = np.concatenate([np.cumsum(contexts[order][::-1])[::-1], [0]])
        sum_c = tail_sums[left_before] + num_running * steps
        parts = self.ops.decode_steps(num_running, sum_c)
        return self._total(parts), parts

    def breakdown(self, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> dict[str, np.ndarray]:
        """Seconds per part for each row: q, c [steps, requests] query and context lengths
        (zero-padded), num_logits [steps]."""
        rows = []
        for q_row, c_row, m in zip(np.asarray(q).tolist(), np.asarray(c).tolist(), np.asarray(num_logits).tolist()):
            pairs = [(qi, ci - qi) for qi, ci in zip(q_row, c_row) if qi > 0]
            rows.append(self.ops.batch_step([p[0] for p in pairs], [p[1] for p in pairs], int(m))[1])
        return {k: np.array([float(r[k]) for r in rows]) for k in (rows[0] if rows else {})}

    def step_seconds(self, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
        return self._total(self.breakdown(q, c, num_logits))
