"""Write each new token's K and V into the paged cache at its `slot_mapping` slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_k_token, stride_k_head, stride_v_token, stride_v_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
    # The cache is contiguous: [num_slots, num_kv_heads, head_dim].
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, nkv, hd] (the last dim contiguous); caches: [num_blocks, block_size, nkv, hd] contiguous."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim))
