"""The calibrated cost model: a step's time as a non-negative sum of roofline terms (`FEATURES`),
each with a cost per unit fitted to measured steps by `sim calibrate` (backends/profile.py).
A profile alone sets step times; no hardware preset is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.costmodel.frame import CostModel, StepAggregates, step_aggregates
from backends.model_config import ModelConfig
from sim.errors import ServesimError

# The terms of a calibrated step: GEMM FLOPs (a memory-bound GEMM counts its bytes x the ridge
# point), attention FLOPs counted causally (a flash-style kernel) and densely (a masked q x c
# kernel), K/V bytes read by each request and by padded decode attention (every decode as long as
# the longest), the part of a layer's padded decode K/V beyond the cache size (it no longer fits
# in the caches), tokens, requests, prefill chunks (requests with q > 1), and 1. Terms that an
# implementation does not have get a zero coefficient in the fit.
FEATURES = ("linear_flops", "attention_flops", "attention_dense_flops", "kv_read_bytes", "kv_read_padded_bytes",
            "kv_read_padded_excess_bytes", "num_tokens", "num_requests", "num_prefill_chunks", "constant")


def linear_flops(model: ModelConfig, num_tokens, num_logits, dtype_bytes: int, ridge_flops_per_byte: float):
    """The GEMM term: every layer's matmuls over the step's tokens and the LM head over its logits
    rows, each max(FLOPs, ridge x bytes). Ints or arrays."""
    b, r, t, n = dtype_bytes, ridge_flops_per_byte, num_tokens, num_logits
    h, v = model.hidden_size, model.vocab_size
    linear = 0.0
    for _, k_in, n_out in model.gemms():
        linear = linear + np.maximum(2.0 * t * k_in * n_out, r * (k_in * n_out + t * (k_in + n_out)) * b)
    # The LM head runs (and reads its weights) only when some row needs logits.
    lm_head = np.where(n > 0, np.maximum(2.0 * n * h * v, r * ((h * v + n * h) * b + n * v * 4)), 0.0)
    return model.num_hidden_layers * linear + lm_head


def calibrated_terms(model: ModelConfig, agg: StepAggregates, dtype_bytes: int, linear,
                     cache_bytes: float | None = None) -> tuple:
    """The values of `FEATURES` but the first (`linear`, given), from a step's aggregates. The same
    expressions serve the fit, single steps and decode runs, so they agree exactly."""
    layers, hd = model.num_hidden_layers, model.head_dim
    nh, nkv = model.num_attention_heads, model.num_key_value_heads
    flops_per_key = layers * 4.0 * nh * hd  # QK^T and PV, per query-key pair
    token_kv_bytes = 2.0 * nkv * hd * dtype_bytes  # K and V of one cached token in one layer
    padded = token_kv_bytes * (agg.num_decodes * agg.max_decode_context)  # per layer
    excess = 0.0 if cache_bytes is None else layers * np.maximum(padded - cache_bytes, 0.0)
    return (linear, flops_per_key * agg.sum_causal, flops_per_key * agg.sum_dense,
            layers * token_kv_bytes * agg.sum_context, layers * padded, excess, agg.num_tokens, agg.num_requests,
            agg.num_requests - agg.num_decodes, 1)


MAX_COEFFICIENT_S = 1e3  # seconds per unit: a step of one token, one request, one FLOP or one byte takes far less


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
        huge = [f"{k}={v:g}" for k, v in zip(FEATURES, self.coefficients) if v > MAX_COEFFICIENT_S]
        if huge:  # (1e300 s a FLOP overflowed a step's seconds to infinity)
            raise ServesimError(f"calibration coefficients are seconds per unit (a FLOP, a byte, a token, a request, a "
                                f"step), at most {MAX_COEFFICIENT_S:g} on any device: {', '.join(huge)}")
        if not (np.isfinite(self.ridge_flops_per_byte) and self.ridge_flops_per_byte >= 0):
            raise ServesimError(f"calibration ridge must be finite and >= 0, got {self.ridge_flops_per_byte}")
        if self.dtype_bytes not in (1, 2, 4):
            raise ServesimError(f"calibration dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if self.cache_bytes is not None and not (np.isfinite(self.cache_bytes) and self.cache_bytes > 0):
            raise ServesimError(f"calibration cache_bytes must be positive or None, got {self.cache_bytes}")

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients))


def step_features(model: ModelConfig, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray, dtype_bytes: int = 2,
                  ridge_flops_per_byte: float = 0.0, cache_bytes: float | None = None) -> np.ndarray:
    """The calibrated model's terms, [steps, len(FEATURES)]. q, c: [steps, requests] query and context
    lengths (zero-padded); num_logits: [steps]. Each row depends only on its own step."""
    agg = step_aggregates(q, c, num_logits)
    linear = linear_flops(model, agg.num_tokens, agg.num_logits, dtype_bytes, ridge_flops_per_byte)
    terms = calibrated_terms(model, agg, dtype_bytes, linear, cache_bytes)
    steps = len(agg.num_tokens)
    return np.stack([np.broadcast_to(np.asarray(x, dtype=np.float64), (steps,)) for x in terms], axis=1)



class CalibratedCostModel(CostModel):
    def __init__(self, model: ModelConfig, calibration: Calibration, device_name: str = "calibrated profile"):
        super().__init__(model, calibration.dtype_bytes, device_name)
        self.calibration = calibration

    def dense(self, t: int, num_logits: int) -> tuple[float]:
        """(linear FLOP units,) of a step of t tokens."""
        return (float(linear_flops(self.model, t, num_logits, self.dtype_bytes,
                                   self.calibration.ridge_flops_per_byte)),)

    def parts(self, agg: StepAggregates, chunks: list[tuple[int, int]], dense: tuple) -> dict:
        cal = self.calibration
        terms = [x * k for x, k in zip(calibrated_terms(self.model, agg, self.dtype_bytes, dense[0], cal.cache_bytes),
                                       cal.coefficients)]
        linear, causal, dense_attention, kv_read, kv_padded, kv_excess, tokens, requests, prefill_chunks, constant = terms
        return {"linear": linear, "attention": causal + dense_attention + kv_read + kv_padded + kv_excess,
                "per_token": tokens, "per_request": requests + prefill_chunks + constant}
