"""A decoder's shape, from a preset or a Hugging Face `config.json`, and the one place for the
arithmetic every part of servesim takes from it: per-GPU GEMM shapes under tensor parallelism,
parameters, weight bytes per dtype, KV bytes per token.

Supported: dense Llama, Mistral, Qwen2 and Qwen3 decoders (GQA; QK-norm for Qwen3; Qwen2's q/k/v
biases), and the mixture-of-experts, multi-head latent attention (MLA) and sliding-window
families: Qwen3-MoE, Mixtral, DeepSeek-V3/R1, Kimi K2/K2.5, gpt-oss, MiniMax-M2, Mistral-7B-v0.1,
Gemma 2 and 3. A config servesim cannot price is refused with one line naming the file and the
field. RoPE settings are read from either layout:
the hub's top-level `rope_theta`/`rope_scaling`, or the single `rope_parameters` object that
transformers 5 writes.

Tensor parallelism follows vLLM's layers (vllm/model_executor/layers/linear.py,
vocab_parallel_embedding.py): the QKV and gate-up GEMMs are column-parallel (heads and
intermediate size divided by T), O and down are row-parallel (their inputs divided by T), the
vocabulary is padded to a multiple of 64 and split, norms are replicated. With fewer KV heads than
GPUs, each GPU keeps one KV head (`ModelConfig.get_num_kv_heads` in vllm/config/model.py:
max(1, num_kv_heads // T)): KV heads are replicated, not split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from sim.config import MODEL_LEN
from sim.errors import ServesimError
from sim.jsonable import read_json_file

DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp4": 0.5 + 1 / 16}  # weights (and GEMM inputs); fp4: nvfp4, an fp8 scale per 16
KV_CACHE_DTYPES = ("auto", "fp8")  # --kv-cache-dtype: auto is the model's dtype (bf16)
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py)
# Weights' storage, per quantization (quantization_config of the checkpoint): fp8-block is
# DeepSeek's e4m3 with one fp32 scale per 128 x 128 block (weight_block_size); mxfp4 is OCP MX fp4,
# one e8m0 byte per 32 weights along the input; int4 is compressed-tensors' pack-quantized int4 with
# one bf16 scale per group of 32 inputs (symmetric: no zero points); nvfp4 is NVIDIA's NVFP4 (e2m1 with
# one e4m3 scale per 16 inputs, and fp4 activations: W4A4), as NVIDIA's ModelOpt checkpoints store
# their routed experts (nvidia/Kimi-K2.5-NVFP4, nvidia/MiniMax-M2.5-NVFP4).
WEIGHT_DTYPES = ("bf16", "fp8", "fp8-block", "mxfp4", "int4", "nvfp4")
FP8_BLOCK = 128
FP4_GROUP = 32
INT4_GROUP = 32
NVFP4_GROUP = 16

# model_type -> (architecture, QK-norm)
FAMILIES = {"llama": ("LlamaForCausalLM", False), "mistral": ("MistralForCausalLM", False),
            "qwen2": ("Qwen2ForCausalLM", False), "qwen3": ("Qwen3ForCausalLM", True),
            # Xiaomi's MiMo-7B: vLLM's MiMoForCausalLM is Qwen2ForCausalLM (vllm/model_executor/models/mimo.py),
            # its MTP layers left to a draft model (hf_to_vllm_mapper drops model.mtp_layers)
            "mimo": ("MiMoForCausalLM", False)}
QKV_BIAS_FAMILIES = ("qwen2", "mimo")  # q, k and v projections with biases (Qwen2Attention)
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
             "max_position_embeddings")
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # the layer_types entries servesim prices
# Hybrid models whose linear-attention (Gated DeltaNet, lightning) or state-space (Mamba) layers keep a
# state per request: refused with `_STATE_HINT` (docs/moe.md, "Not yet", says what vLLM does for them).
STATE_LAYER_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h",
                     "kimi_linear", "jamba", "falcon_h1", "granitemoehybrid", "bamba", "zamba2", "mamba", "mamba2",
                     "lfm2"}
_NOT_YET = "a state per request, which servesim does not simulate yet (docs/moe.md, Not yet)"
_STATE_HINT = f": its linear-attention or state-space layers keep {_NOT_YET}"
INDEXER_TYPES = ("full", "shared")  # a sparse-attention layer's own indexer, or the top-k of the last one


def _state_hint(*model_types) -> str:
    """`_STATE_HINT` where one of the model types is a hybrid of `STATE_LAYER_TYPES`, else ''."""
    return _STATE_HINT if any(t in STATE_LAYER_TYPES for t in model_types) else ""


class Gemm(NamedTuple):
    """One per-layer matmul on one GPU: [tokens, k] x [k, n]."""

    name: str  # qkv, o, gate_up, down
    k: int
    n: int


def kv_cache_dtype_bytes(kv_cache_dtype: str, dtype: str = "bf16") -> int:
    """Bytes of one cached K or V element: `auto` keeps the model's activations' dtype (bf16,
    also under fp8 weights, as vLLM does), `fp8` one byte."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ServesimError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose auto or fp8")
    if dtype not in DTYPE_BYTES:
        raise ServesimError(f"unknown --dtype {dtype!r}; choose bf16 or fp8")
    return 1 if kv_cache_dtype == "fp8" else 2


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool
    rope_scaling: dict | None = None  # Hugging Face's rope_scaling without rope_theta; None: plain RoPE
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # Qwen2's q/k/v projections carry biases
    # The fields below (Hugging Face's names) are those of the mixture-of-experts, MLA and
    # sliding-window families; their defaults are a dense decoder's, and `describe` leaves them out
    # when they have them. Mixture of experts: 0 experts is a dense model.
    model_type: str = ""
    num_experts: int = 0  # routed experts (num_local_experts, n_routed_experts in some files)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one expert's (Mixtral, gpt-oss, MiniMax: intermediate_size)
    shared_expert_intermediate_size: int = 0  # the shared experts' together (DeepSeek: n_shared x moe_i)
    norm_topk_prob: bool = False
    first_k_dense_replace: int = 0  # dense-MLP layers at the front (intermediate_size)
    # Multi-head latent attention (DeepSeek-V3, Kimi K2): kv_lora_rank 0 is none; q_lora_rank 0:
    # queries projected from the hidden state directly.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): each query attends to the index_topk keys its
    # lightning indexer picks (index_n_heads heads of index_head_dim over every key); 0: dense MLA.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # Which layers run their own indexer ("full") and which reuse the top-k of the last layer that did
    # ("shared": GLM-5.2's index_topk_freq, IndexCache's index_topk_pattern); one entry per layer,
    # empty: every layer its own (`_indexer_types`).
    indexer_types: tuple = ()
    # Sliding windows: one entry per layer, "full_attention", "sliding_attention" or (Llama 4)
    # "chunked_attention" (empty: all full).
    sliding_window: int | None = None
    layer_types: tuple = ()
    # Llama 4: a chunked layer's token attends to the tokens of its own chunk of this many positions
    # before it (transformers' and vLLM's attention_chunk_size); MoE on every n-th layer
    # (interleave_moe_layer_step: layer i is MoE when (i + 1) % n == 0, the others dense MLPs).
    attention_chunk_size: int | None = None
    interleave_moe_layer_step: int = 1
    # DeciLM (model_type nemotron-nas: Llama-3.3-Nemotron-Super-49B, Llama-3.1-Nemotron-Nano-8B and
    # Ultra-253B): per layer, whether it has attention (its block config's attention.no_op is false)
    # and its MLP's intermediate size (0: ffn.no_op, no MLP); empty: every layer has both, the MLP of
    # intermediate_size (`_nas_fields`).
    attention_layers: tuple = ()
    mlp_widths: tuple = ()
    attention_sinks: bool = False  # gpt-oss: one learned sink logit per head
    attention_bias: bool = False  # gpt-oss: q, k, v and o projections carry biases
    sandwich_norms: bool = False  # Gemma 2/3: four RMSNorms per layer
    # Checkpoint quantization (quantization_config): the dtype of the attention, dense and shared
    # MLP weights, and of the routed experts'; "" when the checkpoint is not quantized (--dtype).
    weight_dtype: str = ""
    expert_dtype: str = ""
    # The KV cache the checkpoint's quantization states ("fp8"; "" where none): vLLM resolves
    # --kv-cache-dtype auto to it (vllm/utils/torch_utils.py resolve_kv_cache_dtype_string).
    kv_cache_dtype: str = ""

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            value = getattr(self, field)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ServesimError(f"model {self.name}: {field} must be a positive whole number, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ServesimError(
                f"model {self.name}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ServesimError(f"model {self.name}: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ServesimError(f"model {self.name}: rope_theta must be positive, got {self.rope_theta}")
        if self.is_extended:
            self._check_extended()

    def _check_extended(self) -> None:
        def fail(message: str) -> None:
            raise ServesimError(f"model {self.name}: {message}")

        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                      "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                      "v_head_dim"):
            value = getattr(self, field)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                fail(f"{field} must be a whole number >= 0, got {value!r}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                fail(f"num_experts_per_tok must be in [1, num_experts = {self.num_experts}], got "
                     f"{self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                fail("moe_intermediate_size must be positive for a mixture-of-experts model")
            if self.first_k_dense_replace >= self.num_hidden_layers:
                fail(f"first_k_dense_replace ({self.first_k_dense_replace}) leaves no MoE layer of "
                     f"{self.num_hidden_layers}")
            if not (isinstance(self.interleave_moe_layer_step, int) and self.interleave_moe_layer_step >= 1):
                fail(f"interleave_moe_layer_step must be a whole number >= 1, got {self.interleave_moe_layer_step!r}")
            if not self.num_moe_layers:
                fail(f"interleave_moe_layer_step ({self.interleave_moe_layer_step}) leaves no MoE layer of "
                     f"{self.num_hidden_layers}")
        if self.kv_lora_rank and not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim):
            fail("an MLA model needs qk_rope_head_dim, qk_nope_head_dim and v_head_dim")
        if self.index_topk and not (self.kv_lora_rank and self.index_n_heads >= 1 and self.index_head_dim >= 1):
            fail("DeepSeek sparse attention needs MLA (kv_lora_rank), index_n_heads and index_head_dim")
        if self.indexer_types:
            if not self.index_topk:
                fail("indexer_types without DeepSeek sparse attention (index_topk)")
            if len(self.indexer_types) != self.num_hidden_layers:
                fail(f"indexer_types has {len(self.indexer_types)} entries for {self.num_hidden_layers} layers")
            if set(self.indexer_types) - set(INDEXER_TYPES):
                fail(f"indexer_types holds {sorted(set(self.indexer_types) - set(INDEXER_TYPES))}; expected "
                     f"{' or '.join(INDEXER_TYPES)}")
            if self.indexer_types[0] != "full":
                fail("indexer_types[0] is 'shared', but no earlier layer's indexer picks its top-k")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                fail(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                fail(f"layer_types holds {sorted(unknown)}; servesim prices {', '.join(LAYER_TYPES)}")
            if "chunked_attention" in self.layer_types and not (isinstance(self.attention_chunk_size, int)
                                                                  and self.attention_chunk_size >= 1):
                fail(f"attention_chunk_size must be a positive whole number, got {self.attention_chunk_size!r}")
            if "sliding_attention" in self.layer_types and not (isinstance(self.sliding_window, int)
                                                                  and self.sliding_window >= 1):
                fail(f"sliding_window must be a positive whole number, got {self.sliding_window!r}")
        if self.attention_layers:
            if len(self.attention_layers) != self.num_hidden_layers:
                fail(f"attention_layers has {len(self.attention_layers)} entries for {self.num_hidden_layers} layers")
            if not all(isinstance(a, bool) for a in self.attention_layers):
                fail(f"attention_layers must hold true or false per layer, got {self.attention_layers!r}")
            if not any(self.attention_layers):
                fail("attention_layers has no layer with attention")
        if self.mlp_widths:
            if len(self.mlp_widths) != self.num_hidden_layers:
                fail(f"mlp_widths has {len(self.mlp_widths)} entries for {self.num_hidden_layers} layers")
            if not all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in self.mlp_widths):
                fail(f"mlp_widths must hold whole numbers >= 0 per layer, got {self.mlp_widths!r}")
            if self.intermediate_size != max(self.mlp_widths):
                fail(f"intermediate_size ({self.intermediate_size}) must be the widest MLP of mlp_widths "
                     f"({max(self.mlp_widths)})")
        if self.kv_cache_dtype not in ("", "fp8"):
            fail(f"kv_cache_dtype must be fp8 or empty, got {self.kv_cache_dtype!r}")
        for field in ("weight_dtype", "expert_dtype"):
            if getattr(self, field) not in ("",) + WEIGHT_DTYPES:
                fail(f"{field} must be one of {', '.join(WEIGHT_DTYPES)}, got {getattr(self, field)!r}")

    # Construction.

    @classmethod
    def from_fields(cls, name: str, fields: dict) -> ModelConfig:
        """From a preset's dict (backends/presets.py)."""
        known = {f: fields[f] for f in cls.__dataclass_fields__ if f != "name" and f in fields}
        for field in ("layer_types", "indexer_types", "attention_layers", "mlp_widths"):
            if field in known:
                known[field] = tuple(known[field])
        return cls(name=name, **known)

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        from backends.presets import get_model

        return cls.from_fields(name, get_model(name))

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """From a Hugging Face `config.json`, or a folder holding one."""
        where, raw = read_config_json(path)
        raw, where = language_model_of(raw, where)
        if _is_extended(raw):
            return extended_from_hf(raw, where)
        refuse_unpriceable(raw, where)
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise ServesimError(f"{where}: model_type {model_type!r} is not supported{_state_hint(model_type)}; "
                                f"servesim prices {', '.join(dict.fromkeys([*FAMILIES, *EXTENDED_FAMILIES]))} "
                                "decoders")
        fields = hf_fields(raw, where)
        for field in _REQUIRED:
            if field not in fields:
                raise ServesimError(f"{where}: no {field} in it")
        _flag(raw, "attention_bias", where, False)  # not priced here, but must be true or false
        architecture, qk_norm = FAMILIES[model_type]
        architectures = raw.get("architectures")
        if isinstance(architectures, list) and architectures:
            architecture = str(architectures[0])
        fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
        if "head_dim" not in fields:
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        fields.setdefault("rope_theta", 10000.0)  # transformers' default for these families
        fields.setdefault("rope_scaling", None)
        # An fp8 checkpoint (per-tensor, or blocks of 128 x 128) is priced in fp8 (`served_dtype`); any other
        # quantization is refused naming it, never priced as bf16.
        fields["weight_dtype"] = _quantization(raw.get("quantization_config"), where, False)[0]
        fields["kv_cache_dtype"] = checkpoint_kv_cache(raw.get("quantization_config"))
        name = config_name(where.removesuffix(TEXT_CONFIG))  # (a wrapper's: the file's name, not its folder's)
        eps, tied = _number(raw, "rms_norm_eps", where, 1e-6), _flag(raw, "tie_word_embeddings", where, False)
        try:
            return cls(name=name, rms_norm_eps=eps, tie_word_embeddings=tied, qk_norm=qk_norm,
                       architecture=architecture, qkv_bias=model_type in QKV_BIAS_FAMILIES, **fields)
        except ServesimError as e:
            raise ServesimError(f"{where}: {e}") from None

    # Shapes.

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def check_tp(self, tp: int) -> None:
        """vLLM's divisibility rules for tensor parallelism of degree `tp` (`check_parallel` at one DP rank)."""
        self.check_parallel(tp)

    def num_kv_heads_per_gpu(self, tp: int = 1) -> int:
        return max(1, self.num_key_value_heads // tp)

    def gemms(self, tp: int = 1) -> list[Gemm]:
        """The per-layer matmuls on one GPU under tensor parallelism of degree `tp`: fused QKV and
        gate-up split by output columns, O and down by input rows (each then all-reduced)."""
        self.check_tp(tp)
        if self.num_experts or self.kv_lora_rank or self.has_layer_blocks:
            raise ServesimError(f"model {self.name}: its layers are not all one dense decoder layer; "
                                "price it with `layer_gemms`")
        h, hd = self.hidden_size, self.head_dim
        heads = self.num_attention_heads // tp
        kv_heads = self.num_kv_heads_per_gpu(tp)
        i = self.intermediate_size // tp
        return [Gemm("qkv", h, (heads + 2 * kv_heads) * hd), Gemm("o", heads * hd, h),
                Gemm("gate_up", h, 2 * i), Gemm("down", i, h)]

    def padded_vocab(self, tp: int = 1) -> int:
        """Rows of the embedding (and LM head) on one GPU: the vocabulary padded to a multiple of
        64, split among the GPUs."""
        padded = -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        return -(-padded // tp)

    # Sizes.

    @property
    def num_parameters(self) -> int:
        """Parameters of the whole decoder (unpadded, one copy): embeddings, attention, MLP, norms,
        the LM head."""
        if self.is_extended:
            return self.layout_parameters()
        h, hd, layers = self.hidden_size, self.head_dim, self.num_hidden_layers
        linear = sum(g.k * g.n for g in self.gemms(1))
        per_layer = linear + 2 * h + (2 * hd if self.qk_norm else 0) + (self.q_size + 2 * self.kv_size
                                                                         if self.qkv_bias else 0)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embeddings + h

    def weight_bytes_per_gpu(self, tp: int = 1, dtype: str = "bf16", dp: int = 1,
                             enable_expert_parallel: bool = False) -> int:
        """What one GPU holds of the weights, as vLLM loads them: the linear layers' shards in
        `dtype` (fp8: one byte per weight; the per-channel scales, 0.04% of a Llama, are left
        out), the padded vocabulary's shard of the embedding and LM head, norms and biases in bf16,
        and RoPE's cos/sin cache ([max_position_embeddings, head_dim] in bf16, built by vLLM's
        get_rope and counted in its "model loading took" figure). A mixture-of-experts, MLA or
        sliding-window model: `weight_bytes_by_part` (`dp` and `enable_expert_parallel` place its
        experts; a dense model's weights do not depend on them)."""
        if dtype not in DTYPE_BYTES:
            raise ServesimError(f"unknown --dtype {dtype!r}; choose bf16 or fp8")
        if self.is_extended:
            return sum(self.weight_bytes_by_part(tp, dtype, dp, enable_expert_parallel).values())
        h, hd, layers = self.hidden_size, self.head_dim, self.num_hidden_layers
        gemms = self.gemms(tp)
        linear = int(layers * sum(g.k * g.n for g in gemms) * DTYPE_BYTES[dtype])
        qkv_out = gemms[0].n
        small = layers * (2 * h + (2 * hd if self.qk_norm else 0) + (qkv_out if self.qkv_bias else 0)) + h
        embeddings = self.padded_vocab(tp) * h * (1 if self.tie_word_embeddings else 2)
        rope_cache = self.max_position_embeddings * hd
        return linear + 2 * (small + embeddings + rope_cache)

    def kv_bytes_per_token(self, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token over all layers, on one GPU. MLA caches one latent vector per token
        and layer, kv_lora_rank + qk_rope_head_dim wide, the same on every GPU (vLLM's
        MLAAttentionSpec: num_kv_heads 1, head_size kv_lora_rank + qk_rope_head_dim, no separate
        V; vllm/v1/kv_cache_interface.py). A sliding-window layer's token is the same size as a
        full one's (SlidingWindowSpec's page): how many tokens a layer keeps is
        backends/kv_capacity.py's. A DeciLM layer without attention keeps no cache (vLLM's
        DeciLMDecoderLayer builds no Attention for it, so it reports no KV cache spec)."""
        if self.index_topk:  # DeepSeek sparse attention: the latent, and the indexer's key where the layer has one
            return (self.num_hidden_layers * self.sparse_latent_bytes(kv_cache_dtype)
                    + self.num_indexer_layers * self.indexer_key_bytes)
        if self.kv_lora_rank:
            return (self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
                    * kv_cache_dtype_bytes(kv_cache_dtype))
        return (2 * self.num_attention_layers * self.num_kv_heads_per_gpu(tp) * self.head_dim
                * kv_cache_dtype_bytes(kv_cache_dtype))

    def sparse_latent_bytes(self, kv_cache_dtype: str = "auto") -> int:
        """One token's MLA latent in a DeepSeek-sparse-attention layer's cache: kv_lora_rank +
        qk_rope_head_dim values in bf16 (576 x 2 = 1152 bytes), or with an fp8 cache FlashMLA's
        fp8_ds_mla row, its 656-byte literal (512 fp8 values, 4 fp32 scales and the 64 RoPE values in
        bf16: vllm/model_executor/layers/attention/mla_attention.py, MLAAttention.get_kv_cache_spec,
        state_content_bytes; flashmla_sparse.py). FlashInfer's sparse backend on Blackwell keeps a
        plain fp8 row (576 bytes) instead, which servesim does not model."""
        if kv_cache_dtype == "fp8":
            return 656
        return (self.kv_lora_rank + self.qk_rope_head_dim) * kv_cache_dtype_bytes(kv_cache_dtype)

    @property
    def num_indexer_layers(self) -> int:
        """The layers that run their own lightning indexer and keep its key cache (all of a
        sparse-attention model's unless `indexer_types` shares some; 0 for any other model)."""
        if not self.index_topk:
            return 0
        return sum(1 for t in self.indexer_types if t == "full") if self.indexer_types else self.num_hidden_layers

    @property
    def indexer_key_bytes(self) -> int:
        """One token's key in a DeepSeek-sparse-attention layer's indexer cache, whatever the KV cache
        dtype: index_head_dim fp8 values and one fp32 scale per 128 (DeepseekV32IndexerCache, uint8,
        head_dim index_head_dim + index_head_dim // 128 x 4: 132 bytes)."""
        return self.index_head_dim + self.index_head_dim // 128 * 4

    # Mixture of experts, MLA and sliding windows.

    @property
    def is_extended(self) -> bool:
        """Whether the model is one of the MoE, MLA or sliding-window families (priced by
        `layout_*`, `weight_bytes_by_part` and backends/costmodel/roofline.py's MoE model)."""
        return bool(self.model_type or self.num_experts or self.kv_lora_rank or self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        """The MoE layers: after the first_k_dense_replace dense ones, every interleave_moe_layer_step-th
        (layer i when (i + 1) % step == 0: vLLM's Llama4DecoderLayer, vllm/model_executor/models/llama4.py)."""
        if not self.num_experts:
            return 0
        step = self.interleave_moe_layer_step  # layers i in [first_k, L) with step | i + 1
        return self.num_hidden_layers // step - self.first_k_dense_replace // step

    @property
    def num_dense_mlp_layers(self) -> int:
        if self.mlp_widths:
            return sum(1 for w in self.mlp_widths if w)
        return self.num_hidden_layers - self.num_moe_layers

    @cached_property
    def num_attention_layers(self) -> int:
        """The layers with attention (and a KV cache): every layer but a DeciLM layer whose
        attention is a no-op. (Kept: the cost models read it every step.)"""
        return sum(self.attention_layers) if self.attention_layers else self.num_hidden_layers

    @property
    def dense_mlp_widths(self) -> dict[int, int]:
        """{intermediate size: how many dense-MLP layers have it}: one width for every family but
        DeciLM, whose layers each have their own (`mlp_widths`), in the order they first appear."""
        if self.mlp_widths:
            widths: dict[int, int] = {}
            for w in self.mlp_widths:
                if w:
                    widths[w] = widths.get(w, 0) + 1
            return widths
        return {self.intermediate_size: self.num_dense_mlp_layers} if self.num_dense_mlp_layers else {}

    @property
    def num_sublayers(self) -> int:
        """Attention blocks and MLP (or MoE) blocks together, each ending in a row-parallel layer
        whose output is all-reduced under TP, with its own add+RMSNorm before it: two a layer, but a
        DeciLM layer's no-op attention or MLP has none (vLLM's DeciLMDecoderLayer skips it, its norm
        and its o_proj or down_proj with it)."""
        return self.num_attention_layers + self.num_dense_mlp_layers + self.num_moe_layers

    @property
    def has_layer_blocks(self) -> bool:
        """Whether the layers are DeciLM's, each of its own attention (or none) and MLP width
        (`attention_layers`, `mlp_widths`), not one decoder layer repeated."""
        return bool(self.attention_layers or self.mlp_widths)

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == "sliding_attention")

    @property
    def num_chunked_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == "chunked_attention")

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    def served_dtype(self, dtype: str) -> str:
        """The dtype a dense model's weights are priced in: fp8 where its checkpoint is fp8 (per-tensor, or
        blocks of 128 x 128, priced as per-tensor fp8: the GEMM tables time the block-fp8 kernels without a
        CUDA graph, backends/costmodel/optables/moe.py), as vLLM serves a quantized checkpoint whatever its
        --dtype (the activations'); else `dtype` (--dtype). A mixture of experts prices its checkpoint's
        dtypes itself (`linear_dtypes`)."""
        if not self.is_extended and self.weight_dtype == "nvfp4":
            return "fp4"  # an NVFP4 checkpoint, served in fp4 whatever --dtype
        if self.is_extended or self.weight_dtype not in ("fp8", "fp8-block"):
            return dtype
        if dtype == "fp4":
            raise ServesimError(f"--dtype fp4: {self.name}'s checkpoint is quantized ({self.weight_dtype}, its "
                                f"quantization_config), and vLLM serves it so; drop --dtype")
        return "fp8"

    def linear_dtypes(self, dtype: str = "bf16") -> tuple[str, str]:
        """(attention, dense and shared MLP weights' dtype, routed experts' dtype): the checkpoint's
        quantization where it has one, else `dtype` (--dtype). fp4 weights are an NVFP4 checkpoint's
        only: vLLM quantizes no model to fp4 itself, and a quantized checkpoint is served as it is."""
        if dtype == "fp4" and "nvfp4" not in (self.weight_dtype, self.expert_dtype):
            if self.weight_dtype or self.expert_dtype:
                raise ServesimError(f"--dtype fp4: {self.name}'s checkpoint is quantized "
                                    f"({self.expert_dtype or self.weight_dtype}, its quantization_config), and vLLM "
                                    "serves it so; drop --dtype, or give its NVFP4 checkpoint's config")
            raise ServesimError(f"--dtype fp4: vLLM quantizes no model to fp4 (nvfp4) itself, and {self.name}'s "
                                "checkpoint is not quantized; give an NVFP4 checkpoint's config (--model "
                                "nvidia/NAME-NVFP4: sim models lists those the tables package ships), or --dtype bf16 "
                                "or fp8")
        weights = self.weight_dtype or dtype
        return weights, self.expert_dtype or weights

    def moe_parallel(self, tp: int = 1, dp: int = 1, enable_expert_parallel: bool = False) -> tuple[int, int]:
        """(MoE TP, EP) as vLLM's FusedMoEParallelConfig.make sets them
        (vllm/model_executor/layers/fused_moe/config.py): the MoE layers run over all tp x dp GPUs,
        tensor-parallel (EP 1) by default, expert-parallel (MoE TP 1) with --enable-expert-parallel."""
        ranks = tp * dp
        return (1, ranks) if enable_expert_parallel and ranks > 1 else (ranks, 1)

    def local_experts(self, tp: int = 1, dp: int = 1, enable_expert_parallel: bool = False) -> int:
        """Routed experts held by the GPU holding the most (vLLM's determine_expert_map gives the
        first E mod EP ranks one more)."""
        _, ep = self.moe_parallel(tp, dp, enable_expert_parallel)
        return -(-self.num_experts // ep)

    def check_parallel(self, tp: int = 1, dp: int = 1, enable_expert_parallel: bool = False,
                       dtype: str = "bf16") -> None:
        """vLLM's divisibility rules for this layout; a block-quantized weight's shard must also
        hold whole 128 x 128 blocks (vLLM's validate_block_quant_shapes)."""
        if not (isinstance(tp, int) and tp >= 1):
            raise ServesimError(f"--tp must be a whole number >= 1, got {tp!r}")
        if not (isinstance(dp, int) and dp >= 1):
            raise ServesimError(f"--dp must be a whole number >= 1, got {dp!r}")
        weights, experts = self.linear_dtypes(dtype)
        moe_tp, ep = self.moe_parallel(tp, dp, enable_expert_parallel)
        nkv = self.num_key_value_heads
        rules = [(self.num_attention_heads % tp == 0, f"num_attention_heads ({self.num_attention_heads})", tp)]
        if not self.kv_lora_rank:
            rules.append((nkv % tp == 0 if nkv >= tp else tp % nkv == 0, f"num_key_value_heads ({nkv})", tp))
        if self.mlp_widths:  # DeciLM: each MLP width is split on its own (vLLM's LlamaMLP per layer)
            for width in self.dense_mlp_widths:
                rules.append(self._split_rule(f"MLP intermediate size {width} (block_configs)", width, tp, weights))
        elif self.num_dense_mlp_layers:
            rules.append(self._split_rule("intermediate_size", self.intermediate_size, tp, weights))
        if self.shared_expert_intermediate_size:
            rules.append(self._split_rule("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                                          tp, weights))
        if self.num_experts and moe_tp > 1:
            rule = self._split_rule("moe_intermediate_size", self.moe_intermediate_size, moe_tp, experts)
            if not rule[0] and experts == "fp8-block" and self.moe_intermediate_size % moe_tp == 0 and math.gcd(
                    FP8_BLOCK, self.moe_intermediate_size // moe_tp, self.hidden_size) >= 32:
                # vLLM refines the experts' block scales to a finer block that divides the TP slice, at least
                # 32 (fused_moe/oracle/fp8.py refine_fp8_moe_block_shape, served by its Triton kernel):
                # MiniMax-M2.5's 1536 over 8 GPUs, 192 each, in blocks of 64.
                rule = (True, "", moe_tp)
            rules.append(rule)
        for ok, what, among in rules:
            if not ok:
                raise ServesimError(f"--tp {tp}" + (f" --dp {dp}" if dp > 1 else "") + f" does not split model "
                                    f"{self.name}: its {what} cannot be divided among {among} GPUs")

    @staticmethod
    def _split_rule(field: str, size: int, among: int, dtype: str) -> tuple[bool, str, int]:
        if size % among:
            return False, f"{field} ({size})", among
        if dtype == "fp8-block" and among > 1 and (size // among) % FP8_BLOCK:
            return False, f"{field} ({size}, in fp8 blocks of {FP8_BLOCK})", among
        return True, "", among

    def weight_bytes_by_part(self, tp: int = 1, dtype: str = "bf16", dp: int = 1,
                             enable_expert_parallel: bool = False) -> dict[str, int]:
        """What one GPU holds, as vLLM loads it, by part. Attention, the dense MLPs, the shared
        experts, the embedding and the LM head are split by TP as in a dense model and replicated
        on each DP rank; the routed experts are split over all tp x dp GPUs (`moe_parallel`): each
        expert's intermediate size divided by MoE TP, or whole experts per GPU under EP. MLA's
        down-projections to the latents (fused q_a and kv_a) are replicated (vLLM's
        MergedReplicatedLinear), and vLLM keeps bf16 copies of kv_b_proj's two halves, W_UK and
        W_UV, beside it (split_kv_b_proj in vllm/model_executor/layers/attention/mla_attention.py).
        Routers, norms, biases, sinks, embeddings and the LM head stay bf16 (routing-score biases
        fp32); the linear layers are in `linear_dtypes`."""
        self.check_parallel(tp, dp, enable_expert_parallel, dtype)
        weights, experts = self.linear_dtypes(dtype)
        return self._layout(tp, dp, enable_expert_parallel, weights, experts, count=False)

    def layout_parameters(self) -> int:
        """Parameters of the whole model, one copy (no W_UK/W_UV copies, no padding)."""
        return sum(self._layout(1, 1, False, "bf16", "bf16", count=True).values())

    def active_parameters(self) -> int:
        """Parameters a token runs through: the routed experts' top-k of num_experts."""
        parts = self._layout(1, 1, False, "bf16", "bf16", count=True)
        total = sum(parts.values())
        if self.num_experts:
            total -= parts["experts"] - parts["experts"] * self.num_experts_per_tok // self.num_experts
        return total

    def _layout(self, tp: int, dp: int, ep: bool, weights: str, experts: str, count: bool) -> dict[str, int]:
        def lin(k: int, n: int, dtype: str) -> int:
            return k * n if count else linear_bytes(k, n, dtype)

        small = 1 if count else 2  # bf16 vectors
        h, hd = self.hidden_size, self.head_dim
        heads = self.num_attention_heads // tp
        attention = indexer = 0
        if self.kv_lora_rank:
            rope, nope, v = self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
            q_out = heads * (nope + rope)
            if self.q_lora_rank:
                attention += lin(h, self.q_lora_rank + self.kv_lora_rank + rope, weights)  # replicated
                attention += lin(self.q_lora_rank, q_out, weights) + small * self.q_lora_rank
            else:
                attention += lin(h, q_out, weights) + lin(h, self.kv_lora_rank + rope, weights)
            attention += lin(self.kv_lora_rank, heads * (nope + v), weights) + small * self.kv_lora_rank
            attention += lin(heads * v, h, weights)
            if not count:  # W_UK and W_UV in bf16
                attention += 2 * self.kv_lora_rank * heads * (nope + v)
            if self.index_topk:  # the indexer, replicated on every GPU (vllm/models/deepseek_v32/attention.py):
                idx = self.index_n_heads * self.index_head_dim  # wq_b in the checkpoint's dtype; wk and
                indexer = lin(self.q_lora_rank or h, idx, weights)  # weights_proj fused in bf16; k_norm fp32
                indexer += h * (self.index_head_dim + self.index_n_heads) * (1 if count else 2)
                indexer += 2 * self.index_head_dim * (1 if count else 4)
        else:
            kv_heads = self.num_kv_heads_per_gpu(tp)
            qkv_out = (heads + 2 * kv_heads) * hd
            attention += lin(h, qkv_out, weights) + lin(heads * hd, h, weights)
            if self.qkv_bias or self.attention_bias:
                attention += small * qkv_out
            if self.attention_bias:
                attention += small * h
            if self.attention_sinks:
                attention += small * heads
            if self.qk_norm:
                attention += small * 2 * hd
        # (a layer that shares an earlier layer's top-k builds no indexer, and vLLM drops the checkpoint's
        # indexer weights for it: DeepseekV2ForCausalLM.load_weights, indexer_present_prefixes)
        # (one norm per sublayer, two with Gemma's sandwich norms; a DeciLM layer builds input_layernorm
        # with its attention and post_attention_layernorm with its MLP only)
        norms = self.num_sublayers * (2 if self.sandwich_norms else 1)
        parts = {"attention": self.num_attention_layers * attention + self.num_indexer_layers * indexer,
                 "norms": small * (norms * h + h)}
        if self.num_dense_mlp_layers:
            parts["dense_mlp"] = 0
            for width, num_layers in self.dense_mlp_widths.items():
                i = width // tp
                parts["dense_mlp"] += num_layers * (lin(h, 2 * i, weights) + lin(i, h, weights))
        if self.num_experts:
            e = self.num_experts
            moe_tp, _ = self.moe_parallel(tp, dp, ep)
            local = self.local_experts(tp, dp, ep)
            i = self.moe_intermediate_size // moe_tp
            router = h * e * small
            if self.model_type in (*_DEEPSEEK, "minimax_m2"):
                router += e * (1 if count else 4)  # e_score_correction_bias, fp32
            elif self.attention_bias:
                router += small * e  # gpt-oss's router bias
            expert = lin(h, 2 * i, experts) + lin(i, h, experts)
            if self.attention_bias:  # gpt-oss's experts carry biases (bf16)
                expert += small * (2 * i + h)
            parts["router"] = self.num_moe_layers * router
            parts["experts"] = self.num_moe_layers * local * expert
            if self.shared_expert_intermediate_size:
                s = self.shared_expert_intermediate_size // tp
                parts["shared_experts"] = self.num_moe_layers * (lin(h, 2 * s, weights) + lin(s, h, weights))
        vocab = self.vocab_size if count else self.padded_vocab(tp)
        parts["embeddings"] = small * vocab * h * (1 if self.tie_word_embeddings else 2)
        if not count:
            parts["rope_cache"] = small * self.max_position_embeddings * self.rotary_dim
        return parts

    def describe(self) -> dict:
        """The fields, for summary.json (those of the MoE, MLA and sliding-window families only
        where they differ from a dense decoder's)."""
        out = {}
        for f, spec in self.__dataclass_fields__.items():
            value = getattr(self, f)
            if f in _EXTENDED_FIELDS and value == spec.default:
                continue
            out[f] = list(value) if isinstance(value, tuple) else value
        return out


def linear_bytes(k: int, n: int, dtype: str) -> int:
    """Bytes of a [k, n] weight (k inputs, n outputs) stored in `dtype` (WEIGHT_DTYPES), its
    scales included: fp8 per-tensor or per-channel scales are left out (0.04% of a Llama)."""
    if dtype == "bf16":
        return 2 * k * n
    if dtype == "fp8":
        return k * n
    if dtype == "fp8-block":
        return k * n + 4 * -(-k // FP8_BLOCK) * -(-n // FP8_BLOCK)
    if dtype == "mxfp4":
        return -(-k * n // 2) + -(-k // FP4_GROUP) * n
    if dtype == "int4":
        return -(-k * n // 2) + 2 * -(-k // INT4_GROUP) * n
    if dtype == "nvfp4":
        return -(-k * n // 2) + -(-k // NVFP4_GROUP) * n
    raise ServesimError(f"unknown weight dtype {dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")


# Reading Hugging Face config files.


def config_name(path: str) -> str:
    """The model's name for a config file: its folder's for ORG/NAME/config.json (NAME), the file's own
    for a config saved by another name (the tables package's ORG--NAME_config.json: ORG/NAME)."""
    p = Path(path)
    if p.name == "config.json" or p.suffix != ".json":
        return p.parent.name or str(path)
    stem = p.stem.removesuffix("_config")
    return stem.replace("--", "/", 1) or str(path)


def read_config_json(path: str | Path) -> tuple[str, dict]:
    """(the file's path as text, its JSON object). `path` is the file or a folder holding it."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ServesimError(f"{p}: no such file (--model takes a preset name, a config.json or a folder holding one)")
    raw = read_json_file(p, "model config")
    text = raw.get("text_config")
    # model_type is looked up in the families' tables: a list or an object there is no family's name.
    for label, config in (("model_type", raw), ("text_config's model_type", text)):
        if isinstance(config, dict) and not isinstance(config.get("model_type", ""), (str, type(None))):
            raise ServesimError(f"{p}: {label} = {config['model_type']!r}, expected text (a family's name, "
                                "such as llama)")
    if raw.get("quantization_config") is None and not (isinstance(text, dict) and text.get("quantization_config")):
        # NVIDIA's ModelOpt checkpoints may state their quantization in hf_quant_config.json beside
        # config.json, which vLLM reads (ModelOptFp8Config / ModelOptNvFp4Config); the tables package
        # ships it as ORG--NAME_hf_quant_config.json beside ORG--NAME_config.json.
        beside = p.with_name("hf_quant_config.json" if p.name == "config.json"
                             else p.name.removesuffix("config.json") + "hf_quant_config.json")
        if beside.is_file():
            quantization = read_json_file(beside, "ModelOpt quantization config").get("quantization")
            if not isinstance(quantization, dict):
                raise ServesimError(f"{beside}: no \"quantization\" object in it")
            raw = {**raw, "quantization_config": {"quant_method": "modelopt", **quantization}}
    return str(p), raw


# Vision-language wrappers whose language model is a family servesim prices, read for text prompts:
# text_config's model_type -> the decoder family it is. Qwen3-VL's language model is a Qwen3 (dense)
# or Qwen3-MoE decoder (vllm/model_executor/models/qwen3_vl.py Qwen3LLMForCausalLM over Qwen3Model;
# qwen3_vl_moe.py Qwen3MoeLLMForCausalLM over Qwen3MoeModel) whose RoPE is interleaved multimodal
# RoPE: for a text token its three position ids (time, height, width) are all the token's position
# (vLLM's MRotaryEmbedding, get_input_positions for text), so it rotates as plain RoPE does, at
# RoPE's cost; its cos/sin cache is as long as the context, as plain RoPE's (vLLM 0.33's Qwen3-VL
# decoder layers ask MRotaryEmbedding for 1 x max_position_embeddings, 4 x only with video pruning:
# qwen3_vl.py `mrope_positions_factor`). Served text-only, as `vllm serve --language-model-only`
# does: every modality's limit is 0 (vllm/config/multimodal.py, MultiModalConfig.get_limit_per_prompt),
# so the vision tower is not built or loaded (Qwen3VLForConditionalGeneration.__init__,
# `_mark_tower_model`) and no encoder pass is profiled: the GPU holds the language model alone.
LANGUAGE_MODELS = {"qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"}
TEXT_CONFIG = " (text_config)"  # said after a file's path where its wrapper's text_config was read


def language_model_of(raw: dict, where: str) -> tuple[dict, str]:
    """A vision-language wrapper of LANGUAGE_MODELS as its language model's config.json (its
    text_config, with the decoder family's model_type, the wrapper's architectures, quantization
    and tied embeddings where the text_config states none; multimodal RoPE read as plain RoPE, as
    text prompts run it) and where it came from; any other config as it is."""
    text = raw.get("text_config")
    if not (isinstance(text, dict) and text.get("model_type") in LANGUAGE_MODELS):
        return raw, where
    out = {**text, "model_type": LANGUAGE_MODELS[text["model_type"]]}
    for field in ("architectures", "tie_word_embeddings"):
        if out.get(field) is None and raw.get(field) is not None:
            out[field] = raw[field]
    if raw.get("quantization_config") is not None:  # the top level first, as vLLM reads it
        out["quantization_config"] = raw["quantization_config"]  # (weight_utils.py, get_quant_config)
    scaling = out.get("rope_scaling")
    if isinstance(scaling, dict) and "mrope_section" in scaling:
        rest = {k: v for k, v in scaling.items() if k not in ("mrope_section", "mrope_interleaved")}
        if rest.get("rope_type", "default") != "default" or set(rest) - {"rope_type"}:
            raise ServesimError(f"{where} (text_config): rope_scaling = {scaling!r}: multimodal RoPE with "
                                "scaling is not supported")
        # Three sections (time, height, width) of the rotary dimension's frequency pairs: vLLM's
        # MRotaryEmbedding asserts they sum to head_dim // 2 (its rotary_dim) and, interleaved, are three.
        section, head_dim = scaling["mrope_section"], out.get("head_dim")
        if not (isinstance(section, list) and len(section) == 3
                and all(type(v) is int and v >= 0 for v in section)  # noqa: E721 (not true or false)
                and (type(head_dim) is not int or sum(section) == head_dim // 2)):  # noqa: E721
            half = f" ({head_dim // 2})" if type(head_dim) is int else ""  # noqa: E721
            raise ServesimError(f"{where} (text_config): rope_scaling mrope_section = {section!r}, expected three "
                                f"whole numbers summing to head_dim // 2{half}")
        out["rope_scaling"] = None
    return out, f"{where}{TEXT_CONFIG}"


def refuse_unpriceable(raw: dict, where: str) -> None:
    """One line naming the field of a config that servesim's dense-decoder arithmetic cannot price."""
    for field in _MOE_FIELDS:
        if raw.get(field):
            raise ServesimError(f"{where}: {field} = {raw[field]}: mixture-of-experts models are not supported")
    for field in _MLA_FIELDS:
        if raw.get(field) is not None:
            raise ServesimError(f"{where}: {field} = {raw[field]}: multi-head latent attention is not supported")
    window = raw.get("sliding_window")
    if _flag(raw, "use_sliding_window", where, True) and window is not None:
        raise ServesimError(f"{where}: sliding_window = {window}: sliding-window attention is not supported")
    layer_types = _layer_types(raw, where)
    if layer_types and "sliding_attention" in layer_types:
        raise ServesimError(f"{where}: layer_types has sliding_attention layers: sliding-window attention is not "
                            "supported")


def hf_fields(raw: dict, where: str) -> dict:
    """The shape fields present in a config.json (head_dim derived when absent or null), and the
    RoPE settings from either layout: `rope_theta` (float) and `rope_scaling` (None for plain
    RoPE) when the file states them. Both layouts at once must agree."""
    fields = {}
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        if raw.get(field) is not None:
            # A model shorter than --max-model-len's least (a prompt and one output token) serves nothing.
            least = int(MODEL_LEN.low) if field == "max_position_embeddings" else 1
            fields[field] = _whole(raw, field, where, minimum=least)
    if fields.get("max_position_embeddings", 0) > MODEL_LEN.high:
        raise ServesimError(f"{where}: max_position_embeddings = {fields['max_position_embeddings']}, more than "
                            f"{int(MODEL_LEN.high):,} tokens, the most --max-model-len takes (no released model's context "
                            "reaches it)")
    if "head_dim" not in fields and "hidden_size" in fields and "num_attention_heads" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    fields.update(_rope(raw, where))
    return fields


def _rope(raw: dict, where: str) -> dict:
    """rope_theta and rope_scaling as transformers reads them (PreTrainedConfig.convert_rope_params_to_dict,
    which vLLM's configs go through): the top-level rope_scaling where it is set, else rope_parameters
    (transformers 5's layout), and rope_parameters' own rope_theta before the top level's. A null
    or empty rope_scaling beside rope_parameters says nothing; two set values that differ are a file read two
    ways, refused."""
    theta, scaling = raw.get("rope_theta"), raw.get("rope_scaling")
    for field, value in (("rope_theta", theta), ("rope_scaling", scaling)):
        _rope_value(field, value, where)
    scaling = scaling or None  # an empty rope_scaling is none to transformers (`rope_scaling or rope_parameters`)
    if scaling is not None and scaling.get("rope_theta") is not None:  # its own rope_theta, before the top level's
        _rope_value("rope_theta", scaling["rope_theta"], where)
        if theta is not None and float(theta) != float(scaling["rope_theta"]):
            raise ServesimError(f"{where}: its top-level rope_theta ({float(theta)}) and rope_scaling's own "
                                f"({float(scaling['rope_theta'])}) disagree")
        theta = scaling["rope_theta"]
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ServesimError(f"{where}: rope_parameters = {params!r}, expected an object")
        if any(key in LAYER_TYPES for key in params):  # one object per layer type (transformers 5's Gemma 3):
            params = params.get("full_attention")  # the full-attention layers', what the flat layout states
            if not isinstance(params, dict):
                raise ServesimError(f"{where}: rope_parameters holds one object per layer type but no "
                                    f"full_attention object ({params!r})")
        own = params.get("rope_theta")
        _rope_value("rope_theta", own, where)
        if (theta is not None and own is not None and float(theta) != float(own)) or (
                scaling is not None and _scaling(scaling) != _scaling(params)):
            raise ServesimError(f"{where}: its top-level rope_theta/rope_scaling ({_float(theta)}, "
                                f"{_scaling(scaling)}) and rope_parameters ({_float(own)}, {_scaling(params)}) disagree")
        theta = own if own is not None else theta
        scaling = scaling if scaling is not None else params
    if theta is not None:
        return {"rope_theta": float(theta), "rope_scaling": _scaling(scaling)}
    return {} if _scaling(scaling) is None else {"rope_scaling": _scaling(scaling)}


def _rope_value(field: str, value, where: str) -> None:
    if field == "rope_theta" and value is not None and not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise ServesimError(f"{where}: rope_theta = {value!r}, expected a number")
    if field == "rope_scaling" and value is not None and not isinstance(value, dict):
        raise ServesimError(f"{where}: rope_scaling = {value!r}, expected an object or null")


def _float(value) -> float | None:
    return None if value is None else float(value)


def _scaling(scaling: dict | None) -> dict | None:
    """Hugging Face's scaling settings in one form: `rope_type` (older files say `type`), without
    rope_theta; None for plain RoPE."""
    if scaling is None:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    out["rope_type"] = rope_type
    return out


def served_kv_cache_dtype(model: ModelConfig, kv_cache_dtype: str, hardware_name: str) -> str:
    """--kv-cache-dtype as vLLM resolves it for `model` on `hardware_name`: the checkpoint's for
    auto where its quantization states one; GLM-5's fp8 for auto on data-centre Blackwell (SM 10x:
    vllm/model_executor/models/config.py, the GlmMoeDsaForCausalLM config's verify_and_update_config
    sets "fp8_e4m3"); else as asked."""
    from sim.config import is_blackwell

    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if model.kv_cache_dtype:
        return model.kv_cache_dtype
    if model.model_type == "glm_moe_dsa" and is_blackwell(hardware_name):
        return "fp8"
    return kv_cache_dtype


def package_model_configs() -> Path | None:
    """The tables package's model_configs/ folder (ORG--NAME_config.json files), None without the extra."""
    from backends.costmodel.optables.systems import package_systems_dir

    systems = package_systems_dir()
    return None if systems is None else systems.parent / "model_configs"


def package_model_config(model_path: str) -> Path | None:
    """The tables package's model_configs/ file of a Hugging Face name ORG/NAME
    (ORG--NAME_config.json), if the tables extra is installed and ships it."""
    # (ORG/NAME_hf_quant would name the quantization file beside a config, not a model)
    if model_path.count("/") != 1 or not all(model_path.split("/")) or model_path.endswith("_hf_quant"):
        return None
    folder = package_model_configs()
    if folder is None:
        return None
    config = folder / f"{model_path.replace('/', '--')}_config.json"
    return config if _is_there(config, file=True) else None


def _is_there(path: Path, file: bool = False) -> bool:
    """Whether `path` exists (is a file), False where the system cannot look it up (a name too
    long for it, as a mistyped --model can be), where pathlib would raise."""
    try:
        return path.is_file() if file else path.exists()
    except OSError:
        return False


def resolve_model(name_or_path: str) -> ModelConfig:
    """A preset's name, a path to a config.json (or a folder holding one), or a Hugging Face name
    ORG/NAME whose config.json the tables package ships (`package_model_config`)."""
    from backends.presets import MODELS

    if not name_or_path.strip():  # (Path("") is the current folder: "config.json: no such file")
        raise ServesimError("--model must not be empty (an empty name was read as the current folder)")
    if name_or_path in MODELS:
        return ModelConfig.from_preset(name_or_path)
    if _is_there(Path(name_or_path)):
        return ModelConfig.from_hf(name_or_path)
    packaged = package_model_config(name_or_path)
    if packaged is not None:
        return ModelConfig.from_hf(packaged)
    raise ServesimError(f"unknown model {name_or_path!r}: not a preset ({', '.join(MODELS)}; see `sim models`), "
                        "no such config.json or folder, and no Hugging Face name ORG/NAME whose config.json the "
                        "tables package ships (pip install -e '.[tables]')")


# The mixture-of-experts, MLA and sliding-window families.

# model_type -> (architecture, QK-norm)
EXTENDED_FAMILIES = {"qwen3_moe": ("Qwen3MoeForCausalLM", True), "mixtral": ("MixtralForCausalLM", False),
                     "deepseek_v3": ("DeepseekV3ForCausalLM", False), "kimi_k2": ("DeepseekV3ForCausalLM", False),
                     "gpt_oss": ("GptOssForCausalLM", False), "minimax_m2": ("MiniMaxM2ForCausalLM", True),
                     "mistral": ("MistralForCausalLM", False), "gemma2": ("Gemma2ForCausalLM", False),
                     "gemma3_text": ("Gemma3ForCausalLM", True), "llama4_text": ("Llama4ForCausalLM", False),
                     "deepseek_v32": ("DeepseekV32ForCausalLM", False), "glm_moe_dsa": ("GlmMoeDsaForCausalLM", False),
                     # NVIDIA's DeciLM (Llama-Nemotron Nano, Super, Ultra): per-layer block configs (`_nas_fields`)
                     "nemotron-nas": ("DeciLMForCausalLM", False)}
_EXTENDED_FIELDS = ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "shared_expert_intermediate_size", "norm_topk_prob", "first_k_dense_replace", "kv_lora_rank",
                    "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "sliding_window",
                    "layer_types", "attention_sinks", "attention_bias", "sandwich_norms", "weight_dtype",
                    "expert_dtype", "kv_cache_dtype", "attention_chunk_size", "interleave_moe_layer_step",
                    "index_topk", "index_n_heads", "index_head_dim", "indexer_types", "attention_layers",
                    "mlp_widths")
_DEEPSEEK = ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa")
_SPARSE = ("deepseek_v32", "glm_moe_dsa")  # DeepSeek sparse attention: MLA with a lightning indexer


def _is_extended(raw: dict) -> bool:
    """Whether a config.json is read by `extended_from_hf`: a family of EXTENDED_FAMILIES (but a
    Mistral without a window), a multimodal wrapper, or a model_type no family knows (refused there,
    naming it)."""
    model_type = raw.get("model_type")
    if model_type == "mistral":
        return (raw.get("sliding_window") is not None and not any(raw.get(f) for f in _MOE_FIELDS)
                and raw.get("kv_lora_rank") is None)
    return model_type not in FAMILIES or isinstance(raw.get("text_config"), dict)


def _field(raw: dict, field: str, where: str, kind: str, default=None, minimum: int = 0):
    """A config.json field read with its type, `default` where it is absent or null (None: it must be
    there). kind "flag": JSON true or false; "number": a number above 0; "whole": a whole number >=
    `minimum`. Anything else (a string "false", "1e-5") is refused naming the file, field and value."""
    value = raw.get(field)
    if value is None:
        value = default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "flag":
        ok, expected = isinstance(value, bool), "true or false"
    elif kind == "number":
        ok, expected = number and math.isfinite(value) and value > 0, "a number above 0"
    else:
        ok, expected = number and isinstance(value, int) and value >= minimum, f"a whole number >= {minimum}"
    if not ok:
        raise ServesimError(f"{where}: {field} = {value!r}, expected {expected}")
    return value


def _whole(raw: dict, field: str, where: str, default: int | None = None, minimum: int = 0) -> int:
    return _field(raw, field, where, "whole", default, minimum)


def _flag(raw: dict, field: str, where: str, default: bool) -> bool:
    return _field(raw, field, where, "flag", default)


def _number(raw: dict, field: str, where: str, default: float) -> float:
    return float(_field(raw, field, where, "number", default))


# layer_types spellings of a sparse-attention layer, which keeps a full attention KV cache (vLLM's
# _ATTENTION_LAYER_TYPES, vllm/config/model.py): read as full_attention for DeepSeek sparse attention
SPARSE_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")


def _layer_types(raw: dict, where: str, model_type: str = "") -> list | None:
    """The config's layer_types (None where it has none), each entry one servesim prices (a sparse
    model's sparse-attention spellings read as full_attention)."""
    types = raw.get("layer_types")
    if types is None:
        return None
    if not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise ServesimError(f"{where}: layer_types = {types!r}, expected a list of names")
    if model_type in _SPARSE:
        types = ["full_attention" if t in SPARSE_LAYER_TYPES else t for t in types]
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ServesimError(f"{where}: layer_types[{i}] = {t!r}: servesim prices full_attention, "
                                "sliding_attention and chunked_attention (Llama 4) layers only"
                                + (f"; a linear-attention or state-space layer keeps {_NOT_YET}"
                                   if t in ("linear_attention", "mamba") else "")
                                + (f" ({', '.join(SPARSE_LAYER_TYPES)} for DeepSeek sparse attention)"
                                   if model_type in _SPARSE else ""))
    if "chunked_attention" in types and model_type != "llama4_text":
        raise ServesimError(f"{where}: layer_types has chunked_attention layers: chunked local attention is "
                            "priced for Llama 4 only")
    return types


def extended_from_hf(raw: dict, where: str) -> ModelConfig:
    """A Qwen3-MoE, Mixtral, DeepSeek-V3/R1, Kimi K2/K2.5, gpt-oss, MiniMax-M2, Mistral (with its
    sliding window) or Gemma 2/3 config.json; a multimodal wrapper's `text_config` is read (Kimi
    K2.5, Gemma 3). What servesim cannot price is refused naming the field."""
    text = raw.get("text_config")
    if isinstance(text, dict):
        if text.get("model_type") not in EXTENDED_FAMILIES:
            raise ServesimError(
                f"{where}: model_type {raw.get('model_type')!r} (a multimodal wrapper around a text_config of "
                f"model_type {text.get('model_type')!r}) is not supported"
                f"{_state_hint(raw.get('model_type'), text.get('model_type'))}; servesim reads a wrapper's text_config "
                f"only for {', '.join([*EXTENDED_FAMILIES, *LANGUAGE_MODELS])} decoders")
        quantization = raw.get("quantization_config", text.get("quantization_config"))
        raw = {**text, "quantization_config": quantization}
        where = f"{where}{TEXT_CONFIG}"
    model_type = raw.get("model_type")
    if model_type not in EXTENDED_FAMILIES:
        raise ServesimError(f"{where}: model_type {model_type!r} is not supported{_state_hint(model_type)}; "
                            f"servesim prices {', '.join(dict.fromkeys([*FAMILIES, *EXTENDED_FAMILIES]))} decoders")
    for field, what in (("index_topk", "DeepSeek sparse attention"), ("linear_attn_config", "linear attention"),
                        ("attention_chunk_size", "chunked local attention")):
        if raw.get(field) is not None and not (field == "attention_chunk_size" and model_type == "llama4_text") \
                and not (field == "index_topk" and model_type in _SPARSE):
            raise ServesimError(f"{where}: {field} = {raw[field]}: {what} is not supported")
    fields = hf_fields(raw, where)
    if model_type == "nemotron-nas":  # its MLP widths and KV heads are the block configs', not the top level's
        fields.update(_nas_fields(raw, where))
    if model_type in ("mixtral", "gpt_oss", "minimax_m2") and "intermediate_size" in fields:
        fields["moe_intermediate_size"] = fields["intermediate_size"]  # their experts' own
    for field in _REQUIRED:
        if field not in fields:
            raise ServesimError(f"{where}: no {field} in it")
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.setdefault("rope_theta", 10000.0)
    fields.setdefault("rope_scaling", None)
    layers = fields["num_hidden_layers"]
    architecture, qk_norm = EXTENDED_FAMILIES[model_type]
    architectures = raw.get("architectures")
    if isinstance(architectures, list) and architectures:
        architecture = str(architectures[0])
    fields.update(_moe_fields(raw, where, model_type))
    fields.update(_mla_fields(raw, where))
    if model_type in _SPARSE:
        fields.update(_sparse_fields(raw, where, layers))
    if fields.get("kv_lora_rank"):
        fields["head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    fields.update(_window_fields(raw, where, model_type, layers))
    if model_type == "llama4_text":
        fields.update(_llama4_fields(raw, where, layers))
    fields["kv_cache_dtype"] = checkpoint_kv_cache(raw.get("quantization_config"))
    fields["weight_dtype"], fields["expert_dtype"] = _quantization(raw.get("quantization_config"), where,
                                                                   bool(fields.get("num_experts")))
    if fields.get("kv_lora_rank") and fields["weight_dtype"] == "nvfp4":
        raise ServesimError(f"{where}: an NVFP4 checkpoint that quantizes MLA's projections: servesim prices MLA "
                            "from its module tables in bf16 or block fp8 only")
    gemma = model_type.startswith("gemma")
    if model_type == "gpt_oss":
        fields.update(attention_sinks=True, attention_bias=_flag(raw, "attention_bias", where, True))
    else:
        _flag(raw, "attention_bias", where, False)  # not priced here, but must be true or false
    name = config_name(where.removesuffix(TEXT_CONFIG))
    eps, tied = _number(raw, "rms_norm_eps", where, 1e-6), _flag(raw, "tie_word_embeddings", where, gemma)
    try:
        return ModelConfig(name=name, rms_norm_eps=eps, tie_word_embeddings=tied, qk_norm=qk_norm,
                           architecture=architecture, model_type=model_type, sandwich_norms=gemma, **fields)
    except ServesimError as e:
        raise ServesimError(f"{where}: {e}") from None


# DeciLM's per-block settings that vLLM's DeciLMDecoderLayer does not read: set, they describe a
# layer vLLM would build otherwise (a window, attention sinks, sparsity), so they are refused.
_NAS_IGNORED = {"attention": ("window_length", "num_sink_tokens", "sparsify", "mamba", "llama4"),
                "ffn": ("sparsify", "moe")}
_NAS_IGNORED_FLAGS = ("use_prefill_window_in_sink_attention", "unshifted_sink")


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """A DeciLM MLP's intermediate size from its ffn_mult, as vLLM computes it
    (vllm/model_executor/models/nemotron_nas.py, `_ffn_mult_to_intermediate_size` and
    `_find_multiple`): int(2 x ffn_mult x hidden / 3), truncated, then rounded up to a multiple of
    256. Super-49B's ffn_mult 2.625 at hidden 8192: int(14336.0) = 14336, already a multiple."""
    size = int(2 * ffn_mult * hidden_size / 3)
    return size if size % 256 == 0 else size + 256 - size % 256


def _nas_fields(raw: dict, where: str) -> dict:
    """A DeciLM config's layers (model_type nemotron-nas: nvidia/Llama-3_3-Nemotron-Super-49B-v1,
    Llama-3.1-Nemotron-Nano-8B-v1, Llama-3_1-Nemotron-Ultra-253B-v1), as vLLM builds them
    (vllm/model_executor/models/nemotron_nas.py, DeciLMDecoderLayer.__init__): block_configs[i]
    holds layer i's attention and ffn. Attention with no_op true is not built (no projections,
    no input_layernorm, no KV cache); else it is Llama's attention with num_attention_heads //
    n_heads_in_group KV heads. An ffn with no_op true is not built either (no MLP, no
    post_attention_layernorm); else a LlamaMLP of `ffn_mult_to_intermediate_size(ffn_mult)` (or
    the block's own intermediate_size where it has no ffn_mult, vLLM's other branch).
    vLLM takes the model's KV heads from the first layer with attention
    (vllm/transformers_utils/model_arch_config_convertor.py, NemotronNasModelArchConfigConvertor),
    so the top-level num_key_value_heads and intermediate_size (null in these files) are not read.

    Refused, one line each: block_configs missing or of the wrong length or shape; replace_with_linear
    (vLLM does not read it and builds full attention or an MLP in its place, whose weights the
    checkpoint lacks); n_heads_in_group that does not divide num_attention_heads; ffn_mult not a
    number above 0, or one so small its MLP is 0 wide (an empty LlamaMLP, not a no-op: it keeps its
    norm and all-reduce); window, sink and sparsity settings, which vLLM ignores (it would attend the whole
    context); an activation other than silu (vLLM's LlamaMLP refuses it); q/k/v/o or MLP biases;
    no layer with attention (vLLM's convertor raises) or none with an MLP; an MLP before the first layer
    with attention (DeciLMDecoderLayer.forward would hand its MLP's norm no residual and fail); and
    attention layers with different KV head counts: vLLM serves them (its full-attention layers of
    different page sizes share one KV cache group, UniformTypeKVCacheSpecs in
    vllm/v1/kv_cache_interface.py), but servesim's cost models price one KV head count for every
    attention layer."""
    hidden = _whole(raw, "hidden_size", where, minimum=1)
    heads = _whole(raw, "num_attention_heads", where, minimum=1)
    layers = _whole(raw, "num_hidden_layers", where, minimum=1)
    blocks = raw.get("block_configs")
    if not isinstance(blocks, list):
        raise ServesimError(f"{where}: block_configs = {_short(blocks)}: a nemotron-nas (DeciLM) config needs a list "
                            "of per-layer block configs")
    if len(blocks) != layers:
        raise ServesimError(f"{where}: block_configs has {len(blocks)} entries for num_hidden_layers = {layers}")
    for field, value in (("sliding_window", raw.get("sliding_window")), ("layer_types", raw.get("layer_types"))):
        if value is not None:
            raise ServesimError(f"{where}: {field} = {_short(value)}: sliding windows in a nemotron-nas (DeciLM) "
                                "model are not supported")
    for field in ("attention_bias", "mlp_bias"):
        if _flag(raw, field, where, False):
            raise ServesimError(f"{where}: {field} = true: servesim prices nemotron-nas (DeciLM) layers without biases")
    default_act = raw.get("hidden_act", "silu")
    attention: list[bool] = []
    widths: list[int] = []
    kv_heads: dict[int, int] = {}  # {KV heads: the first layer with that many}
    for i, block in enumerate(blocks):
        at = f"block_configs[{i}]"
        if not (isinstance(block, dict) and isinstance(block.get("attention"), dict)
                and isinstance(block.get("ffn"), dict)):
            raise ServesimError(f"{where}: {at} = {_short(block)}, expected an object with attention and ffn objects")
        for part in ("attention", "ffn"):
            sub = block[part]
            for flag in ("no_op", "replace_with_linear"):
                _flag(sub, flag, f"{where}: {at}.{part}", False)
            if sub.get("replace_with_linear"):
                raise ServesimError(f"{where}: {at}.{part}.replace_with_linear = true: vLLM's DeciLMDecoderLayer does "
                                    f"not read it (it builds the full {part} in its place), so servesim cannot price "
                                    "it")
            if sub.get("no_op"):
                continue
            for field in _NAS_IGNORED[part]:
                if sub.get(field) is not None:
                    raise ServesimError(f"{where}: {at}.{part}.{field} = {_short(sub[field])}: vLLM's "
                                        "DeciLMDecoderLayer ignores it, so it would not serve the model as set")
            for flag in _NAS_IGNORED_FLAGS if part == "attention" else ():
                if _flag(sub, flag, f"{where}: {at}.{part}", False):
                    raise ServesimError(f"{where}: {at}.{part}.{flag} = true: vLLM's DeciLMDecoderLayer ignores "
                                        "attention sinks, so it would not serve the model as set")
        att, ffn = block["attention"], block["ffn"]
        has_attention = not att.get("no_op")
        attention.append(has_attention)
        if has_attention:
            group = _whole(att, "n_heads_in_group", f"{where}: {at}.attention", minimum=1)
            if heads % group:
                raise ServesimError(f"{where}: {at}.attention.n_heads_in_group = {group} does not divide "
                                    f"num_attention_heads ({heads})")
            kv_heads.setdefault(heads // group, i)
        if ffn.get("no_op"):
            widths.append(0)
            continue
        act = ffn.get("hidden_act", default_act)
        if act != "silu":  # (named where it is set: the block's own, else the top level's that it inherits)
            field = f"{at}.ffn.hidden_act" if "hidden_act" in ffn else "hidden_act"
            raise ServesimError(f"{where}: {field} = {act!r}: vLLM's LlamaMLP runs silu only")
        if "ffn_mult" in ffn or "intermediate_size" not in ffn:
            mult = ffn.get("ffn_mult")
            if not (isinstance(mult, (int, float)) and not isinstance(mult, bool) and math.isfinite(mult) and mult > 0):
                raise ServesimError(f"{where}: {at}.ffn.ffn_mult = {mult!r}, expected a number above 0")
            # (the checkpoint's own DeciLM config, which vLLM loads with trust_remote_code, rounds ffn_mult to
            # 6 places before vLLM reads it: block_config.py, FFNConfig.__post_init__)
            width = ffn_mult_to_intermediate_size(round(mult, 6), hidden)
            if width < 1:  # (0 is a no-op's width here: an empty MLP is not one, it keeps its norm and all-reduce)
                raise ServesimError(f"{where}: {at}.ffn.ffn_mult = {mult!r} gives an MLP of intermediate size 0 "
                                    f"(int(2 x ffn_mult x {hidden} / 3) = 0): vLLM would build an empty LlamaMLP, "
                                    "which servesim cannot price; set ffn.no_op = true for a layer without an MLP")
            widths.append(width)
        else:
            widths.append(_whole(ffn, "intermediate_size", f"{where}: {at}.ffn", minimum=1))
    if not any(attention):
        raise ServesimError(f"{where}: every block_configs entry has attention.no_op = true: vLLM finds no KV heads "
                            "(NemotronNasModelArchConfigConvertor.get_total_num_kv_heads raises)")
    if not any(widths):
        raise ServesimError(f"{where}: every block_configs entry has ffn.no_op = true: servesim prices a model with "
                            "at least one MLP")
    first = attention.index(True)
    early = next((i for i in range(first) if widths[i]), None)
    if early is not None:  # (the residual is None until the first attention layer's input_layernorm sets it)
        raise ServesimError(f"{where}: block_configs[{early}] has an MLP before the first layer with attention "
                            f"(block_configs[{first}]): vLLM's DeciLMDecoderLayer.forward gives that MLP's norm no "
                            "residual to add and fails")
    if len(kv_heads) > 1:
        (a, i), (b, j) = list(kv_heads.items())[:2]
        raise ServesimError(f"{where}: block_configs give attention layers different KV heads ({a} in layer {i}, {b} "
                            f"in layer {j}): servesim prices one KV head count for every attention layer")
    out = {"num_key_value_heads": next(iter(kv_heads)), "intermediate_size": max(widths), "mlp_widths": tuple(widths)}
    if not all(attention):
        out["attention_layers"] = tuple(attention)
    return out


def _moe_fields(raw: dict, where: str, model_type: str) -> dict:
    counts = [f for f in _MOE_FIELDS if raw.get(f)]
    if not counts:
        if model_type in ("qwen3_moe", "mixtral", "gpt_oss", "minimax_m2", "llama4_text") or \
                raw.get("n_routed_experts") == 0:
            for field in _MOE_FIELDS:
                if raw.get(field) is not None:
                    _whole(raw, field, where, minimum=1)  # refuses its 0 (or false), naming it
            raise ServesimError(f"{where}: no num_experts (or num_local_experts, n_routed_experts) in it")
        return {}
    if model_type not in ("qwen3_moe", "mixtral", "gpt_oss", "minimax_m2", "llama4_text", *_DEEPSEEK):
        raise ServesimError(f"{where}: {counts[0]} = {raw[counts[0]]}: model_type {model_type!r} has no experts "
                            "servesim can price")
    out = {"num_experts": _whole(raw, counts[0], where, minimum=1)}
    top_k = "experts_per_token" if "experts_per_token" in raw and "num_experts_per_tok" not in raw else \
        "num_experts_per_tok"
    out["num_experts_per_tok"] = _whole(raw, top_k, where, minimum=1)
    if model_type in ("qwen3_moe", *_DEEPSEEK):
        out["moe_intermediate_size"] = _whole(raw, "moe_intermediate_size", where, minimum=1)
    out["norm_topk_prob"] = _flag(raw, "norm_topk_prob", where, model_type in ("mixtral", "gpt_oss", "minimax_m2"))
    if model_type == "qwen3_moe":
        if raw.get("mlp_only_layers"):
            raise ServesimError(f"{where}: mlp_only_layers = {raw['mlp_only_layers']}: dense layers among the "
                                "MoE layers are not supported")
        if _whole(raw, "decoder_sparse_step", where, 1, 1) != 1:
            raise ServesimError(f"{where}: decoder_sparse_step = {raw['decoder_sparse_step']}: MoE on every "
                                "n-th layer is not supported")
    if model_type in _DEEPSEEK:
        if _whole(raw, "moe_layer_freq", where, 1, 1) != 1:
            raise ServesimError(f"{where}: moe_layer_freq = {raw['moe_layer_freq']}: MoE on every n-th layer is "
                                "not supported")
        out["first_k_dense_replace"] = _whole(raw, "first_k_dense_replace", where, 0)
        out["shared_expert_intermediate_size"] = (_whole(raw, "n_shared_experts", where, 0)
                                                  * out["moe_intermediate_size"])
    if model_type == "minimax_m2":
        out["shared_expert_intermediate_size"] = _whole(raw, "shared_intermediate_size", where, 0)
    if model_type == "llama4_text":
        # Llama4MoE (vllm/model_executor/models/llama4.py): routed experts and one shared expert, each
        # intermediate_size wide; top-k by router logit, then a sigmoid of the chosen (renormalize=False).
        out["moe_intermediate_size"] = _whole(raw, "intermediate_size", where, minimum=1)
        out["shared_expert_intermediate_size"] = out["moe_intermediate_size"]
    return out


def _llama4_fields(raw: dict, where: str, layers: int) -> dict:
    """Llama 4's layers as vLLM builds them (vllm/model_executor/models/llama4.py): layer i is NoPE
    with global attention where no_rope_layers[i] is 0 (by default every fourth layer:
    transformers' Llama4TextConfig, no_rope_layer_interval 4), else RoPE with chunked local
    attention (ChunkedLocalAttention) when attention_chunk_size is set (Llama4Attention); it is MoE
    where (i + 1) % interleave_moe_layer_step == 0, else a dense MLP of intermediate_size_mlp
    (Llama4DecoderLayer). vLLM places the MoE layers by interleave_moe_layer_step alone, so a
    moe_layers list that differs is refused, as is a layer_types list that differs from what
    no_rope_layers and attention_chunk_size make."""
    nope = raw.get("no_rope_layers")
    if not nope:  # transformers: the default where the file has none (or an empty list)
        interval = _whole(raw, "no_rope_layer_interval", where, 4, 1)
        nope = [int((i + 1) % interval != 0) for i in range(layers)]
    elif not (isinstance(nope, list) and len(nope) == layers
              and all(type(v) is int and v in (0, 1) for v in nope)):  # noqa: E721 (not true or false)
        raise ServesimError(f"{where}: no_rope_layers = {nope!r}, expected {layers} entries of 0 or 1")
    out: dict = {}
    chunked = raw.get("attention_chunk_size") is not None
    if chunked:
        out["attention_chunk_size"] = _whole(raw, "attention_chunk_size", where, minimum=1)
    types = tuple("chunked_attention" if rope and chunked else "full_attention" for rope in nope)
    if "chunked_attention" in types:
        out["layer_types"] = types
    given = _layer_types(raw, where, "llama4_text")
    if given is not None and tuple(given) != types:
        raise ServesimError(f"{where}: layer_types = {given!r} differs from what no_rope_layers and "
                            "attention_chunk_size make, which vLLM reads")
    step = _whole(raw, "interleave_moe_layer_step", where, 1, 1)
    moe_layers = raw.get("moe_layers")
    if moe_layers is not None and moe_layers != list(range(step - 1, layers, step)):
        raise ServesimError(f"{where}: moe_layers = {moe_layers!r}: vLLM places the MoE layers by "
                            f"interleave_moe_layer_step ({step}) alone")
    out["interleave_moe_layer_step"] = step
    if raw.get("intermediate_size_mlp") is not None or step > 1:
        out["intermediate_size"] = _whole(raw, "intermediate_size_mlp", where, minimum=1)
    return out


INDEXER_QUANT_BLOCK = 128  # DeepseekV32Indexer.quant_block_size (vllm/models/deepseek_v32/attention.py)


def _sparse_fields(raw: dict, where: str, layers: int) -> dict:
    """DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5: vLLM's Indexer,
    vllm/model_executor/models/deepseek_v2.py): index_topk keys a query attends, the indexer's
    heads and head size, and which layers share another's top-k (`_indexer_types`). Without
    kv_lora_rank there is no MLA to make sparse."""
    if raw.get("kv_lora_rank") is None:
        raise ServesimError(f"{where}: no kv_lora_rank in it: DeepSeek sparse attention is sparse MLA")
    fields = {f: _whole(raw, f, where, minimum=1) for f in ("index_topk", "index_n_heads", "index_head_dim")}
    if fields["index_head_dim"] % INDEXER_QUANT_BLOCK:  # its keys are fp8 with one fp32 scale a block of 128
        raise ServesimError(f"{where}: index_head_dim = {fields['index_head_dim']}: vLLM's indexer quantizes its "
                            f"keys in blocks of {INDEXER_QUANT_BLOCK} values (quant_block_size), so it must be a "
                            f"multiple of {INDEXER_QUANT_BLOCK}")
    types = _indexer_types(raw, where, layers)
    if "shared" in types:
        fields["indexer_types"] = types
    return fields


def _indexer_types(raw: dict, where: str, layers: int) -> tuple:
    """Which layers run their own lightning indexer ("full") and which reuse the top-k indices the
    last one left in the shared buffer ("shared"), as vLLM decides it (IndexCache;
    vllm/models/deepseek_v32/attention.py, DeepseekV32Attention.__init__, `skip_topk`, and
    vllm/model_executor/models/deepseek_v2.py): layer i shares where index_topk_pattern[i] is "S"
    (a layer past the pattern's end has its own), or without a pattern where
    max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0 (offset 2 and frequency 1 by
    default: every layer its own). GLM-5.2 (frequency 4, offset 3): layers 0, 1, 2, 6, 10, ... run
    their own, 21 of 78. transformers' indexer_types, where the file has it, must say the same (vLLM
    does not read it; a file whose two descriptions differ is refused)."""
    freq = _whole(raw, "index_topk_freq", where, 1, 1)
    offset = _whole(raw, "index_skip_topk_offset", where, 2)
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if not (isinstance(pattern, str) or (isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))):
            raise ServesimError(f"{where}: index_topk_pattern = {pattern!r}, expected a string (or a list of "
                                "strings), \"S\" for a layer that shares the top-k")
        if (raw.get("model_type") == "glm_moe_dsa" and isinstance(pattern, str) and set(pattern) - set("FS")
                and raw.get("indexer_types") is None):  # GlmMoeDsaConfig maps each letter to "full" or "shared"
            raise ServesimError(f"{where}: index_topk_pattern = {pattern!r}: transformers' GlmMoeDsaConfig, which "
                                f"vLLM loads it with, reads each letter as F or S and fails on {sorted(set(pattern) - set('FS'))}")
        types = tuple("shared" if i < len(pattern) and pattern[i] == "S" else "full" for i in range(layers))
        how = f"index_topk_pattern {pattern!r}"
    else:
        for field in ("index_topk_freq", "index_skip_topk_offset"):
            if field in raw and raw[field] is None:  # vLLM's getattr finds the null, not its default
                raise ServesimError(f"{where}: {field} = null: vLLM computes which layers share the top-k with "
                                    "it as given and fails on a null (leave it out for its default)")
        types = tuple("shared" if max(i - offset + 1, 0) % freq else "full" for i in range(layers))
        how = f"index_topk_freq {freq} and index_skip_topk_offset {offset}"
    if types and types[0] == "shared":
        raise ServesimError(f"{where}: {how} make layer 0 share the top-k, but no earlier layer's indexer picks it")
    given = raw.get("indexer_types")
    if given is not None:
        if not (isinstance(given, list) and all(t in INDEXER_TYPES for t in given)):
            raise ServesimError(f"{where}: indexer_types = {given!r}, expected a list of "
                                f"{' and '.join(repr(t) for t in INDEXER_TYPES)}")
        if tuple(given) != types:
            if len(given) != len(types):
                said = f"{len(given)} entries for {len(types)} layers"
            else:
                first = next(i for i, (a, b) in enumerate(zip(given, types)) if a != b)
                said = f"layer {first} {given[first]!r}, vLLM's {types[first]!r}"
            raise ServesimError(f"{where}: indexer_types differs from what {how} give vLLM ({said}), which vLLM "
                                "reads instead")
    return types


def _mla_fields(raw: dict, where: str) -> dict:
    if raw.get("kv_lora_rank") is None:
        for field in _MLA_FIELDS:
            if raw.get(field) is not None:
                raise ServesimError(f"{where}: {field} = {raw[field]} without kv_lora_rank: cannot price it")
        return {}
    out = {f: _whole(raw, f, where, minimum=1) for f in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                          "v_head_dim")}
    out["q_lora_rank"] = _whole(raw, "q_lora_rank", where, 0)
    return out


def _window_fields(raw: dict, where: str, model_type: str, layers: int) -> dict:
    """Which layers slide, as vLLM reads each family (layer_types when the file has them)."""
    window = raw.get("sliding_window")
    types = _layer_types(raw, where, model_type)
    if types is not None and len(types) != layers:
        raise ServesimError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers = {layers}")
    if model_type == "llama4_text":  # its layers are chunked-local or global (_llama4_fields), none slides
        if window is not None:
            raise ServesimError(f"{where}: sliding_window = {window!r}: Llama 4's layers are chunked-local or global "
                                "(vLLM's Llama4Attention), none slides")
        return {}
    if model_type == "qwen3_moe":
        if _flag(raw, "use_sliding_window", where, False):
            raise ServesimError(f"{where}: use_sliding_window = true: Qwen's max_window_layers windows are not "
                                "supported")
        if types and "sliding_attention" in types:
            raise ServesimError(f"{where}: layer_types has sliding_attention layers: Qwen3-MoE's windows are not "
                                "supported")
        return {}
    if not _flag(raw, "use_sliding_window", where, True):
        window = None
    if types is None and model_type == "gemma2":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    elif types is None and model_type == "gemma3_text":
        pattern = _whole(raw, "sliding_window_pattern", where, 6, 1)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif types is None and window is not None:
        types = ["sliding_attention"] * layers  # Mistral-7B-v0.1, Mixtral with a window: every layer
    if not types or "sliding_attention" not in types:
        return {}
    if model_type in _DEEPSEEK:  # vLLM's DeepSeek-V2/V3 and sparse MLA layers take no window (deepseek_v2.py)
        said = f"sliding_window = {window!r}" if window is not None else "layer_types has sliding_attention layers"
        raise ServesimError(f"{where}: {said}: vLLM's {model_type} layers attend the whole context, none slides")
    if window is None:
        raise ServesimError(f"{where}: layer_types has sliding_attention layers but sliding_window is null")
    window = _whole(raw, "sliding_window", where, minimum=1)
    return {"sliding_window": window, "layer_types": tuple(types)}


def _quantization(config, where: str, has_experts: bool) -> tuple[str, str]:
    """(weight_dtype, expert_dtype) of a checkpoint's quantization_config; ("", "") without one."""
    if config is None:
        return "", ""
    if not isinstance(config, dict):
        raise ServesimError(f"{where}: quantization_config = {config!r}, expected an object")
    method = config.get("quant_method")
    if method in (None, "modelopt") and str(config.get("quant_algo", "")).upper() == "FP8":
        return "fp8", "fp8"  # NVIDIA ModelOpt's FP8: per-tensor scaled weights (vLLM's ModelOptFp8Config)
    if method in (None, "modelopt") and str(config.get("quant_algo", "")).upper() == "NVFP4":
        excluded = _module_names(config, "exclude_modules", where) or _module_names(config, "ignore", where)
        return _nvfp4_experts(excluded, config, where, has_experts)
    if method == "fp8":
        block = config.get("weight_block_size")
        if block is None:
            return "fp8", "fp8"
        if not isinstance(block, list) or block != [FP8_BLOCK, FP8_BLOCK]:
            raise ServesimError(f"{where}: quantization_config weight_block_size = {block}: servesim prices fp8 "
                                f"blocks of [{FP8_BLOCK}, {FP8_BLOCK}]")
        return "fp8-block", "fp8-block"
    if method == "mxfp4":
        if not has_experts:
            raise ServesimError(f"{where}: quantization_config quant_method = 'mxfp4' without experts")
        return "bf16", "mxfp4"  # gpt-oss: attention, router, embeddings and LM head are not converted
    if method == "compressed-tensors":
        groups = config.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise ServesimError(f"{where}: quantization_config config_groups = {_short(groups)}, expected an object "
                                "of groups")
        weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
        for w in weights:
            if not isinstance(w, dict):
                raise ServesimError(f"{where}: quantization_config config_groups has weights = {_short(w)}, "
                                    "expected an object (num_bits, type, strategy, group_size)")
        if weights and all(w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in
                           ("tensor", "channel") for w in weights):
            return "fp8", "fp8"  # fp8 weights with per-tensor or per-channel scales
        if weights and all(w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == NVFP4_GROUP
                           for w in weights):
            return _nvfp4_experts(_module_names(config, "ignore", where), config, where, has_experts)
        int4 = [w for w in weights if w.get("num_bits") == 4 and w.get("type") == "int"]
        if has_experts and len(int4) == len(weights) == 1 and int4[0].get("group_size") == INT4_GROUP:
            ignore = " ".join(_module_names(config, "ignore", where))
            if "self_attn" in ignore and "shared_experts" in ignore:
                return "bf16", "int4"  # Kimi K2.5: int4 routed experts, the rest bf16
        raise ServesimError(f"{where}: quantization_config config_groups = {groups}: servesim prices "
                            f"compressed-tensors int4 (group {INT4_GROUP}) routed experts only")
    raise ServesimError(f"{where}: quantization_config quant_method = {method!r} is not supported (fp8, ModelOpt "
                        "FP8 and NVFP4, mxfp4, compressed-tensors fp8, int4 and NVFP4)")


def _module_names(config: dict, field: str, where: str) -> list[str]:
    """A quantization_config's list of module names (`ignore`, `exclude_modules`); [] where it is absent or null."""
    names = config.get(field)
    if names is None:
        return []
    if not (isinstance(names, list) and all(isinstance(x, str) for x in names)):
        raise ServesimError(f"{where}: quantization_config {field} = {_short(names)}, expected a list of module "
                            "names")
    return names


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def checkpoint_kv_cache(config) -> str:
    """"fp8" where a checkpoint's quantization_config states an fp8 KV cache (ModelOpt's
    kv_cache_quant_algo FP8, or a kv_cache_scheme of 8-bit floats, ModelOpt's or compressed-tensors'),
    as vLLM reads it (vllm/utils/torch_utils.py get_kv_cache_quant_algo_string;
    model_executor/layers/attention/attention.py for compressed-tensors); else ""."""
    if not isinstance(config, dict):
        return ""
    scheme = config.get("kv_cache_scheme") or config.get("kv_cache_quant_algo")
    if isinstance(scheme, dict):
        return "fp8" if scheme.get("num_bits") == 8 and scheme.get("type") == "float" else ""
    return "fp8" if str(scheme or "").upper() == "FP8" else ""


def _nvfp4_experts(excluded, config: dict, where: str, has_experts: bool) -> tuple[str, str]:
    """An NVFP4 checkpoint (NVIDIA ModelOpt's, as config.json's compressed-tensors or ModelOpt
    quantization_config writes it): its routed experts in nvfp4, and its attention's linears in nvfp4
    too unless it excludes them (`self_attn`; an MLA model's must be: `extended_from_hf`). Where the
    attention is excluded, the linears it quantizes besides the routed experts (a shared expert, the
    first dense layers' MLPs) are priced in bf16, so their few weights are counted at most four times
    over (Kimi K2.5's shared experts: 0.3% of its weights in nvfp4)."""
    text = " ".join(str(x) for x in excluded or [])
    if not has_experts:
        # A dense model's: every linear but the LM head in nvfp4, served as --dtype fp4 (`served_dtype`).
        if any("lm_head" not in str(x) for x in excluded or []):
            raise ServesimError(f"{where}: quantization_config excludes {text[:200]} from NVFP4: servesim prices "
                                "a dense NVFP4 checkpoint with every linear but the LM head quantized")
        return "nvfp4", ""
    if "self_attn" not in text:  # (nvidia/Qwen3-235B-A22B-NVFP4: its attention's linears in nvfp4 too)
        return "nvfp4", "nvfp4"
    return "bf16", "nvfp4"
