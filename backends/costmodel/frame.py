"""The cost-model backend: a step's time predicted from its batch's shape.

Two models share one frame: `RooflineCostModel` (backends/costmodel/roofline.py, datasheet peaks and
efficiencies) and `CalibratedCostModel` (backends/costmodel/fitted.py, coefficients fitted to measured
steps). Both cost a step from `StepAggregates`, a few exact integer sums over its requests, plus,
for the roofline, a per-request attention roofline of the requests that are not plain decodes.

A run of decode-only steps varies only in those sums, so `decode_run` builds them as arrays (one
entry per step) and costs the whole run with the same expressions as `execute`, element by
element: each step of a run gets exactly the seconds it would get alone (the engine's
fast-forward relies on it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from sim.backend import StepResult
from sim.batch import Batch
from sim.errors import ServesimError


class StepAggregates(NamedTuple):
    """Exact integer aggregates of a step's batch, each an int or an int64 array (one entry per
    step). Requests with q = 1 are decodes; the others are prefill chunks."""

    num_tokens: Any
    num_logits: Any
    num_requests: Any
    num_decodes: Any
    sum_context: Any  # sum of c (context after the step)
    sum_causal: Any  # sum of q*c - q*(q-1)/2: keys attended under a causal mask
    sum_dense: Any  # sum of q*c: query-key pairs of a masked dense attention
    max_decode_context: Any  # the longest decode's c; 0 without decodes
    decode_sum_context: Any  # sum of the decodes' c


def step_aggregates(q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> StepAggregates:
    """Aggregates of steps given as q, c: [steps, requests] (zero-padded) and num_logits: [steps]."""
    q, c = np.asarray(q, dtype=np.int64), np.asarray(c, dtype=np.int64)
    is_decode = q == 1
    decode_c = np.where(is_decode, c, 0)
    return StepAggregates(q.sum(axis=1), np.asarray(num_logits, dtype=np.int64), (q > 0).sum(axis=1),
                          is_decode.sum(axis=1), c.sum(axis=1), (q * c - q * (q - 1) // 2).sum(axis=1),
                          (q * c).sum(axis=1), decode_c.max(axis=1, initial=0), decode_c.sum(axis=1))


def batch_aggregates(num_scheduled: list[int], num_computed: list[int], num_logits: int,
                     every_request: bool = False) -> tuple[StepAggregates, list[tuple[int, int]]]:
    """One batch's aggregates, and (q, c) of its requests that are not decodes (of every request
    with `every_request`, for a model that cannot cost decodes from their sums)."""
    t = sum(num_scheduled)
    sum_c = sum(num_computed) + t
    chunks = [(q, n + q) for q, n in zip(num_scheduled, num_computed) if q != 1]
    chunk_c = sum(c for _, c in chunks)
    decode_sum_c = sum_c - chunk_c
    num_decodes = len(num_scheduled) - len(chunks)
    max_decode_c = max((n + 1 for q, n in zip(num_scheduled, num_computed) if q == 1), default=0)
    causal = decode_sum_c + sum(q * c - q * (q - 1) // 2 for q, c in chunks)  # a decode's causal length is c
    dense = decode_sum_c + sum(q * c for q, c in chunks)
    if every_request:
        chunks = [(q, n + q) for q, n in zip(num_scheduled, num_computed)]
    return StepAggregates(t, num_logits, len(num_scheduled), num_decodes, sum_c, causal, dense, max_decode_c,
                          decode_sum_c), chunks


def run_aggregates(contexts: list[int], num_steps: int,
                   active_steps: list[int] | None) -> tuple[StepAggregates, list[tuple[int, int, int]]]:
    """Aggregates of `num_steps` decode-only steps of the same requests, whose contexts (after the
    first step) are `contexts` and grow by one token per step; request i takes part in the first
    `active_steps[i]` steps only (None: all). Fields that vary are [num_steps] int64 arrays. Also
    the segments (start, end, requests running) of steps with the same number of requests."""
    steps = np.arange(num_steps, dtype=np.int64)
    n = len(contexts)
    if active_steps is None or min(active_steps) >= num_steps:
        sum_c = sum(contexts) + n * steps
        return StepAggregates(n, n, n, n, sum_c, sum_c, sum_c, max(contexts, default=0) + steps, sum_c), \
            [(0, num_steps, n)]
    # Requests leave as they finish: step j has those with active_steps > j. The steps split into
    # segments, one per number of requests left, filled from the last one back.
    leavers = sorted((a, c) for a, c in zip(active_steps, contexts) if a < num_steps)
    left_sum = sum(contexts) - sum(c for _, c in leavers)
    staying = [c for a, c in zip(active_steps, contexts) if a >= num_steps]
    num_running = np.empty(num_steps, dtype=np.int64)
    base_sum = np.empty(num_steps, dtype=np.int64)
    base_max = np.empty(num_steps, dtype=np.int64)
    end = num_steps
    segments = []
    running, left_max = len(staying), max(staying, default=0)
    for leave, c in reversed([(0, 0)] + leavers):
        if leave < end:
            num_running[leave:end] = running
            base_sum[leave:end] = left_sum
            base_max[leave:end] = left_max
            segments.append((leave, end, running))
            end = leave
        running += 1
        left_sum += c
        left_max = max(left_max, c)
    sum_c = base_sum + num_running * steps
    return StepAggregates(num_running, num_running, num_running, num_running, sum_c, sum_c, sum_c, base_max + steps,
                          sum_c), segments


class CostModel:
    """What the roofline and the calibrated model share: the Backend interface over `parts`."""

    name = "costmodel"
    device = "cpu"  # nothing runs: the step is predicted
    num_blocks = None  # the run's KV plan decides
    supports_fast_forward = True
    decodes_from_sums = True  # whether a decode's attention is a function of the decodes' summed contexts

    def __init__(self, model, dtype_bytes: int, device_name: str):
        """`model`: a ModelConfig (backends/model_config.py)."""
        self.model = model
        self.dtype_bytes = dtype_bytes
        self.dtype = {1: "float8", 2: "bfloat16", 4: "float32"}[dtype_bytes]
        self.device_name = device_name
        self._dense_cache: dict[tuple[int, int], tuple] = {}

    def parts(self, agg: StepAggregates, chunks: list[tuple[int, int]], dense: tuple) -> dict:
        """Seconds per part of a step (or of each step of a run): `chunks` are (q, c) of the
        requests that are not decodes; `dense` is `self.dense(...)` of the step's tokens."""
        raise NotImplementedError

    def dense(self, num_tokens: int, num_logits: int) -> tuple:
        """Everything of a step that depends on its token and logits counts alone."""
        raise NotImplementedError

    def _dense(self, num_tokens: int, num_logits: int) -> tuple:
        key = (num_tokens, num_logits)
        value = self._dense_cache.get(key)
        if value is None:
            value = self._dense_cache[key] = self.dense(num_tokens, num_logits)
        return value

    @staticmethod
    def total(parts: dict):
        """The step's seconds: the parts in a fixed order, attention (the one that varies along a
        decode run) last, so a run adds one array."""
        total = 0.0
        for key, value in parts.items():
            if key != "attention":
                total = total + value
        return total + parts["attention"]

    def execute(self, batch: Batch) -> StepResult:
        agg, chunks = batch_aggregates(batch.num_scheduled_tokens, batch.num_computed_tokens, sum(batch.needs_logits),
                                       every_request=not self.decodes_from_sums)
        parts = self.parts(agg, chunks, self._dense(agg.num_tokens, agg.num_logits))
        return StepResult(float(self.total(parts)), {k: float(v) for k, v in parts.items()})

    def chunk_steps(self, decode_computed: list[int], chunk: int, before: int,
                    num_steps: int) -> tuple[list[float], dict[str, list[float]]]:
        """See sim.backend.ChunkStepsBackend: each step costed as `execute` costs its batch."""
        n = len(decode_computed)
        scheduled = [1] * n + [chunk]
        seconds, columns = [], {}
        for j in range(num_steps):
            computed = [c + j for c in decode_computed]
            computed.append(before + chunk * j)
            agg, chunks = batch_aggregates(scheduled, computed, n, every_request=not self.decodes_from_sums)
            parts = self.parts(agg, chunks, self._dense(agg.num_tokens, agg.num_logits))
            seconds.append(float(self.total(parts)))
            for key, value in parts.items():
                columns.setdefault(key, []).append(float(value))
        return seconds, columns

    def decode_run(self, context_lens, num_steps: int, active_steps=None) -> tuple[np.ndarray, dict]:
        """See sim.backend.DecodeRunBackend. A part that is the same for every step may be a float."""
        contexts = context_lens if isinstance(context_lens, list) else [int(c) for c in context_lens]
        agg, segments = run_aggregates(contexts, num_steps, active_steps)
        if len(segments) == 1:
            dense = self._dense(segments[0][2], segments[0][2])
        else:  # everything but attention depends on the number of requests still running alone
            dense = tuple(np.empty(num_steps) for _ in self._dense(1, 1))
            for start, end, running in segments:
                for column, value in zip(dense, self._dense(running, running)):
                    column[start:end] = value
        parts = self.parts(agg, [], dense)
        return self.total(parts), parts


def make_cost_model(model, hardware, calibration=None, tp: int = 1, dtype: str = "bf16",
                    kv_cache_dtype: str = "auto", enable_expert_parallel: bool = False, dp: int = 1) -> CostModel:
    """The calibrated model when a calibration is given, else the datasheet roofline. `model` is a
    ModelConfig, `hardware` a Hardware (or None with a calibration)."""
    if calibration is None and hardware is None:
        raise ServesimError("the cost model needs a hardware preset or a calibrated profile")
    if enable_expert_parallel and not model.num_experts:
        raise ServesimError(f"--enable-expert-parallel splits a mixture of experts' experts; model {model.name} has "
                            "none")
    if calibration is not None:
        from backends.costmodel.fitted import CalibratedCostModel

        if model.is_extended:
            raise ServesimError(f"a fitted profile prices dense decoders; model {model.name} needs the roofline "
                                "(--profile roofline)")
        return CalibratedCostModel(model, calibration)
    from backends.costmodel.roofline import MoERooflineCostModel, RooflineCostModel

    if model.is_extended:  # mixture of experts, MLA, sliding windows
        return MoERooflineCostModel(model, hardware, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                    enable_expert_parallel=enable_expert_parallel, dp=dp)
    return RooflineCostModel(model, hardware, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
