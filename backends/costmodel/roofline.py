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

from backends.costmodel.frame import CostModel, StepAggregates, batch_aggregates
from backends.costmodel.tensor_parallel import (
    ACTIVATION_BYTES,
    collective_latency_s,
    gemm_seconds,
    tp_allreduce_seconds,
)
from backends.hardware import Hardware
from backends.model_config import ModelConfig, kv_cache_dtype_bytes, linear_bytes
from sim.backend import StepResult
from sim.config import is_blackwell
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


ACTIVATION_TOPK_BYTES = 4 + 4  # a top-k weight (fp32) and id (int32) per (token, expert)


def fp4_native(hardware_name: str) -> bool:
    """Whether the GPU has fp4 tensor cores for NVFP4 weights and activations (Blackwell: the data-centre
    parts, SM 10x, and the RTX PRO 6000, SM 12.0). Elsewhere (Hopper, Ada, Ampere) vLLM serves an NVFP4
    checkpoint weight-only: the 4-bit weights are dequantized to bf16 inside the Marlin kernel and
    multiplied on bf16 tensor cores (vllm/model_executor/layers/quantization/utils/marlin_utils_fp4.py,
    "Weight-only FP4 compression will be used leveraging the Marlin kernel")."""
    return is_blackwell(hardware_name) or hardware_name.lower().replace(" ", "_").startswith("rtx_pro_6000")


def dp_gathered_tokens(tokens_across_dp: list[int], chunks_per_rank: int = 1) -> int:
    """Tokens each GPU holds after the dispatch all-gather: every rank's, or under sequence-parallel
    MoE each of a rank's `chunks_per_rank` (its TP) GPUs' ceil(t / tp) chunk (vLLM's
    sequence_parallel_chunk pads a rank's tokens to a multiple of TP)."""
    return sum(chunks_per_rank * -(-t // chunks_per_rank) for t in tokens_across_dp)


def dispatch_bytes(num_tokens: int, hidden: int, topk: int) -> int:
    """The bytes `AgRsAll2AllManager.dispatch` gathers on each GPU: N tokens' hidden states (bf16),
    top-k weights (fp32) and top-k ids (int32)."""
    return num_tokens * (hidden * ACTIVATION_BYTES + topk * ACTIVATION_TOPK_BYTES)


def combine_bytes(num_tokens: int, hidden: int) -> int:
    """The bytes `AgRsAll2AllManager.combine` reduce-scatters from each GPU: N tokens' MoE output (bf16)."""
    return num_tokens * hidden * ACTIVATION_BYTES


def ring_seconds(hardware: Hardware, num_bytes: float, num_gpus: int, span: int | None = None) -> float:
    """A ring all-gather or reduce-scatter among `num_gpus` GPUs moving `num_bytes` in all: each GPU
    sends and receives (n - 1) / n of it over its link (the network between nodes where the group
    crosses nodes and that is slower: `Hardware.group_link`), plus its fixed time: 5 us over NVLink,
    a launch and n - 1 hops over PCIe (`collective_latency_s`). `span`: how many GPUs the group's
    members lie among (a DP group's stand TP apart: tp x dp), which decides whether it crosses nodes."""
    bandwidth = hardware.group_link(max(num_gpus, span or 0), members=num_gpus)[1] or hardware.nvlink_bandwidth
    return ((num_gpus - 1) / num_gpus * num_bytes / bandwidth
            + collective_latency_s(hardware.link, num_gpus, num_gpus - 1))


def window_pairs(q: int, c: int, window: int | None) -> int:
    """Query-key pairs of q new tokens at the end of a context of c under a causal mask, each token
    seeing at most `window` keys (itself included): sum of min(n, window) for n = c - q + 1 .. c."""
    a, b = c - q + 1, c
    if window is None or b <= window:
        return (a + b) * q // 2
    if a >= window:
        return q * window
    return (a + window) * (window - a + 1) // 2 + (b - window) * window


def chunk_pieces(q: int, c: int, chunk: int) -> list[tuple[int, int]]:
    """q new tokens at the end of a context of c under chunked local attention of `chunk` positions,
    as vLLM runs them: each token attends to the tokens of its own chunk up to itself, and the
    backend splits a request's queries at the chunk boundaries into virtual requests, each a full
    attention over its chunk's tokens so far (make_local_attention_virtual_batches,
    vllm/v1/attention/backends/utils.py). The pieces as (new tokens, context within the chunk):
    a decode at context c is (1, (c - 1) % chunk + 1)."""
    pieces = []
    start = c - q
    while start < c:
        base = start // chunk * chunk
        end = min(c, base + chunk)
        pieces.append((end - start, end - base))
        start = end
    return pieces


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
      context's latents; a sliding-window layer attends over at most its window's keys; a
      chunked-local layer (Llama 4) over its chunk's, each piece of a request within one chunk
      priced as a full attention over the chunk's tokens so far (`chunk_pieces`, as vLLM runs it);
    - kv_write, elementwise, lm_head, allreduce (two per layer, as the dense model's) and the
      step's overhead.
    Decodes are costed from their summed contexts when no layer slides (each decode's attention
    taken as its context length times the larger of its per-key FLOP and byte times); with sliding
    or chunked layers every request is costed on its own, and the engine does not fast-forward."""

    def __init__(self, model: ModelConfig, hardware: Hardware, efficiencies: Efficiencies | None = None,
                 tp: int = 1, dtype: str = "bf16", kv_cache_dtype: str = "auto", enable_expert_parallel: bool = False,
                 dp: int = 1):
        kv_bytes = kv_cache_dtype_bytes(kv_cache_dtype, dtype)
        super().__init__(model, kv_bytes, hardware.description or hardware.name)
        model.check_parallel(tp, dp, enable_expert_parallel, dtype)
        hardware.check_tp(tp)
        self.hardware, self.tp, self.eff = hardware, tp, efficiencies or Efficiencies()
        self.weights_dtype, self.experts_dtype = model.linear_dtypes(dtype)
        self.dtype = f"{self.weights_dtype} weights, {self.experts_dtype} experts" + (
            "" if kv_cache_dtype == "auto" else " (fp8 KV cache)")
        self.moe_tp, self.ep = model.moe_parallel(tp, dp, enable_expert_parallel)
        self.dp = dp
        # vLLM's MoE all-to-all group (module `dp_moe_parts`): the EP group of tp x dp GPUs under
        # sequence-parallel MoE (EP, TP > 1 and DP > 1: ParallelConfig.use_sequence_parallel_moe),
        # else the DP group (AgRsAll2AllManager._get_comm_group).
        self.sequence_parallel_moe = bool(model.num_experts) and enable_expert_parallel and tp > 1 and dp > 1
        self.moe_group = tp * dp if self.sequence_parallel_moe else dp
        # The GPUs the group's members lie among: a DP group's stand tp apart (DP rank r's TP rank i
        # is GPU r x tp + i), so it crosses nodes where the engine's tp x dp GPUs do.
        self.moe_span = tp * dp
        self._bytes_s = hardware.memory_bandwidth * self.eff.memory
        self._flops_s = hardware.peak_bf16_flops
        self._heads = model.num_attention_heads // tp
        self._kv_heads = 1 if model.kv_lora_rank else model.num_kv_heads_per_gpu(tp)
        self._vocab = model.padded_vocab(tp)
        # (a DeciLM layer without attention attends nothing: `num_attention_layers`)
        self._full_layers = model.num_attention_layers - model.num_sliding_layers - model.num_chunked_layers
        self._sliding_layers = model.num_sliding_layers
        self._chunked_layers = model.num_chunked_layers
        self.decodes_from_sums = self.supports_fast_forward = not (self._sliding_layers or self._chunked_layers
                                                                   or model.index_topk)
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
        self._decode_s_per_context = m.num_attention_layers * max(per_key_flops / att_flops_s,
                                                                  per_key_bytes / self._bytes_s)
        self._decode_s_per_request = m.num_attention_layers * per_request_bytes / self._bytes_s
        self._kv_token_bytes = m.kv_bytes_per_token(tp, kv_cache_dtype)  # every layer's that keeps a cache
        self._fp4_native = fp4_native(hardware.name)

    def _gemm(self, t, k: int, n: int, dtype: str, weight_fraction=1.0):
        """One GEMM of t rows; `weight_fraction` of its weights read (routed experts)."""
        # (nvfp4, W4A4 where the GPU has fp4 tensor cores: taken at fp8's rate, as the hardware files state no
        # fp4 peak; elsewhere vLLM runs it weight-only with Marlin, bf16 tensor cores: `fp4_native`)
        fast = ("fp8", "fp8-block", "nvfp4") if self._fp4_native else ("fp8", "fp8-block")
        peak = self.hardware.peak_flops("fp8" if dtype in fast else "bf16") * self.eff.gemm
        flops = 2.0 * t * k * n
        num_bytes = weight_fraction * linear_bytes(k, n, dtype) + t * (k + n) * ACTIVATION_BYTES
        return np.maximum(flops / peak, num_bytes / self._bytes_s)

    def _attention_linear(self, t, indexer: bool = False):
        """One layer's attention projections for t tokens; with `indexer`, a sparse-attention layer's
        indexer's too (`_indexer_linear`)."""
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
        if indexer:
            s = s + self._indexer_linear(t)
        return s + self._gemm(t, nh * v, h, w)

    def _indexer_linear(self, t):
        """The lightning indexer's projections in a layer that runs one: its wq_b (checkpoint dtype)
        and its fused wk + weights_proj (bf16), replicated on every GPU."""
        m, h = self.model, self.model.hidden_size
        return (self._gemm(t, m.q_lora_rank or h, m.index_n_heads * m.index_head_dim, self.weights_dtype)
                + self._gemm(t, h, m.index_head_dim + m.index_n_heads, "bf16"))

    def _attention_linear_all(self, t):
        """Every layer's attention projections for t tokens, the indexers' where layers run them."""
        m = self.model
        own = m.num_indexer_layers
        if not m.index_topk or own == m.num_hidden_layers:  # every layer alike (that has attention)
            return m.num_attention_layers * self._attention_linear(t, indexer=bool(m.index_topk))
        return m.num_hidden_layers * self._attention_linear(t) + own * self._indexer_linear(t)

    def dense(self, t: int, num_logits: int) -> tuple:
        """(linear, router, moe, kv_write, elementwise, lm_head, allreduce) seconds of t tokens."""
        linear, router, moe, kv_write, layers_elementwise, allreduce = self.dense_tokens(t)
        return (linear, router, moe, kv_write, self.elementwise_seconds(layers_elementwise, t, num_logits),
                self.lm_head_seconds(num_logits), allreduce)

    def dense_tokens(self, t) -> tuple:
        """The parts of `dense` that depend on the token count alone: (linear, router, moe, kv_write,
        the layers' elementwise seconds, allreduce)."""
        m, b, h = self.model, ACTIVATION_BYTES, self.model.hidden_size
        linear = self._attention_linear_all(t)
        mlp_width = 0.0
        for width, num_layers in m.dense_mlp_widths.items():  # (DeciLM: each width its own GEMMs)
            i = width // self.tp
            linear = linear + num_layers * (self._gemm(t, h, 2 * i, self.weights_dtype)
                                            + self._gemm(t, i, h, self.weights_dtype))
            mlp_width += num_layers * 3 * i
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
            moe = self._dense_moe(t)
            mlp_width += moe_layers * 3 * i * m.num_experts_per_tok / self.ep
        kv_write = t * self._kv_token_bytes / self._bytes_s
        q_k_width = (self._heads + self._kv_heads) * (m.qk_rope_head_dim if m.kv_lora_rank else m.head_dim)
        norms = 8 if m.sandwich_norms else 6
        # (the norms' passes per sublayer, RoPE's in the attention layers: a DeciLM layer may lack either)
        layers_elementwise = (t * b * (m.num_sublayers * norms // 2 * h + m.num_attention_layers * 2 * q_k_width)
                              + t * b * mlp_width) / self._bytes_s
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

    def _dense_moe(self, t):
        """`dense`'s moe: this step's tokens, every DP rank as loaded as this one."""
        return self.moe_seconds(t) if self.dp == 1 else self.lockstep_moe_seconds(t)

    def moe_seconds(self, t):
        """The routed experts of every MoE layer on one GPU for t tokens entering the fused-MoE
        kernel (a DP group's: every rank's tokens, gathered)."""
        m, h = self.model, self.model.hidden_size
        i = m.moe_intermediate_size // self.moe_tp
        assignments = t * m.num_experts_per_tok / self.ep  # this GPU's (token, expert) pairs
        local = -(-m.num_experts // self.ep)
        active = np.minimum(local, assignments)  # experts that receive a token, tokens spread evenly
        return m.num_moe_layers * (self._gemm(assignments, h, 2 * i, self.experts_dtype, active)
                                   + self._gemm(assignments, i, h, self.experts_dtype, active))

    # ---- the MoE layer of a DP group's lockstep step (sim/data_parallel.py)

    def dispatch_seconds(self, num_bytes: float) -> float:
        """One all-gather of `num_bytes` (gathered on each GPU) over the MoE group: a ring over the link."""
        return ring_seconds(self.hardware, num_bytes, self.moe_group, self.moe_span)

    def combine_seconds(self, num_bytes: float) -> float:
        """One reduce-scatter of `num_bytes` (each GPU's input) over the MoE group: a ring over the link."""
        return ring_seconds(self.hardware, num_bytes, self.moe_group, self.moe_span)

    def dp_moe_parts(self, tokens_across_dp: list[int]) -> dict[str, float]:
        """The MoE layers of one lockstep step of a DP group whose rank r runs tokens_across_dp[r]
        tokens (an idle rank's dummy batch: 1; after vLLM's DP padding, `dp_padded_tokens`), priced as
        vLLM's default all2all backend, `allgather_reducescatter`, runs them
        (vllm/config/parallel.py `all2all_backend`; vllm/distributed/device_communicators/all2all.py
        `AgRsAll2AllManager.dispatch` / `.combine`, called from
        vllm/model_executor/layers/fused_moe/prepare_finalize/naive_dp_ep.py
        `MoEPrepareAndFinalizeNaiveDPEP.prepare` / `.finalize`):

        - dispatch: `all_gatherv` over the MoE group of each member's hidden states (bf16), top-k
          weights (fp32) and top-k ids (int32). The group is the DP group (one GPU per rank), or,
          under sequence-parallel MoE (EP with TP > 1 and DP > 1), the EP group of tp x dp GPUs,
          each sending its 1/tp chunk of its rank's tokens (`sequence_parallel_chunk`: ceil(t / tp));
          every GPU then holds all N gathered tokens (`dp_gathered_tokens`);
        - moe: the fused-MoE kernel of the GPU's experts (MoE TP or EP over tp x dp) over the N tokens;
        - combine: `reduce_scatterv` of the MoE output, N tokens x hidden in bf16, back to each member.

        Each is summed over the MoE layers; dispatch and combine by `dispatch_seconds` and
        `combine_seconds` (this roofline: a ring over the link; the table model: NCCL's tables)."""
        m, h = self.model, self.model.hidden_size
        n = dp_gathered_tokens(tokens_across_dp, self.tp if self.sequence_parallel_moe else 1)
        layers = m.num_moe_layers
        return {"moe": float(self.moe_seconds(max(n, 1))),
                "dispatch": layers * float(self.dispatch_seconds(dispatch_bytes(n, h, m.num_experts_per_tok))),
                "combine": layers * float(self.combine_seconds(combine_bytes(n, h)))}

    def lockstep_moe_seconds(self, t: int) -> float:
        """The MoE layers' seconds (kernel, dispatch and combine) of a step of t tokens on every DP
        rank: what a DP deployment's rank pays when the ranks are equally loaded."""
        if not t:
            return 0.0
        parts = self.dp_moe_parts([t] * self.dp)
        return parts["moe"] + parts["dispatch"] + parts["combine"]

    def execute_in_lockstep(self, batch, moe_parts: dict[str, float]) -> StepResult:
        """One DP rank's step in a lockstep step: its own batch's parts, with the MoE layers'
        (`dp_moe_parts` of every rank's tokens) in place of its own tokens' `moe`."""
        agg, chunks = batch_aggregates(batch.num_scheduled_tokens, batch.num_computed_tokens, sum(batch.needs_logits),
                                       every_request=not self.decodes_from_sums)
        own = self.parts(agg, chunks, self._dense(agg.num_tokens, agg.num_logits))
        parts: dict = {}
        for key, value in own.items():
            if key == "moe":
                parts.update(moe_parts)
            else:
                parts[key] = value
        return StepResult(float(self.total(parts)), {k: float(v) for k, v in parts.items()})

    def request_seconds(self, q: int, c: int) -> float:
        """One request's attention over all layers: q new tokens at the end of a context of c."""
        m = self.model
        total = 0.0
        for num_layers, window in ((self._full_layers, None), (self._sliding_layers, m.sliding_window)):
            if num_layers:
                total += num_layers * self._attention_one_layer(q, c, window)
        if self._chunked_layers:
            total += self._chunked_layers * sum(self._attention_one_layer(qi, ci, None)
                                                for qi, ci in chunk_pieces(q, c, m.attention_chunk_size))
        return total

    def _attention_one_layer(self, q: int, c: int, window: int | None) -> float:
        m, nh, kvb = self.model, self._heads, self.dtype_bytes
        if m.index_topk and (q == 1 or c > m.index_topk):
            return self._sparse_attention_one_layer(q, c)
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

    def _sparse_attention_one_layer(self, q: int, c: int) -> float:
        """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5), one layer, q new tokens at the end of a
        context of c, as vLLM runs it (vllm/models/deepseek_v32/attention.py): the lightning indexer
        scores every earlier key for each new token (index_n_heads heads of index_head_dim over the
        fp8 keys of its cache, at the fp8 peak, then a top-k over the scores; the indexer is
        replicated, so every TP GPU scores all its heads), and MLA attends in the latent space over
        the index_topk keys picked (queries absorbed into 576-wide keys and 512-wide values, sparse
        decode and prefill alike: pairs sum(min(position, index_topk))). A prefill whose context is
        within index_topk is vLLM's dense MHA prefill without the indexer (sparse_mla_attention.py,
        `_use_dense_mha_prefill`), priced as MLA's (`_attention_one_layer`). The mean layer: where
        some layers reuse an earlier layer's top-k instead of running their own indexer (GLM-5.2's
        index_topk_freq), the indexer's seconds count in the layers that run it (`_indexer_share`)."""
        return self._indexer_share * self._indexer_one_layer(q, c) + self._sparse_attend_one_layer(q, c)

    def _sparse_attend_one_layer(self, q: int, c: int) -> float:
        """MLA's attention over the index_topk keys picked, one layer (`_sparse_attention_one_layer`)."""
        m, nh, kvb = self.model, self._heads, self.dtype_bytes
        kvr, rope = m.kv_lora_rank, m.qk_rope_head_dim
        att_flops_s = self._flops_s * self.eff.attention
        pairs = window_pairs(q, c, m.index_topk)
        keys = min(c, q * m.index_topk)  # the latents the picks gather
        latent = m.sparse_latent_bytes("fp8" if kvb == 1 else "auto")
        return max(2.0 * nh * (2 * kvr + rope) * pairs / att_flops_s,
                   (keys * latent + q * nh * (2 * kvr + rope) * ACTIVATION_BYTES) / self._bytes_s)

    def _sparse_module_layers(self, chunks: list[tuple[int, int]]) -> float:
        """How many layers a measured DSA layer's seconds count for over these requests ((q, c) each:
        one batch of decodes, or one of prefill chunks, as the module tables measure them). The
        tables time a layer that runs its own indexer; a layer that reuses an earlier one's top-k
        (GLM-5.2's index_topk_freq) runs the same module without the indexer's projections, scoring
        and top-k, and is carried from the measured one by the roofline's ratio of the two layers'
        seconds for the same requests (its projections and attention, with and without the
        indexer's). Every layer its own indexer: the layers, as they are."""
        m = self.model
        own = m.num_indexer_layers
        if not m.index_topk or own == m.num_hidden_layers:
            return float(m.num_hidden_layers)
        t = sum(q for q, _ in chunks)
        shared = float(self._attention_linear(t))
        full = shared + float(self._indexer_linear(t))
        for attend, indexer in self._sparse_layer_parts(chunks, decodes=False):  # (a batch of one kind)
            shared += attend
            full += attend + indexer
        return own + (m.num_hidden_layers - own) * shared / full

    def _sparse_layer_parts(self, chunks: list[tuple[int, int]], decodes: bool):
        """Each request's (attention, indexer) seconds in one layer that runs its own indexer, the
        step's prefills dense or sparse together as vLLM decides them (sparse_mla_attention.py,
        `_use_dense_mha_prefill`): dense MHA where the longest prefill's sequence is within
        index_topk, else all sparse; its indexer skips a dense prefill only in a step without
        decodes (sparse_attn_indexer.py), so beside decodes (`decodes`) its keys are scored too."""
        dense = max((c for q, c in chunks if q > 1), default=0) <= self.model.index_topk
        for q, c in chunks:
            if q == 1 or not dense:
                yield self._sparse_attend_one_layer(q, c), self._indexer_one_layer(q, c)
            else:
                yield self._attention_one_layer(q, c, None), (self._indexer_one_layer(q, c) if decodes else 0.0)

    @property
    def _indexer_share(self) -> float:
        """The share of a sparse-attention model's layers that run their own indexer (1: all)."""
        m = self.model
        return m.num_indexer_layers / m.num_hidden_layers

    def _indexer_one_layer(self, q: int, c: int) -> float:
        """The lightning indexer of one layer scoring every earlier key for q new tokens at the end of
        a context of c (`_sparse_attention_one_layer`)."""
        m = self.model
        scored = window_pairs(q, c, None)  # every key up to each new token
        fp8_flops_s = self.hardware.peak_flops("fp8") * self.eff.attention
        return max(2.0 * m.index_n_heads * m.index_head_dim * scored / fp8_flops_s,
                   (c * m.indexer_key_bytes + q * m.index_n_heads * m.index_head_dim + 2 * 4 * scored)
                   / self._bytes_s)  # keys, fp8 queries, the fp32 scores written and read by the top-k

    def _sparse_step_seconds(self, chunks: list[tuple[int, int]]) -> float:
        """Every layer's attention of a DeepSeek-sparse-attention step's requests (`chunks`: every
        request's (q, c)), as vLLM runs them (`_sparse_layer_parts`), the indexer's seconds in the
        layers that run one (`_indexer_share`)."""
        decodes = any(q == 1 for q, _ in chunks)
        total = 0.0
        for attend, indexer in self._sparse_layer_parts(chunks, decodes):
            total += attend + self._indexer_share * indexer
        return self.model.num_hidden_layers * total

    def parts(self, agg: StepAggregates, chunks: list[tuple[int, int]], dense: tuple) -> dict:
        linear, router, moe, kv_write, elementwise, lm_head, allreduce = dense
        if self.model.index_topk:
            others = self._sparse_step_seconds(chunks)
        else:
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
