"""A Llama/Qwen-style decoder over a flat token batch: RMSNorm, RoPE, grouped-query attention
(with QK-norm where the preset has it), SwiGLU MLP, or mixture-of-experts layers (Qwen3-MoE,
Mixtral: backends/real/moe.py).

Dense layers see `[num_tokens, hidden]` rows and never notice which request a row belongs to;
only attention reads the batch's metadata. Q/K/V and gate/up projections are fused into one
matmul each (Hugging Face's separate tensors are concatenated when weights are loaded).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from backends.model_config import ModelConfig
from backends.real.moe import check_runnable_moe, moe_forward, moe_spec
from backends.real.ops import Ops
from backends.real.reference import AttentionMetadata, rope_cos_sin
from sim.errors import ServesimError


def check_runnable(cfg: ModelConfig) -> None:
    """The decoder below has no biases and knows plain RoPE and Llama 3.1's scaling only; its MoE
    layers are Qwen3-MoE's and Mixtral's, without MLA or sliding windows."""
    check_runnable_moe(cfg)
    rope_type = None if cfg.rope_scaling is None else cfg.rope_scaling.get("rope_type")
    if rope_type not in (None, "llama3"):
        raise ServesimError(f"model {cfg.name}: the real backend supports plain RoPE and rope_type llama3, "
                            f"not {rope_type!r}")
    if rope_type == "llama3":
        check_llama3_scaling(cfg.name, cfg.rope_scaling)
    if cfg.qkv_bias:
        raise ServesimError(f"model {cfg.name}: the real backend's decoder has no q/k/v biases ({cfg.architecture})")


def check_llama3_scaling(name: str, scaling: dict) -> None:
    """rope_scaling of rope_type llama3 holds the four numbers its frequencies are computed from
    (`llama3_scaled_inv_freq`), each above 0, high_freq_factor above low_freq_factor."""
    for field in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = scaling.get(field)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value > 0):
            raise ServesimError(f"model {name}: rope_scaling {field} = {value!r}, expected a number above 0 "
                                "(rope_type llama3 needs factor, low_freq_factor, high_freq_factor and "
                                "original_max_position_embeddings)")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ServesimError(f"model {name}: rope_scaling high_freq_factor ({scaling['high_freq_factor']}) must be "
                            f"above low_freq_factor ({scaling['low_freq_factor']})")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, index: int = 0):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        spec = moe_spec(cfg)
        self.moe = spec if spec is not None and index in spec.sparse_layers else None

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.input_layernorm = param(h)
        self.qkv_proj = param(cfg.q_size + 2 * cfg.kv_size, h)
        self.q_norm = param(hd) if cfg.qk_norm else None
        self.k_norm = param(hd) if cfg.qk_norm else None
        self.o_proj = param(h, cfg.q_size)
        self.post_attention_layernorm = param(h)
        if self.moe is None:
            self.gate_up_proj = param(2 * cfg.intermediate_size, h)
            self.down_proj = param(h, cfg.intermediate_size)
            self.router = self.w13 = self.w2 = None
        else:
            e, i = self.moe.num_experts, self.moe.intermediate_size
            self.gate_up_proj = self.down_proj = None
            self.router = param(e, h)  # Hugging Face's mlp.gate
            self.w13 = param(e, 2 * i, h)  # each expert's gate rows, then its up rows
            self.w2 = param(e, h, i)

    def mlp(self, ops: Ops, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: the dense SwiGLU MLP, or the routed experts."""
        if self.moe is not None:
            return moe_forward(ops, h, self.router, self.w13, self.w2, self.moe)
        return F.linear(ops.silu_mul(F.linear(h, self.gate_up_proj)), self.down_proj)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device),
                                         requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, n) for n in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        # [max_positions, head_dim] fp32: cos | sin
        self.register_buffer("cos_sin_cache", rope_cos_sin(cfg.max_position_embeddings, cfg.head_dim,
                                                           cfg.rope_theta, device, cfg.rope_scaling),
                             persistent=False)
        self.scale = cfg.head_dim ** -0.5

    @torch.no_grad()
    def forward(self, ops: Ops, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final hidden states of the `logits_indices` rows, [n, hidden]."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        num_tokens = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed_tokens)  # [T, h]
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual, h = x, ops.rms_norm(x, layer.input_layernorm, eps)
            else:
                h, residual = ops.add_rms_norm(x, residual, layer.input_layernorm, eps)
            qkv = F.linear(h, layer.qkv_proj)  # [T, q_size + 2 * kv_size]
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(num_tokens, cfg.num_attention_heads, cfg.head_dim)
            k = k.view(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            v = v.view(num_tokens, cfg.num_key_value_heads, cfg.head_dim)
            q, k = ops.qk_norm_rope(q, k, positions, self.cos_sin_cache, layer.q_norm, layer.k_norm, eps)
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)  # write first: a chunk attends to itself
            o = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, nh, hd]
            x = F.linear(o.reshape(num_tokens, cfg.q_size), layer.o_proj)
            h, residual = ops.add_rms_norm(x, residual, layer.post_attention_layernorm, eps)
            x = layer.mlp(ops, h)
        # Only the rows that get logits go through the final norm.
        out, _ = ops.add_rms_norm(x[logits_indices], residual[logits_indices], self.norm, eps)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()
