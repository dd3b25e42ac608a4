"""The experts' grouped GEMM in one Triton launch: rows sorted by expert, each expert's rows cut
into tiles of BLOCK_M, each program computes one (tile, BLOCK_N columns) block against its
expert's weight, fp32 accumulation.

The tile map (which expert and rows each tile covers) is built on the device from the per-expert
counts, over a fixed number of tiles (ceil(R / BLOCK_M) + E, enough for any split of R rows): no
host synchronisation, so a decode step with MoE layers is captured in a CUDA graph. Tiles past the
real ones cover no rows and return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
                         stride_am, stride_we, stride_wn, stride_cm,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    row_start = tl.load(tile_start_ptr + tile)
    row_end = tl.load(tile_end_ptr + tile)
    if row_start >= row_end:
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=col_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]: W[e]^T
        acc += tl.dot(a, w)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def block_m_for(num_rows: int, num_experts: int) -> int:
    """Rows per tile: 16 when the experts get 16 rows or fewer on average (decode steps), else 64.
    Two variants only, so the backend's warm-up (a long prefill and short steps) compiles both and
    no measured step pays for a compilation."""
    return 16 if num_rows <= 16 * num_experts else 64


def tile_map(starts: torch.Tensor, counts: torch.Tensor, block_m: int,
             num_tiles: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end row) of each of `num_tiles` tiles, int32 on the device; tiles past
    the real ones have first row == end row == 0."""
    num_experts = counts.shape[0]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(num_tiles, device=counts.device)
    expert = torch.searchsorted(tile_end, t, right=True)  # == E past the real tiles
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first = starts[e] + (t - (tile_end[e] - tiles[e])) * block_m
    end = torch.minimum(first + block_m, starts[e] + counts[e])
    zero = torch.zeros_like(first)
    return (e.to(torch.int32), torch.where(valid, first, zero).to(torch.int32),
            torch.where(valid, end, zero).to(torch.int32))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_rows) -> torch.Tensor:
    """a [R, K] rows sorted by expert (contiguous), w [E, N, K] -> [R, N] in a's dtype."""
    num_rows, k = a.shape
    num_experts, n, _ = w.shape
    a = a.contiguous()
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    if num_rows == 0:
        return out
    block_m = block_m_for(num_rows, num_experts)
    num_tiles = -(-num_rows // block_m) + num_experts
    experts, first, end = tile_map(sorted_rows.starts, sorted_rows.counts, block_m, num_tiles)
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (num_tiles, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, w, out, experts, first, end, n, k, a.stride(0), w.stride(0), w.stride(1),
                               out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
