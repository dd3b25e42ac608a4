"""The datasheet roofline of one Llama-style decoder step, on one GPU of a tensor-parallel engine.

Every operator takes max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)); the step
is their sum plus a fixed per-step overhead. Dense layers see all T tokens of the step; attention
is costed per request from its own query length q and context length c (a prefill chunk attends
causally, a decode is q = 1); the LM head runs only on the logits rows. A decode's attention is
memory-bound on every preset (its K/V are read once for one query), so the decodes of a step are
costed from their summed contexts.

Under tensor parallelism of degree T one GPU runs 1/T of the heads and of the MLP
(`ModelConfig.gemms`), its KV heads (at least one), its shard of the LM head's vocabulary, and two
all-reduces per layer (backends/costmodel/tensor_parallel.py); the GPUs run in lockstep, so one GPU's time is
the step's. `dtype` is the weights' (fp8: one byte per weight and the fp8 tensor cores' peak);
activations stay bf16; `kv_cache_dtype` fp8 stores K and V in one byte each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.costmodel.frame import CostModel, StepAggregates
from backends.costmodel.tensor_parallel import ACTIVATION_BYTES, gemm_seconds, tp_allreduce_seconds
from backends.hardware import Hardware
from backends.model_config import ModelConfig, kv_cache_dtype_bytes, linear_bytes
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


def window_pairs(q: int, c: int, window: int | None) -> int:
    """Query-key pairs of q new tokens at the end of a context of c under a causal mask, each token
    seeing at most `window` keys (itself included): sum of min(n, window) for n = c - q + 1 .. c."""
    a, b = c - q + 1, c
    if window is None or b <= window:
        return (a + b) * q // 2
    if a >= window:
        return q * window
    return (a + window) * (window - a + 1) // 2 + (b - window) * window


class MoERooflineCostModel(CostModel):
    """The datasheet roofline of a mixture-of-experts, MLA or sliding-window model's step, on one
    GPU of a tensor-parallel engine (expert-parallel over its TP GPUs with
    `enable_expert_parallel`). Every operator is max(FLOPs / (peak x efficiency), bytes /
    (bandwidth x efficiency)), as `RooflineCostModel`'s:

    - linear: attention's projections (GQA's QKV and O, or MLA's replicated latent down-projections,
      q_b, kv_b and O, and decode's absorbed W_UK/W_UV products in bf16), the dense MLPs of the first
      layers and the shared experts, split by TP, in the checkpoint's dtype (fp8 and block fp8 at
      the fp8 tensor cores' peak; MXFP4 and int4 weights are read at their size and computed in
      bf16, as Hopper's W4A16 kernels do);
    - router: the [hidden, experts] bf16 GEMM of every MoE layer;
    - moe: the routed experts' grouped GEMMs with top-k routing and tokens spread evenly over the
      experts: a GPU runs tokens x top-k / EP assignments through its experts' gate-up and down
      (intermediate / MoE TP wide) and reads the weights of the experts that receive a token
      (min(local experts, its assignments));
    - attention: per request; MLA's decode attends over the latent cache (kv_lora_rank +
      qk_rope_head_dim per token, one head: FLOPs 2 x heads x (2 x kv_lora_rank + qk_rope_head_dim)
      per key), MLA's prefill chunks attend in the heads' own dimensions after up-projecting their
      context's latents; a sliding-window layer attends over at most its window's keys;
    - kv_write, elementwise, lm_head, allreduce (two per layer, as the dense model's) and the
      step's overhead.
    Decodes are costed from their summed contexts when no layer slides (each decode's attention
    taken as its context length times the larger of its per-key FLOP and byte times); with sliding
    layers every request is costed on its own, and the engine does not fast-forward."""

    def __init__(self, model: ModelConfig, hardware: Hardware, efficiencies: Efficiencies | None = None,
                 tp: int = 1, dtype: str = "bf16", kv_cache_dtype: str = "auto", enable_expert_parallel: bool = False):
        kv_bytes = kv_cache_dtype_bytes(kv_cache_dtype, dtype)
        super().__init__(model, kv_bytes, hardware.description or hardware.name)
        model.check_parallel(tp, 1, enable_expert_parallel, dtype)
        hardware.check_tp(tp)
        self.hardware, self.tp, self.eff = hardware, tp, efficiencies or Efficiencies()
        self.weights_dtype, self.experts_dtype = model.linear_dtypes(dtype)
        self.dtype = f"{self.weights_dtype} weights, {self.experts_dtype} experts" + (
            "" if kv_cache_dtype == "auto" else " (fp8 KV cache)")
        self.moe_tp, self.ep = model.moe_parallel(tp, 1, enable_expert_parallel)
        self._bytes_s = hardware.memory_bandwidth * self.eff.memory
        self._flops_s = hardware.peak_bf16_flops
        self._heads = model.num_attention_heads // tp
        self._kv_heads = 1 if model.kv_lora_rank else model.num_kv_heads_per_gpu(tp)
        self._vocab = model.padded_vocab(tp)
        self._full_layers = model.num_hidden_layers - model.num_sliding_layers
        self._sliding_layers = model.num_sliding_layers
        self.decodes_from_sums = self.supports_fast_forward = self._sliding_layers == 0
        m, hd, nh = model, model.head_dim, self._heads
        att_flops_s = self._flops_s * self.eff.attention
        if m.kv_lora_rank:
            latent = m.kv_lora_rank + m.qk_rope_head_dim
            per_key_flops = 2.0 * nh * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
            per_key_bytes = latent * kv_bytes
            per_request_bytes = nh * (latent + m.kv_lora_rank) * ACTIVATION_BYTES
        else:
            per_key_flops = 4.0 * nh * hd
            per_key_bytes = 2 * self._kv_heads * hd * kv_bytes
            per_request_bytes = 2 * nh * hd * ACTIVATION_BYTES
        self._decode_s_per_context = m.num_hidden_layers * max(per_key_flops / att_flops_s,
                                                               per_key_bytes / self._bytes_s)
        self._decode_s_per_request = m.num_hidden_layers * per_request_bytes / self._bytes_s
        self._kv_token_bytes = m.kv_bytes_per_token(tp, kv_cache_dtype) // m.num_hidden_layers

    def _gemm(self, t, k: int, n: int, dtype: str, weight_fraction=1.0):
        """One GEMM of t rows; `weight_fraction` of its weights read (routed experts)."""
        peak = self.hardware.peak_flops("fp8" if dtype in ("fp8", "fp8-block") else "bf16") * self.eff.gemm
        flops = 2.0 * t * k * n
        num_bytes = weight_fraction * linear_bytes(k, n, dtype) + t * (k + n) * ACTIVATION_BYTES
        return np.maximum(flops / peak, num_bytes / self._bytes_s)

    def _attention_linear(self, t):
        m, w, nh, h = self.model, self.weights_dtype, self._heads, self.model.hidden_size
        if not m.kv_lora_rank:
            qkv = (nh + 2 * self._kv_heads) * m.head_dim
            return self._gemm(t, h, qkv, w) + self._gemm(t, nh * m.head_dim, h, w)
        rope, nope, v, kvr = m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            s = self._gemm(t, h, m.q_lora_rank + kvr + rope, w) + self._gemm(t, m.q_lora_rank, nh * (nope + rope), w)
        else:
            s = self._gemm(t, h, nh * (nope + rope), w) + self._gemm(t, h, kvr + rope, w)
        # W_UK (q_nope into the latent) and W_UV (latent out to v), bf16, per head.
        s = s + self._gemm(t, nope * nh, kvr, "bf16") + self._gemm(t, kvr, v * nh, "bf16")
        return s + self._gemm(t, nh * v, h, w)

    def dense(self, t: int, num_logits: int) -> tuple:
        """(linear, router, moe, kv_write, elementwise, lm_head, allreduce) seconds of t tokens."""
        linear, router, moe, kv_write, layers_elementwise, allreduce = self.dense_tokens(t)
        return (linear, router, moe, kv_write, self.elementwise_seconds(layers_elementwise, t, num_logits),
                self.lm_head_seconds(num_logits), allreduce)

    def dense_tokens(self, t) -> tuple:
        """The parts of `dense` that depend on the token count alone: (linear, router, moe, kv_write,
        the layers' elementwise seconds, allreduce)."""
        m, b, h = self.model, ACTIVATION_BYTES, self.model.hidden_size
        layers = m.num_hidden_layers
        linear = layers * self._attention_linear(t)
        mlp_width = 0.0
        if m.num_dense_mlp_layers:
            i = m.intermediate_size // self.tp
            linear = linear + m.num_dense_mlp_layers * (self._gemm(t, h, 2 * i, self.weights_dtype)
                                                        + self._gemm(t, i, h, self.weights_dtype))
            mlp_width += m.num_dense_mlp_layers * 3 * i
        router = moe = 0.0
        if m.num_experts:
            moe_layers = m.num_moe_layers
            router = moe_layers * self._gemm(t, h, m.num_experts, "bf16")
            if m.shared_expert_intermediate_size:
                s = m.shared_expert_intermediate_size // self.tp
                linear = linear + moe_layers * (self._gemm(t, h, 2 * s, self.weights_dtype)
                                                + self._gemm(t, s, h, self.weights_dtype))
                mlp_width += moe_layers * 3 * s
            i = m.moe_intermediate_size // self.moe_tp
            assignments = t * m.num_experts_per_tok / self.ep  # this GPU's (token, expert) pairs
            local = -(-m.num_experts // self.ep)
            active = np.minimum(local, assignments)  # experts that receive a token, tokens spread evenly
            moe = moe_layers * (self._gemm(assignments, h, 2 * i, self.experts_dtype, active)
                                + self._gemm(assignments, i, h, self.experts_dtype, active))
            mlp_width += moe_layers * 3 * i * m.num_experts_per_tok / self.ep
        kv_write = layers * t * self._kv_token_bytes / self._bytes_s
        q_k_width = (self._heads + self._kv_heads) * (m.qk_rope_head_dim if m.kv_lora_rank else m.head_dim)
        norms = 8 if m.sandwich_norms else 6
        layers_elementwise = (layers * t * b * (norms * h + 2 * q_k_width) + t * b * mlp_width) / self._bytes_s
        allreduce = float(tp_allreduce_seconds(m, t, self.tp, self.hardware)) if self.tp > 1 else 0.0
        return linear, router, moe, kv_write, layers_elementwise, allreduce

    def elementwise_seconds(self, layers_elementwise, t, num_logits):
        """A step's elementwise seconds: its layers' (`dense_tokens`), then the embedding rows' and
        the final norm's."""
        h, b = self.model.hidden_size, ACTIVATION_BYTES
        return layers_elementwise + (t * h * b + num_logits * h * 2 * b) / self._bytes_s

    def lm_head_seconds(self, num_logits) -> float:
        """The LM head on `num_logits` rows: bf16 weights, fp32 logits (0 without rows)."""
        if not num_logits:
            return 0.0
        h, b, v = self.model.hidden_size, ACTIVATION_BYTES, self._vocab
        return max(2.0 * num_logits * h * v / (self._flops_s * self.eff.gemm),
                   ((h * v + num_logits * h) * b + num_logits * v * 4) / self._bytes_s)

    def request_seconds(self, q: int, c: int) -> float:
        """One request's attention over all layers: q new tokens at the end of a context of c."""
        m = self.model
        total = 0.0
        for num_layers, window in ((self._full_layers, None), (self._sliding_layers, m.sliding_window)):
            if num_layers:
                total += num_layers * self._attention_one_layer(q, c, window)
        return total

    def _attention_one_layer(self, q: int, c: int, window: int | None) -> float:
        m, nh, kvb = self.model, self._heads, self.dtype_bytes
        pairs = window_pairs(q, c, window)
        keys = c if window is None else min(c, window + q - 1)
        att_flops_s = self._flops_s * self.eff.attention
        if m.kv_lora_rank:
            kvr, rope, nope, v = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
            latent_bytes = keys * (kvr + rope) * kvb
            if q == 1:  # absorbed: attends over the latents
                flops = 2.0 * nh * (2 * kvr + rope) * pairs
                num_bytes = latent_bytes + nh * (2 * kvr + rope) * ACTIVATION_BYTES
            else:  # the context's latents up-projected (kv_b_proj), then attention in the heads' dimensions
                flops = 2.0 * nh * (nope + rope + v) * pairs + 2.0 * (c - q) * kvr * nh * (nope + v)
                num_bytes = latent_bytes + q * nh * (nope + rope + v) * ACTIVATION_BYTES
        else:
            hd = m.head_dim
            flops = 4.0 * nh * hd * pairs
            num_bytes = keys * 2 * self._kv_heads * hd * kvb + q * 2 * nh * hd * ACTIVATION_BYTES
        return max(flops / att_flops_s, num_bytes / self._bytes_s)

    def parts(self, agg: StepAggregates, chunks: list[tuple[int, int]], dense: tuple) -> dict:
        linear, router, moe, kv_write, elementwise, lm_head, allreduce = dense
        others = sum(self.request_seconds(q, c) for q, c in chunks)
        if self.decodes_from_sums:
            attention = (agg.decode_sum_context * self._decode_s_per_context
                         + (agg.num_decodes * self._decode_s_per_request + others))
        else:
            attention = others
        parts = {"linear": linear}
        if self.model.num_experts:
            parts["router"], parts["moe"] = router, moe
        parts.update(attention=attention, kv_write=kv_write, elementwise=elementwise, lm_head=lm_head)
        if self.tp > 1:
            parts["allreduce"] = allreduce
        parts["overhead"] = self.eff.step_overhead_s
        return parts
