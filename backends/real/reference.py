"""Pure-torch references: the CPU path of the real backend and what the Triton kernels are tested against.

The paged KV cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`;
a slot is `block * block_size + offset`, so a cache viewed as `[num_slots, num_kv_heads, head_dim]`
is indexed by `slot_mapping` directly. A request reads its context through its row of the block
table: logical block j of the request is physical block `block_table[r, j]`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


class AttentionMetadata(NamedTuple):
    """Where each request's queries are and where its context lives, on the device and the host."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    query_start_loc_np: np.ndarray  # host copies, so the reference path needs no device sync
    seq_lens_np: np.ndarray


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., d], normalised over d in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a pre-norm layer's residual add and norm."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rope_cos_sin(max_positions: int, head_dim: int, theta: float, device=None,
                 scaling: dict | None = None) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half, sin in the second, fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    if scaling is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's RoPE frequencies for long contexts: wavelengths longer than the original context
    / low_freq_factor are stretched by `factor`, those shorter than it / high_freq_factor are kept,
    and the ones between are blended smoothly (as Hugging Face's `llama3` rope type)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos_sin: [num_tokens, head_dim] (rows at the tokens'
    positions). Hugging Face's rotate-half layout: dims i and i + head_dim/2 form a pair."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-norm (per head, when the model has it) then RoPE. q: [T, nh, hd], k: [T, nkv, hd]."""
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    cos_sin = cos_sin_cache[positions]
    return apply_rope(q, cos_sin), apply_rope(k, cos_sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * i] -> [T, i]: SwiGLU's silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's K and V ([T, nkv, hd]) at its slot of the caches."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of a mixed varlen batch over the paged cache. q: [T, nh, hd] -> [T, nh, hd].

    Request r's queries are rows [qsl[r], qsl[r+1]) at positions seq_len - q_len ... seq_len - 1;
    the j-th of them sees context positions 0 .. seq_len - q_len + j. Decodes (q_len 1) are done
    together, padded to the longest context; longer queries one request at a time."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    q_lens = np.diff(qsl)
    out = torch.empty_like(q)
    decodes = np.flatnonzero(q_lens == 1)
    if len(decodes):
        max_ctx = int(seq_lens[decodes].max())
        nb = -(-max_ctx // block_size)
        rows = torch.from_numpy(decodes).to(q.device)
        tables = meta.block_table[rows, :nb].long()  # [D, nb]
        k = k_cache[tables].reshape(len(decodes), nb * block_size, num_kv_heads, head_dim)
        v = v_cache[tables].reshape(len(decodes), nb * block_size, num_kv_heads, head_dim)
        lens = torch.from_numpy(seq_lens[decodes].astype(np.int64)).to(q.device)
        mask = torch.arange(nb * block_size, device=q.device)[None, :] < lens[:, None]  # [D, ctx]
        token_rows = torch.from_numpy(qsl[decodes].astype(np.int64)).to(q.device)
        o = F.scaled_dot_product_attention(
            q[token_rows][:, :, None, :],  # [D, nh, 1, hd]
            k.transpose(1, 2), v.transpose(1, 2),  # [D, nkv, ctx, hd]
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out[token_rows] = o[:, :, 0, :]
    for r in np.flatnonzero(q_lens > 1).tolist():
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        q_len = end - start
        nb = -(-seq_len // block_size)
        table = meta.block_table[r, :nb].long()
        k = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        # Query j sits at position seq_len - q_len + j and sees keys up to it.
        mask = (torch.arange(seq_len, device=q.device)[None, :]
                <= torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None])
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=True)  # [1, nh, q_len, hd]
        out[start:end] = o[0].transpose(0, 1)
    return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention of one whole sequence, no cache. q: [n, nh, hd], k, v: [n, nkv, hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    n = q.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


@torch.no_grad()
def dense_logits(model, token_ids) -> torch.Tensor:
    """[n, vocab] fp32 logits at every position of one whole sequence computed alone: no cache, no
    paging, no batching. What a mixed paged batch must reproduce. `model` is a `Decoder`; its MLP or
    MoE layers run through the torch ops (a token's MLP does not depend on the batch)."""
    from backends.real.ops import TORCH_OPS as ops

    cfg, eps = model.cfg, model.cfg.rms_norm_eps
    device = model.embed_tokens.device
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    n = ids.shape[0]
    cos_sin = model.cos_sin_cache[:n]
    x = model.embed_tokens[ids]
    for layer in model.layers:
        h = rms_norm(x, layer.input_layernorm, eps)
        q, k, v = F.linear(h, layer.qkv_proj).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(n, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(n, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(n, cfg.num_key_value_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
        q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
        x = x + F.linear(dense_attention(q, k, v, model.scale).reshape(n, cfg.q_size), layer.o_proj)
        x = x + layer.mlp(ops, rms_norm(x, layer.post_attention_layernorm, eps))
    return model.logits(rms_norm(x, model.norm, eps))
