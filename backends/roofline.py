"""The datasheet roofline of one Llama-style decoder step.

Every operator takes max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)); the step
is their sum plus a fixed per-step overhead. Dense layers see all T tokens of the step; attention
is costed per request from its own query length q and context length c (a prefill chunk attends
causally, a decode is q = 1); the LM head runs only on the logits rows. A decode's attention is
memory-bound on every preset (its K/V are read once for one query), so the decodes of a step are
costed from their summed contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.costmodel import CostModel, StepAggregates
from backends.shapes import gemm_shapes
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


class RooflineCostModel(CostModel):
    def __init__(self, model: dict, hardware: dict, efficiencies: Efficiencies | None = None, dtype_bytes: int = 2):
        super().__init__(model, dtype_bytes, hardware["description"])
        self.hardware = hardware
        self.eff = efficiencies or Efficiencies()
        self._gemms = gemm_shapes(model)
        m, b = model, dtype_bytes
        hd, nh, nkv, layers = m["head_dim"], m["num_attention_heads"], m["num_key_value_heads"], m["num_hidden_layers"]
        self._flops_s = hardware["peak_flops"]
        self._bytes_s = hardware["memory_bandwidth"] * self.eff.memory
        # Seconds per context token of one decode's attention, as FLOPs and as bytes.
        decode_flops_s = 4.0 * nh * hd / (self._flops_s * self.eff.attention)
        decode_bytes_s = 2 * nkv * hd * b / self._bytes_s
        self.decodes_from_sums = self.supports_fast_forward = decode_bytes_s >= decode_flops_s
        # A memory-bound decode's attention over all layers: per token of context (its K/V) and per
        # decode (its q and output rows).
        self._decode_s_per_context = layers * (2 * nkv * hd) * b / self._bytes_s
        self._decode_s_per_request = layers * (2 * nh * hd) * b / self._bytes_s

    def _gemm_roofline(self, tokens: int) -> float:
        b = self.dtype_bytes
        total = 0.0
        for k_in, n_out in self._gemms:
            total += max(2.0 * tokens * k_in * n_out / (self._flops_s * self.eff.gemm),
                         (k_in * n_out + tokens * (k_in + n_out)) * b / self._bytes_s)
        return total

    def attention_roofline(self, q: int, c: int) -> float:
        """One request's attention in one layer: q new tokens at the end of a context of c attend
        causally (the j-th sees c - q + j + 1 keys)."""
        m, b = self.model, self.dtype_bytes
        hd, nh, nkv = m["head_dim"], m["num_attention_heads"], m["num_key_value_heads"]
        flops = 4.0 * nh * hd * (q * c - q * (q - 1) // 2)
        num_bytes = (c * 2 * nkv * hd + q * 2 * nh * hd) * b
        return max(flops / (self._flops_s * self.eff.attention), num_bytes / self._bytes_s)

    def dense(self, t: int, num_logits: int) -> tuple[float, float, float, float]:
        """(linear, kv_write, elementwise, lm_head) seconds of a step of t tokens."""
        m, b = self.model, self.dtype_bytes
        layers, h, i, v = m["num_hidden_layers"], m["hidden_size"], m["intermediate_size"], m["vocab_size"]
        hd, nh, nkv = m["head_dim"], m["num_attention_heads"], m["num_key_value_heads"]
        linear = layers * self._gemm_roofline(t)
        kv_write = layers * (t * 2 * nkv * hd * b / self._bytes_s)
        # Two RMSNorms, two residual adds, RoPE on q and k, SiLU-and-multiply; the embedding rows.
        elementwise = (layers * (t * b * (8 * h + 2 * (nh + nkv) * hd + 3 * i) / self._bytes_s)
                       + (t * h * b + num_logits * h * 2 * b) / self._bytes_s)
        lm_head = 0.0
        if num_logits:
            lm_head = max(2.0 * num_logits * h * v / (self._flops_s * self.eff.gemm),
                          ((h * v + num_logits * h) * b + num_logits * v * 4) / self._bytes_s)
        return linear, kv_write, elementwise, lm_head

    def parts(self, agg: StepAggregates, chunks: list[tuple[int, int]], dense: tuple) -> dict:
        linear, kv_write, elementwise, lm_head = dense
        others = sum(self.attention_roofline(q, c) for q, c in chunks)
        layers_others = self.model["num_hidden_layers"] * others
        if self.decodes_from_sums:
            attention = (agg.decode_sum_context * self._decode_s_per_context
                         + (agg.num_decodes * self._decode_s_per_request + layers_others))
        else:  # every request, decodes too, is in `chunks`
            attention = layers_others
        return {"linear": linear, "attention": attention, "kv_write": kv_write, "elementwise": elementwise,
                "lm_head": lm_head, "overhead": self.eff.step_overhead_s}
