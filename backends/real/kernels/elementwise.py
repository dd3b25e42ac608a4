"""Fused per-token kernels around the matmuls: RMSNorm (with the residual add), QK-norm + RoPE,
and SwiGLU's silu(gate) * up. One launch each instead of torch's chain of small ops, which is what
keeps a decode step of a large model from being bound by kernel launches. All math in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                     DIM: tl.constexpr, DIM_P: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, DIM_P)
    mask = cols < DIM
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_ptr + row * stride_r + cols, x.to(residual_ptr.dtype.element_ty), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rms_norm(x, residual, weight, eps):
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        r2 = residual.view(-1, dim) if residual is not None else x2
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), eps,
                                         DIM=dim, DIM_P=triton.next_power_of_2(dim),
                                         HAS_RESIDUAL=residual is not None)
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, d] (rows with a contiguous last dim) -> [T, d]."""
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is written into `residual` in place."""
    out = _launch_rms_norm(x, residual, weight, eps)
    return out, residual


@triton.jit
def _norm_rope_heads(x_ptr, out_ptr, token, stride_x_token, stride_x_head, cos, sin, norm_ptr, eps,
                     NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                     HAS_NORM: tl.constexpr):
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HALF_P)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    src = x_ptr + token * stride_x_token + heads * stride_x_head + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [HEADS_P, HALF_P]: dims i and i + HALF pair
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(norm_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        x1 = x1 * inv_rms * w1
        x2 = x2 * inv_rms * w2
    dst = out_ptr + token * (NUM_HEADS * 2 * HALF) + heads * (2 * HALF) + dims
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr,
                         stride_q_token, stride_q_head, stride_k_token, stride_k_head, eps,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
                         KV_HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                         HAS_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_P)[None, :]
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + dims, mask=dims < HALF, other=0.0)
    _norm_rope_heads(q_ptr, q_out_ptr, token, stride_q_token, stride_q_head, cos, sin, q_norm_ptr, eps,
                     NUM_HEADS, HEADS_P, HALF, HALF_P, HAS_NORM)
    _norm_rope_heads(k_ptr, k_out_ptr, token, stride_k_token, stride_k_head, cos, sin, k_norm_ptr, eps,
                     NUM_KV_HEADS, KV_HEADS_P, HALF, HALF_P, HAS_NORM)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, nh, hd], k: [T, nkv, hd] (last dim contiguous) -> new contiguous q, k."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty(
        k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        has_norm = q_norm is not None
        half = head_dim // 2
        _qk_norm_rope_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos_sin_cache, q_norm if has_norm else q, k_norm if has_norm else k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_P=triton.next_power_of_2(num_heads),
            KV_HEADS_P=triton.next_power_of_2(num_kv_heads), HALF=half, HALF_P=triton.next_power_of_2(half),
            HAS_NORM=has_norm)
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, INTERMEDIATE: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * i] -> [T, i]."""
    num_tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), INTERMEDIATE=inter, BLOCK=block)
    return out
