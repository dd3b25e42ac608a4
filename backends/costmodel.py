"""The cost-model backend: a per-operator roofline of one Llama-style decoder step.

Every operator takes max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)); the
step is their sum plus a fixed per-step overhead. Dense layers see all T tokens of the step;
attention is costed per request from its own query length q and context length c (a prefill
chunk attends causally, a decode is q = 1); the LM head runs only on the logits rows.

A `Calibration` (fitted by `sim calibrate`, loaded from a profile) replaces the datasheet peaks
and efficiencies: the step is then a non-negative sum of the same roofline terms, `FEATURES`,
each with a fitted cost per unit, so a profile alone (no hardware preset) sets step times.

All formulas take 2-D arrays, [steps, requests], so a run of decode steps is costed in one
vectorised call; a single batch is a run of one step.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# The terms of a calibrated step, per step: GEMM FLOPs (a memory-bound GEMM counts its bytes x the
# ridge point), attention FLOPs, K/V bytes read, tokens, requests, and 1.
FEATURES = ("linear_flops", "attention_flops", "kv_read_bytes", "num_tokens", "num_requests", "constant")


@dataclass(frozen=True)
class Calibration:
    """Seconds per unit of each of `FEATURES`, fitted to measured steps (see backends/profile.py).

    A GEMM's term is max(FLOPs, ridge_flops_per_byte x bytes): its roofline in FLOP units, so that
    one fitted seconds-per-FLOP covers both the memory-bound (small batch) and compute-bound side.
    Zero ridge makes the term proportional to the tokens through the linear layers.
    """

    coefficients: tuple[float, ...]  # seconds per unit, in FEATURES order
    ridge_flops_per_byte: float = 0.0
    dtype_bytes: int = 2  # of the K/V cache and weights the features count

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

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients))


def gemm_shapes(model: dict) -> list[tuple[int, int]]:
    """(in, out) features of each per-layer matmul: fused QKV, O, fused gate+up, down."""
    h, i, hd = model["hidden_size"], model["intermediate_size"], model["head_dim"]
    nh, nkv = model["num_attention_heads"], model["num_key_value_heads"]
    return [(h, (nh + 2 * nkv) * hd), (nh * hd, h), (h, 2 * i), (i, h)]


def step_features(model: dict, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray, dtype_bytes: int = 2,
                  ridge_flops_per_byte: float = 0.0) -> np.ndarray:
    """The calibrated model's terms, [steps, len(FEATURES)]. q, c: [steps, requests] query and context
    lengths (zero-padded); num_logits: [steps]. Each row depends only on its own step."""
    b, layers = dtype_bytes, model["num_hidden_layers"]
    h, v, hd = model["hidden_size"], model["vocab_size"], model["head_dim"]
    nh, nkv = model["num_attention_heads"], model["num_key_value_heads"]
    q = q.astype(np.float64)
    c = c.astype(np.float64)
    t = q.sum(axis=1)  # [steps]
    n = num_logits.astype(np.float64)
    r = ridge_flops_per_byte

    linear = np.zeros_like(t)
    for k_in, n_out in gemm_shapes(model):
        linear += np.maximum(2.0 * t * k_in * n_out, r * (k_in * n_out + t * (k_in + n_out)) * b)
    # The LM head runs (and reads its weights) only when some row needs logits.
    lm_head = np.where(n > 0, np.maximum(2.0 * n * h * v, r * ((h * v + n * h) * b + n * v * 4)), 0.0)
    attn_flops = 4.0 * nh * hd * (q * c - q * (q - 1) / 2)  # causal: see `breakdown`
    kv_read = c * 2 * nkv * hd * b
    return np.stack([
        layers * linear + lm_head,
        layers * attn_flops.sum(axis=1),
        layers * kv_read.sum(axis=1),
        t,
        (q > 0).sum(axis=1).astype(np.float64),
        np.ones_like(t),
    ], axis=1)


class CostModelBackend:
    name = "costmodel"
    supports_fast_forward = True

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
        if self.hardware is not None:
            self._flops_per_s = self.hardware["peak_flops"]
            self._bytes_per_s = self.hardware["memory_bandwidth"]

    def _roofline(self, flops, num_bytes, flops_efficiency: float):
        return np.maximum(flops / (self._flops_per_s * flops_efficiency),
                          num_bytes / (self._bytes_per_s * self.eff.memory))

    def breakdown(self, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> dict[str, np.ndarray]:
        """Seconds per operator for each step. q, c: [steps, requests] query and context lengths
        (zero-padded); num_logits: [steps] rows projected to the vocabulary."""
        if self.calibration is not None:
            return self._calibrated_breakdown(q, c, num_logits)
        m, b = self.model, self.dtype_bytes
        layers = m["num_hidden_layers"]
        h, i, hd, v = m["hidden_size"], m["intermediate_size"], m["head_dim"], m["vocab_size"]
        nh, nkv = m["num_attention_heads"], m["num_key_value_heads"]
        q = q.astype(np.float64)
        c = c.astype(np.float64)
        t = q.sum(axis=1)  # [steps] tokens in the step

        linear = np.zeros_like(t)
        for k_in, n_out in self._gemms:
            linear += self._roofline(2.0 * t * k_in * n_out, (k_in * n_out + t * (k_in + n_out)) * b, self.eff.gemm)

        # Causal attention of q new tokens at the end of a context of c: the j-th attends c - q + j + 1 keys.
        attn_flops = 4.0 * nh * hd * (q * c - q * (q - 1) / 2)
        attn_bytes = (c * 2 * nkv * hd + q * 2 * nh * hd) * b
        attention = self._roofline(attn_flops, attn_bytes, self.eff.attention).sum(axis=1)

        kv_write = t * 2 * nkv * hd * b / (self._bytes_per_s * self.eff.memory)
        # Two RMSNorms, two residual adds, RoPE on q and k, SiLU-and-multiply: reads and writes.
        elementwise_bytes = t * b * (4 * h + 4 * h + 2 * (nh + nkv) * hd + 3 * i)
        elementwise = elementwise_bytes / (self._bytes_per_s * self.eff.memory)

        n = num_logits.astype(np.float64)
        lm_head = self._roofline(2.0 * n * h * v, (h * v + n * h) * b + n * v * 4, self.eff.gemm)
        embedding = (t * h * b + n * h * 2 * b) / (self._bytes_per_s * self.eff.memory)
        return {
            "linear": layers * linear,
            "attention": layers * attention,
            "kv_write": layers * kv_write,
            "elementwise": layers * elementwise + embedding,
            "lm_head": lm_head,
            "overhead": np.full_like(t, self.eff.step_overhead_s),
        }

    def _calibrated_breakdown(self, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> dict[str, np.ndarray]:
        cal = self.calibration
        terms = step_features(self.model, q, c, num_logits, self.dtype_bytes, cal.ridge_flops_per_byte)
        terms = terms * np.asarray(cal.coefficients)  # [steps, features] seconds
        linear, attn_flops, kv_read, tokens, requests, constant = terms.T
        return {
            "linear": linear,  # with the LM head
            "attention": attn_flops + kv_read,
            "elementwise": tokens,
            "overhead": requests + constant,
        }

    def step_seconds(self, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
        parts = self.breakdown(q, c, num_logits)
        total = np.zeros_like(parts["overhead"])
        for value in parts.values():
            total = total + value
        return total

    def execute(self, batch: Batch) -> StepResult:
        q = np.asarray([batch.num_scheduled_tokens], dtype=np.int64)
        c = q + np.asarray([batch.num_computed_tokens], dtype=np.int64)
        num_logits = np.asarray([sum(batch.needs_logits)])
        parts = self.breakdown(q, c, num_logits)
        total = np.zeros(1)
        for value in parts.values():
            total = total + value
        return StepResult(float(total[0]), {k: float(v[0]) for k, v in parts.items()})

    def decode_run(self, context_lens: np.ndarray, num_steps: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Seconds and breakdown of `num_steps` decode-only steps of the same requests, whose
        contexts (after the first step) are `context_lens` and grow by one token per step. Each
        step's figures equal those `execute` gives for that step's batch (the engine's fast path
        relies on it)."""
        n = len(context_lens)
        c = context_lens[None, :] + np.arange(num_steps, dtype=np.int64)[:, None]
        q = np.ones((num_steps, n), dtype=np.int64)
        parts = self.breakdown(q, c, np.full(num_steps, n))
        total = np.zeros(num_steps)
        for value in parts.values():
            total = total + value
        return total, parts

    def decode_run_seconds(self, context_lens: np.ndarray, num_steps: int) -> np.ndarray:
        return self.decode_run(context_lens, num_steps)[0]
