"""Shapes of a Llama-style decoder layer's matmuls."""

from __future__ import annotations


def gemm_shapes(model: dict) -> list[tuple[int, int]]:
    """(in, out) features of each per-layer matmul: fused QKV, O, fused gate+up, down."""
    h, i, hd = model["hidden_size"], model["intermediate_size"], model["head_dim"]
    nh, nkv = model["num_attention_heads"], model["num_key_value_heads"]
    return [(h, (nh + 2 * nkv) * hd), (nh * hd, h), (h, 2 * i), (i, h)]
