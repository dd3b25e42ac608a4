"""The datasheet roofline of one Llama-style decoder step, on one GPU of a tensor-parallel engine.

Every operator takes max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)); the step
is their sum plus a fixed per-step overhead. Dense layers see all T tokens of the step; attention
is costed per request from its own query length q and context length c (a prefill chunk attends
causally, a decode is q = 1); the LM head runs only on the logits rows. A decode's attention is
memory-bound on every preset (its K/V are read once for one query), so the decodes of a step are
costed from their summed contexts.

Under tensor parallelism of degree T one GPU runs 1/T of the heads and of the MLP
(`ModelConfig.gemms`), its KV heads (at least one), its shard of the LM head's vocabulary, and two
all-reduces per layer (backends/tensor_parallel.py); the GPUs run in lockstep, so one GPU's time is
the step's. `dtype` is the weights' (fp8: one byte per weight and the fp8 tensor cores' peak);
activations stay bf16; `kv_cache_dtype` fp8 stores K and V in one byte each.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.costmodel import CostModel, StepAggregates
from backends.hardware import Hardware
from backends.model_config import ModelConfig, kv_cache_dtype_bytes
from backends.tensor_parallel import ACTIVATION_BYTES, gemm_seconds, tp_allreduce_seconds
from sim.errors import ServesimError


@dataclass(frozen=True)
class Efficiencies:
    """Fractions of the datasheet peaks that each kind of operator reaches."""

    gemm: float = 0.7  # dense matmuls (of the weights' dtype)
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
    def __init__(self, model: ModelConfig, hardware: Hardware, efficiencies: Efficiencies | None = None,
                 tp: int = 1, dtype: str = "bf16", kv_cache_dtype: str = "auto"):
        kv_bytes = kv_cache_dtype_bytes(kv_cache_dtype, dtype)
        super().__init__(model, kv_bytes, hardware.description or hardware.name)
        model.check_tp(tp)
        hardware.check_tp(tp)
        self.hardware, self.tp, self.weights_dtype = hardware, tp, dtype
        self.dtype = {"bf16": "bfloat16", "fp8": "float8"}[dtype] + ("" if kv_cache_dtype == "auto" else
                                                                      " (fp8 KV cache)")
        self.eff = efficiencies or Efficiencies()
        self._gemms = model.gemms(tp)
        self._heads = model.num_attention_heads // tp
        self._kv_heads = model.num_kv_heads_per_gpu(tp)
        self._vocab = model.padded_vocab(tp)  # the LM head's rows on this GPU
        hd, layers = model.head_dim, model.num_hidden_layers
        self._gemm_flops_s = hardware.peak_flops(dtype) * self.eff.gemm
        self._flops_s = hardware.peak_bf16_flops  # attention and the bf16 LM head
        self._bytes_s = hardware.memory_bandwidth * self.eff.memory
        # Seconds per context token of one decode's attention, as FLOPs and as bytes.
        decode_flops_s = 4.0 * self._heads * hd / (self._flops_s * self.eff.attention)
        decode_bytes_s = 2 * self._kv_heads * hd * kv_bytes / self._bytes_s
        self.decodes_from_sums = self.supports_fast_forward = decode_bytes_s >= decode_flops_s
        # A memory-bound decode's attention over all layers: per token of context (its K/V) and per
        # decode (its q and output rows).
        self._decode_s_per_context = layers * (2 * self._kv_heads * hd) * kv_bytes / self._bytes_s
        self._decode_s_per_request = layers * (2 * self._heads * hd) * ACTIVATION_BYTES / self._bytes_s

    def attention_roofline(self, q: int, c: int) -> float:
        """One request's attention in one layer: q new tokens at the end of a context of c attend
        causally (the j-th sees c - q + j + 1 keys)."""
        hd, nh, nkv = self.model.head_dim, self._heads, self._kv_heads
        flops = 4.0 * nh * hd * (q * c - q * (q - 1) // 2)
        num_bytes = c * 2 * nkv * hd * self.dtype_bytes + q * 2 * nh * hd * ACTIVATION_BYTES
        return max(flops / (self._flops_s * self.eff.attention), num_bytes / self._bytes_s)

    def dense(self, t: int, num_logits: int) -> tuple[float, float, float, float, float]:
        """(linear, kv_write, elementwise, lm_head, allreduce) seconds of a step of t tokens."""
        m, b, kv_b = self.model, ACTIVATION_BYTES, self.dtype_bytes
        layers, h, hd = m.num_hidden_layers, m.hidden_size, m.head_dim
        nh, nkv, i, v = self._heads, self._kv_heads, m.intermediate_size // self.tp, self._vocab
        linear = 0.0
        for gemm in self._gemms:
            linear += gemm_seconds(t, gemm, self.weights_dtype, self._gemm_flops_s, self._bytes_s)
        linear = layers * linear
        kv_write = layers * (t * 2 * nkv * hd * kv_b / self._bytes_s)
        # Two RMSNorms, two residual adds, RoPE on q and k, SiLU-and-multiply; the embedding rows.
        elementwise = (layers * (t * b * (8 * h + 2 * (nh + nkv) * hd + 3 * i) / self._bytes_s)
                       + (t * h * b + num_logits * h * 2 * b) / self._bytes_s)
        lm_head = 0.0
        if num_logits:  # bf16 weights (quantised checkpoints keep the LM head unquantised), fp32 logits
            lm_head = max(2.0 * num_logits * h * v / (self._flops_s * self.eff.gemm),
                          ((h * v + num_logits * h) * b + num_logits * v * 4) / self._bytes_s)
        allreduce = float(tp_allreduce_seconds(m, t, self.tp, self.hardware)) if self.tp > 1 else 0.0
        return linear, kv_write, elementwise, lm_head, allreduce

    def parts(self, agg: StepAggregates, chunks: list[tuple[int, int]], dense: tuple) -> dict:
        linear, kv_write, elementwise, lm_head, allreduce = dense
        others = sum(self.attention_roofline(q, c) for q, c in chunks)
        layers_others = self.model.num_hidden_layers * others
        if self.decodes_from_sums:
            attention = (agg.decode_sum_context * self._decode_s_per_context
                         + (agg.num_decodes * self._decode_s_per_request + layers_others))
        else:  # every request, decodes too, is in `chunks`
            attention = layers_others
        parts = {"linear": linear, "attention": attention, "kv_write": kv_write, "elementwise": elementwise,
                 "lm_head": lm_head}
        if self.tp > 1:
            parts["allreduce"] = allreduce
        parts["overhead"] = self.eff.step_overhead_s
        return parts
