"""The cost-model backend: a per-operator roofline of one Llama-style decoder step.

Every operator takes max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)); the
step is their sum plus a fixed per-step overhead. Dense layers see all T tokens of the step;
attention is costed per request from its own query length q and context length c (a prefill
chunk attends causally, a decode is q = 1); the LM head runs only on the logits rows.

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


class CostModelBackend:
    name = "costmodel"
    supports_fast_forward = True

    def __init__(self, model: str, hardware: str, efficiencies: Efficiencies | None = None, dtype_bytes: int = 2):
        self.model_name, self.hardware_name = model, hardware
        self.model = get_model(model)
        self.hardware = get_hardware(hardware)
        self.eff = efficiencies or Efficiencies()
        self.dtype_bytes = dtype_bytes
        m = self.model
        h, i, hd = m["hidden_size"], m["intermediate_size"], m["head_dim"]
        nh, nkv = m["num_attention_heads"], m["num_key_value_heads"]
        # (in, out) features of each per-layer matmul: fused QKV, O, fused gate+up, down.
        self._gemms = [(h, (nh + 2 * nkv) * hd), (nh * hd, h), (h, 2 * i), (i, h)]
        self._flops_per_s = self.hardware["peak_flops"]
        self._bytes_per_s = self.hardware["memory_bandwidth"]

    def _roofline(self, flops, num_bytes, flops_efficiency: float):
        return np.maximum(flops / (self._flops_per_s * flops_efficiency),
                          num_bytes / (self._bytes_per_s * self.eff.memory))

    def breakdown(self, q: np.ndarray, c: np.ndarray, num_logits: np.ndarray) -> dict[str, np.ndarray]:
        """Seconds per operator for each step. q, c: [steps, requests] query and context lengths
        (zero-padded); num_logits: [steps] rows projected to the vocabulary."""
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

    def decode_run_seconds(self, context_lens: np.ndarray, num_steps: int) -> np.ndarray:
        """Seconds of `num_steps` decode-only steps of the same requests, whose contexts (after
        the first step) are `context_lens` and grow by one token per step."""
        n = len(context_lens)
        c = context_lens[None, :] + np.arange(num_steps, dtype=np.int64)[:, None]
        q = np.ones((num_steps, n), dtype=np.int64)
        return self.step_seconds(q, c, np.full(num_steps, n))
