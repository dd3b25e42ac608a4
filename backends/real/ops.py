"""The per-token kernels a forward pass calls, as two interchangeable sets: the torch references
(CPU, tests) and the Triton kernels (GPU). The model takes one set; nothing global is switched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from backends.real import moe, reference


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable  # (x, weight, eps) -> y
    add_rms_norm: Callable  # (x, residual, weight, eps) -> (y, x + residual)
    qk_norm_rope: Callable  # (q, k, positions, cos_sin_cache, q_norm, k_norm, eps) -> (q, k)
    silu_mul: Callable  # (gate_up) -> silu(gate) * up
    write_kv: Callable  # (k, v, k_cache, v_cache, slot_mapping) -> None
    paged_attention: Callable  # (q, k_cache, v_cache, meta, scale) -> out
    grouped_gemm: Callable  # (a rows sorted by expert [R, K], w [E, N, K], moe.SortedRows) -> [R, N]


TORCH_OPS = Ops("torch", reference.rms_norm, reference.add_rms_norm, reference.qk_norm_rope, reference.silu_mul,
                reference.write_kv, reference.paged_attention, moe.torch_grouped_gemm)


def triton_ops() -> Ops:
    """The Triton kernels; imports triton, so it is called only when they are used."""
    from backends.real.kernels import elementwise, grouped_gemm, kv_write, paged_attention

    return Ops("triton", elementwise.rms_norm, elementwise.add_rms_norm, elementwise.qk_norm_rope,
               elementwise.silu_mul, kv_write.write_kv, paged_attention.paged_attention, grouped_gemm.grouped_gemm)
