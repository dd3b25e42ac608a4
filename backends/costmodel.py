"""The cost-model backend: a per-operator roofline of one Llama-style decoder step.

Every operator takes max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)); the
step is their sum plus a fixed per-step overhead. Dense layers see all T tokens of the step;
attention is costed per request from its own query length q and context length c (a prefill
chunk attends causally, a decode is q = 1); the LM head runs only on the logits rows.

A `Calibration` (fitted by `sim calibrate`, loaded from a profile) replaces the datasheet peaks
and efficiencies: the step is then a non-negative sum of the same roofline terms, `FEATURES`,
each with a fitted cost per unit, so a profile alone (no hardware preset) sets step times.

A run of decode-only steps is costed in one vectorised call (`decode_run`), with exactly the
figures single steps would get.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from backends import StepResult
from backends.presets import get_hardware, get_model
from sim.batch import Batch
from sim.errors import ServesimError


@dataclass(frozen=True)
class Efficiencies:
    """Fractions of the datasheet peaks that each kind of operator reaches."""

    gemm: float = 0.7  # dense bf16 matmuls
    attention: float = 0.5  # attention FLOPs (prefill chunks)
    memory: float = 0.85  # HBM bandwidth
    step_overhead_s: float = 1e-3  # scheduling, launches, sampling

    def __post_init__(self) -> None:
        for name in ("gemm", "attention", "memory"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ServesimError(f"cost-model efficiency {name} must be in (0, 1], got {value}")
        if self.step_overhead_s < 0:
            raise ServesimError(f"step overhead must be >= 0 s, got {self.step_overhead_s}")


# The terms of a calibrated step: GEMM FLOPs (a memory-bound GEMM counts its bytes x the ridge
# point), attention FLOPs counted causally (a flash-style kernel) and densely (a masked q x c
# kernel), K/V bytes read by each request and by padded decode attention (every decode as long as
# the longest), the part of a layer's padded decode K/V beyond the cache size (it no longer fits
# in the caches), tokens, requests, prefill chunks (requests with q > 1), and 1. Terms that an
# implementation does not have get a zero coefficient in the fit.
FEATURES = ("linear_flops", "attention_flops", "attention_dense_flops", "kv_read_bytes", "kv_read_padded_bytes",
            "kv_read_padded_excess_bytes", "num_tokens", "num_requests", "num_prefill_chunks", "constant")


class StepAggregates(NamedTuple):
    """Exact integer aggregates of a step's batch, each an int or an int64 array (one entry per
    step). Requests with q = 1 are decodes; the others are prefill chunks."""

    num_tokens: Any
    num_logits: Any
    num_requests: Any
    num_decodes: Any
    sum_context: Any  # sum of c
    sum_causal: Any  # sum of q*c - q*(q-1)/2: keys attended under a causal mask
    sum_dense: Any  # sum of q*c: query-key pairs of a masked dense attention
    max_decode_context: Any  # the longest decode's c; 0 without decodes


def step_aggregates(q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> StepAggregates:
    """Aggregates of steps given as q, c: [steps, requests] (zero-padded) and num_logits: [steps]."""
    q, c = np.asarray(q, dtype=np.int64), np.asarray(c, dtype=np.int64)
    is_decode = q == 1
    return StepAggregates(q.sum(axis=1), np.asarray(num_logits, dtype=np.int64), (q > 0).sum(axis=1),
                          is_decode.sum(axis=1), c.sum(axis=1), (q * c - q * (q - 1) // 2).sum(axis=1),
                          (q * c).sum(axis=1), np.where(is_decode, c, 0).max(axis=1, initial=0))


def linear_flops(model: dict, num_tokens, num_logits, dtype_bytes: int, ridge_flops_per_byte: float):
    """The GEMM term: every layer's matmuls over the step's tokens and the LM head over its logits
    rows, each max(FLOPs, ridge x bytes). Ints or arrays."""
    b, r, t, n = dtype_bytes, ridge_flops_per_byte, num_tokens, num_logits
    h, v = model["hidden_size"], model["vocab_size"]
    linear = 0.0
    for k_in, n_out in gemm_shapes(model):
        linear = linear + np.maximum(2.0 * t * k_in * n_out, r * (k_in * n_out + t * (k_in + n_out)) * b)
    # The LM head runs (and reads its weights) only when some row needs logits.
    lm_head = np.where(n > 0, np.maximum(2.0 * n * h * v, r * ((h * v + n * h) * b + n * v * 4)), 0.0)
    return model["num_hidden_layers"] * linear + lm_head


def calibrated_terms(model: dict, agg: StepAggregates, dtype_bytes: int, linear,
                     cache_bytes: float | None = None) -> tuple:
    """The values of `FEATURES` but the first (`linear`, given), from a step's aggregates. The same
    expressions serve the fit, single steps and decode runs, so they agree exactly."""
    layers, hd = model["num_hidden_layers"], model["head_dim"]
    nh, nkv = model["num_attention_heads"], model["num_key_value_heads"]
    flops_per_key = layers * 4.0 * nh * hd  # QK^T and PV, per query-key pair
    token_kv_bytes = 2.0 * nkv * hd * dtype_bytes  # K and V of one cached token in one layer
    padded = token_kv_bytes * (agg.num_decodes * agg.max_decode_context)  # per layer
    excess = 0.0 if cache_bytes is None else layers * np.maximum(padded - cache_bytes, 0.0)
    return (linear, flops_per_key * agg.sum_causal, flops_per_key * agg.sum_dense,
            layers * token_kv_bytes * agg.sum_context, layers * padded, excess, agg.num_tokens, agg.num_requests,
            agg.num_requests - agg.num_decodes, 1)


@dataclass(frozen=True)
class Calibration:
    """Seconds per unit of each of `FEATURES`, fitted to measured steps (see backends/profile.py).

    A GEMM's term is max(FLOPs, ridge_flops_per_byte x bytes): its roofline in FLOP units, so that
    one fitted seconds-per-FLOP covers both the memory-bound (small batch) and compute-bound side.
    Zero ridge makes the term proportional to the tokens through the linear layers.
    `cache_bytes` is where padded decode K/V of one layer stops fitting in the caches (None: no
    such knee, the excess term is zero).
    """

    coefficients: tuple[float, ...]  # seconds per unit, in FEATURES order
    ridge_flops_per_byte: float = 0.0
    dtype_bytes: int = 2  # of the K/V cache and weights the features count
    cache_bytes: float | None = None

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ServesimError(f"a calibration needs {len(FEATURES)} coefficients ({', '.join(FEATURES)}), "
                                f"got {len(self.coefficients)}")
        bad = [f"{k}={v}" for k, v in zip(FEATURES, self.coefficients) if not (np.isfinite(v) and v >= 0)]
        if bad:
            raise ServesimError(f"calibration coefficients must be finite and >= 0: {', '.join(bad)}")
        if not (np.isfinite(self.ridge_flops_per_byte) and self.ridge_flops_per_byte >= 0):
            raise ServesimError(f"calibration ridge must be finite and >= 0, got {self.ridge_flops_per_byte}")
        if self.dtype_bytes not in (1, 2, 4):
            raise ServesimError(f"calibration dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if self.cache_bytes is not None and not (np.isfinite(self.cache_bytes) and self.cache_bytes > 0):
            raise ServesimError(f"calibration cache_bytes must be positive or None, got {self.cache_bytes}")

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients))


def gemm_shapes(model: dict) -> list[tuple[int, int]]:
    """(in, out) features of each per-layer matmul: fused QKV, O, fused gate+up, down."""
    h, i, hd = model["hidden_size"], model["intermediate_size"], model["head_dim"]
    nh, nkv = model["num_attention_heads"], model["num_key_value_heads"]
    return [(h, (nh + 2 * nkv) * hd), (nh * hd, h), (h, 2 * i), (i, h)]


def step_features(model: dict, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray, dtype_bytes: int = 2,
                  ridge_flops_per_byte: float = 0.0, cache_bytes: float | None = None) -> np.ndarray:
    """The calibrated model's terms, [steps, len(FEATURES)]. q, c: [steps, requests] query and context
    lengths (zero-padded); num_logits: [steps]. Each row depends only on its own step."""
    agg = step_aggregates(q, c, num_logits)
    linear = linear_flops(model, agg.num_tokens, agg.num_logits, dtype_bytes, ridge_flops_per_byte)
    terms = calibrated_terms(model, agg, dtype_bytes, linear, cache_bytes)
    steps = len(agg.num_tokens)
    return np.stack([np.broadcast_to(np.asarray(x, dtype=np.float64), (steps,)) for x in terms], axis=1)


class CostModelBackend:
    """Step time from a batch's shape: the roofline with datasheet efficiencies, or a calibration.

    A step is costed from a few exact integer aggregates of its batch (tokens, logits rows,
    requests, sums of context lengths and of causal attention lengths) plus, for requests with
    more than one query token, a per-request attention roofline. Decodes (q = 1) are memory-bound
    in attention on every preset, so their attention is a function of their summed contexts. A run
    of decode steps therefore varies only in that sum, and `decode_run` costs it with the same
    expressions as `execute`, element by element: each step of a run gets exactly the seconds a
    single step would.
    """

    name = "costmodel"

    def __init__(self, model: str, hardware: str | None, efficiencies: Efficiencies | None = None,
                 dtype_bytes: int = 2, calibration: Calibration | None = None):
        """With a `calibration` the step time comes from it alone and `hardware` may be None."""
        if calibration is None and hardware is None:
            raise ServesimError("the cost model needs a hardware preset or a calibrated profile")
        self.model_name, self.hardware_name = model, hardware
        self.model = get_model(model)
        self.hardware = get_hardware(hardware) if hardware is not None else None
        self.eff = efficiencies or Efficiencies()
        self.calibration = calibration
        self.dtype_bytes = calibration.dtype_bytes if calibration is not None else dtype_bytes
        self._gemms = gemm_shapes(self.model)
        m, b = self.model, self.dtype_bytes
        hd, nh, nkv = m["head_dim"], m["num_attention_heads"], m["num_key_value_heads"]
        self._dense_cache: dict[tuple[int, int], tuple[float, ...]] = {}
        if calibration is None:
            self._flops_s = self.hardware["peak_flops"]
            self._bytes_s = self.hardware["memory_bandwidth"] * self.eff.memory
            # Seconds per context token of one decode's attention, as FLOPs and as bytes.
            decode_flops_s = 4.0 * nh * hd / (self._flops_s * self.eff.attention)
            decode_bytes_s = 2 * nkv * hd * b / self._bytes_s
            self._decodes_memory_bound = decode_bytes_s >= decode_flops_s
            # A memory-bound decode's attention, over all layers: per token of context (its K/V)
            # and per decode (its q and output rows).
            layers = m["num_hidden_layers"]
            self._decode_s_per_context = layers * (2 * nkv * hd) * b / self._bytes_s
            self._decode_s_per_request = layers * (2 * nh * hd) * b / self._bytes_s
        else:
            self._decodes_memory_bound = True  # a calibration is linear in the aggregates

    @property
    def supports_fast_forward(self) -> bool:
        return self._decodes_memory_bound

    # The per-operator costs.

    def _gemm_roofline(self, tokens: int) -> float:
        b = self.dtype_bytes
        total = 0.0
        for k_in, n_out in self._gemms:
            total += max(2.0 * tokens * k_in * n_out / (self._flops_s * self.eff.gemm),
                         (k_in * n_out + tokens * (k_in + n_out)) * b / self._bytes_s)
        return total

    def _attention_roofline(self, q: int, c: int) -> float:
        """One request's attention in one layer: q new tokens at the end of a context of c attend
        causally (the j-th sees c - q + j + 1 keys)."""
        m, b = self.model, self.dtype_bytes
        hd, nh, nkv = m["head_dim"], m["num_attention_heads"], m["num_key_value_heads"]
        flops = 4.0 * nh * hd * (q * c - q * (q - 1) // 2)
        num_bytes = (c * 2 * nkv * hd + q * 2 * nh * hd) * b
        return max(flops / (self._flops_s * self.eff.attention), num_bytes / self._bytes_s)

    def _dense(self, t: int, num_logits: int) -> tuple[float, ...]:
        """Everything of a step of t tokens that does not depend on contexts: (linear, kv_write,
        elementwise, lm_head) seconds, or with a calibration (linear FLOP units,). Cached: steps
        repeat shapes."""
        key = (t, num_logits)
        cached = self._dense_cache.get(key)
        if cached is not None:
            return cached
        m, b = self.model, self.dtype_bytes
        layers, h, i, v = m["num_hidden_layers"], m["hidden_size"], m["intermediate_size"], m["vocab_size"]
        hd, nh, nkv = m["head_dim"], m["num_attention_heads"], m["num_key_value_heads"]
        cal = self.calibration
        if cal is None:
            linear = layers * self._gemm_roofline(t)
            kv_write = layers * (t * 2 * nkv * hd * b / self._bytes_s)
            # Two RMSNorms, two residual adds, RoPE on q and k, SiLU-and-multiply; the embedding rows.
            elementwise = (layers * (t * b * (8 * h + 2 * (nh + nkv) * hd + 3 * i) / self._bytes_s)
                           + (t * h * b + num_logits * h * 2 * b) / self._bytes_s)
            lm_head = 0.0
            if num_logits:
                lm_head = max(2.0 * num_logits * h * v / (self._flops_s * self.eff.gemm),
                              ((h * v + num_logits * h) * b + num_logits * v * 4) / self._bytes_s)
            value = (linear, kv_write, elementwise, lm_head)
        else:
            value = (float(linear_flops(m, t, num_logits, b, cal.ridge_flops_per_byte)),)
        self._dense_cache[key] = value
        return value

    def _parts(self, t: int, num_logits: int, n: int, sum_c, attn_units, decode_sum_c, num_decodes: int,
               other_attention_s: float, dense_units=0, max_decode_c=0, dense: tuple | None = None) -> dict:
        """Seconds per operator from a step's aggregates. `sum_c`, `attn_units` (sum of
        q*c - q*(q-1)/2), `decode_sum_c` (contexts of the q = 1 requests), `dense_units` (sum of
        q*c) and `max_decode_c` may be int64 arrays, one entry per step; everything else is the
        same for all those steps. `other_attention_s`: per-layer attention of the requests with
        q > 1 (roofline mode)."""
        m, b = self.model, self.dtype_bytes
        if dense is None:
            dense = self._dense(t, num_logits)
        cal = self.calibration
        if cal is None:
            linear, kv_write, elementwise, lm_head = dense
            attention = (decode_sum_c * self._decode_s_per_context
                         + (num_decodes * self._decode_s_per_request + m["num_hidden_layers"] * other_attention_s))
            return {"linear": linear, "attention": attention,
                    "kv_write": kv_write, "elementwise": elementwise, "lm_head": lm_head,
                    "overhead": self.eff.step_overhead_s}
        agg = StepAggregates(t, num_logits, n, num_decodes, sum_c, attn_units, dense_units, max_decode_c)
        terms = [x * k for x, k in zip(calibrated_terms(m, agg, b, dense[0], cal.cache_bytes), cal.coefficients)]
        linear, causal, dense_attention, kv_read, kv_padded, kv_excess, tokens, requests, chunks, constant = terms
        return {"linear": linear, "attention": causal + dense_attention + kv_read + kv_padded + kv_excess,
                "elementwise": tokens, "overhead": requests + chunks + constant}

    @staticmethod
    def _total(parts: dict):
        """The step's seconds: the parts in a fixed order, attention (the one that varies along a
        decode run) last, so a run adds one array."""
        total = 0.0
        for key, value in parts.items():
            if key != "attention":
                total = total + value
        return total + parts["attention"]

    def _step_parts(self, q_list, computed_list, num_logits: int) -> dict:
        """Aggregates of one step's batch, then its parts."""
        t = sum(q_list)
        n = len(q_list)
        sum_c = sum(computed_list) + t
        others = [i for i, q in enumerate(q_list) if q != 1] if self._decodes_memory_bound else range(n)
        other_c = other_units = other_dense = 0
        other_attention_s = 0.0
        for i in others:
            q = q_list[i]
            c = computed_list[i] + q
            other_c += c
            other_units += q * c - q * (q - 1) // 2
            other_dense += q * c
            if self.calibration is None:
                other_attention_s += self._attention_roofline(q, c)
        num_decodes = n - len(others)
        decode_sum_c = sum_c - other_c
        attn_units = decode_sum_c + other_units  # a decode's causal length is its context
        max_decode_c = 0
        if self.calibration is not None and num_decodes:
            max_decode_c = max(computed_list[i] + 1 for i, q in enumerate(q_list) if q == 1)
        return self._parts(t, num_logits, n, sum_c, attn_units, decode_sum_c, num_decodes, other_attention_s,
                           decode_sum_c + other_dense, max_decode_c)

    # The backend interface.

    def execute(self, batch: Batch) -> StepResult:
        parts = self._step_parts(batch.num_scheduled_tokens, batch.num_computed_tokens, sum(batch.needs_logits))
        return StepResult(float(self._total(parts)), {k: float(v) for k, v in parts.items()})

    def decode_run(self, context_lens, num_steps: int, active_steps=None) -> tuple[np.ndarray, dict]:
        """Seconds and breakdown of `num_steps` decode-only steps of the same requests, whose
        contexts (after the first step) are `context_lens` and grow by one token per step.
        Request i takes part in the first `active_steps[i]` steps only (default: all). A part that
        is the same for every step may be a float, the others are [num_steps] arrays. Each step's
        figures are exactly those `execute` gives for that step's batch (the engine's fast path
        relies on it)."""
        contexts = context_lens if isinstance(context_lens, list) else [int(c) for c in context_lens]
        n = len(contexts)
        steps = np.arange(num_steps, dtype=np.int64)
        if active_steps is None or min(active_steps) >= num_steps:
            sum_c = sum(contexts) + n * steps
            max_c = max(contexts, default=0) + steps if self.calibration is not None else 0
            parts = self._parts(n, n, n, sum_c, sum_c, sum_c, n, 0.0, sum_c, max_c)
            return self._total(parts), parts
        # Requests leave as they finish: step j has those with active_steps > j. The steps split
        # into segments, one per number of requests left.
        leavers = sorted((a, c) for a, c in zip(active_steps, contexts) if a < num_steps)
        left_sum = sum(contexts) - sum(c for _, c in leavers)
        staying = [c for a, c in zip(active_steps, contexts) if a >= num_steps]
        num_running = np.empty(num_steps, dtype=np.int64)
        base_sum = np.empty(num_steps, dtype=np.int64)
        base_max = np.empty(num_steps, dtype=np.int64)
        dense = [np.empty(num_steps) for _ in range(len(self._dense(n, n)))]
        end = num_steps
        running, left_max = len(staying), max(staying, default=0)
        for leave, c in reversed([(0, 0)] + leavers):  # segments from the last one back
            if leave < end:
                num_running[leave:end] = running
                base_sum[leave:end] = left_sum
                base_max[leave:end] = left_max
                # Everything but attention depends on the number running alone.
                for column, value in zip(dense, self._dense(running, running)):
                    column[leave:end] = value
                end = leave
            running += 1
            left_sum += c
            left_max = max(left_max, c)
        steps_sum = num_running * steps
        sum_c = base_sum + steps_sum
        max_c = base_max + steps
        parts = self._parts(num_running, num_running, num_running, sum_c, sum_c, sum_c, num_running, 0.0, sum_c,
                            max_c, dense=tuple(dense))
        return self._total(parts), parts

    def decode_run_seconds(self, context_lens: np.ndarray, num_steps: int) -> np.ndarray:
        return self.decode_run(context_lens, num_steps)[0]

    def breakdown(self, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> dict[str, np.ndarray]:
        """Seconds per operator for each row: q, c [steps, requests] query and context lengths
        (zero-padded), num_logits [steps]."""
        rows = []
        for q_row, c_row, m in zip(np.asarray(q).tolist(), np.asarray(c).tolist(), np.asarray(num_logits).tolist()):
            pairs = [(qi, ci - qi) for qi, ci in zip(q_row, c_row) if qi > 0]
            rows.append(self._step_parts([p[0] for p in pairs], [p[1] for p in pairs], int(m)))
        return {k: np.array([float(r[k]) for r in rows]) for k in (rows[0] if rows else {})}

    def step_seconds(self, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
        return self._total(self.breakdown(q, c, num_logits))
