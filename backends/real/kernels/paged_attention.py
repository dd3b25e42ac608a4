"""One paged-attention kernel for a whole mixed batch: prefill chunks, chunk continuations and
decodes together, reading context through the block table, with online softmax.

A program owns one KV head of one request and a tile of BLOCK_Q of its query tokens; the tile's
rows are those tokens times the GROUP query heads that share the KV head, so each K/V tile is
loaded once for all of them (grouped-query aware):

    row m of the tile  ->  token  q_block * BLOCK_Q + m // GROUP,  head  kv_head * GROUP + m % GROUP

Programs are numbered over the flat batch: request r's tiles start at qsl[r] // BLOCK_Q + r, so
T // BLOCK_Q + num_reqs programs cover every request (vLLM's unified-attention numbering); a
program past its request's last tile returns at once. Query token j of a request with q_len
queries and seq_len context sits at position seq_len - q_len + j and sees keys 0 .. that position.

Split-KV (flash decoding): a decode-only batch of few requests would leave most of the GPU idle
(one program per request and KV head, each walking a long context), so the context is cut into
`num_splits` segments (per request: its context over num_splits, rounded up to BLOCK_N keys),
one program each; they write their unnormalised partial results (running max, sum, accumulator)
and a second kernel merges them. Nothing in a launch depends on the lengths but the split count,
so a captured CUDA graph replays for any contexts.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from backends.real.reference import AttentionMetadata


@triton.jit
def _find_request(query_start_loc_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose tiles include program `pid`: the last r with qsl[r] // BLOCK_Q + r <= pid."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, partial_ptr, max_sum_ptr, query_start_loc_ptr, seq_lens_ptr,
    block_table_ptr, scale_log2, num_reqs, num_tokens, stride_q_token, stride_q_head, stride_o_token,
    stride_o_head, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    r = _find_request(query_start_loc_ptr, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + r)
    q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + r)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    cached_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] query index within the request
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_q_token + head[:, None] * stride_q_head
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, D]
    q_pos = cached_len + tok  # [BLOCK_M] each row's position: it sees keys 0 .. q_pos

    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)  # running max (log2 units); finite, so empty rows stay 0
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    # The tile's last query sees keys up to cached_len + (q_block + 1) * BLOCK_Q - 1.
    kv_end = tl.minimum(seq_len, cached_len + (q_block + 1) * BLOCK_Q)
    kv_start = 0
    if SPLIT:  # this program's segment of the context (possibly empty)
        split_len = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        kv_start = split * split_len
        kv_end = tl.minimum(kv_end, kv_start + split_len)
    table = block_table_ptr + r.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical positions
        key_valid = keys < kv_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_off = slot[None, :] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[:, None]  # [D, BLOCK_N]
        kv_mask = dim_valid[:, None] & key_valid[None, :]
        k_t = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, k_t, input_precision="ieee")
        else:
            s = tl.dot(q, k_t)
        s = s * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = (keys[None, :] <= q_pos[:, None]) & key_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.trans(tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0))  # [BLOCK_N, D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    row_token = (q_start + tok).to(tl.int64)
    if SPLIT:  # partial results: [num_splits, T, num_heads, (HEAD_DIM_P | 2)], merged by _merge_splits_kernel
        index = (split.to(tl.int64) * num_tokens + row_token) * NUM_HEADS + head  # [BLOCK_M] (split, token, head)
        tl.store(partial_ptr + index[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(max_sum_ptr + index * 2, m_i, mask=row_valid)
        tl.store(max_sum_ptr + index * 2 + 1, l_i, mask=row_valid)
    else:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + row_token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit(do_not_specialize=["num_splits", "num_tokens"])
def _merge_splits_kernel(out_ptr, partial_ptr, max_sum_ptr, num_splits, num_tokens, stride_o_token, stride_o_head,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                         SPLITS_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    split_valid = splits < num_splits
    index = (splits.to(tl.int64) * num_tokens + token) * NUM_HEADS + head  # [SPLITS_P]
    maxes = tl.load(max_sum_ptr + index * 2, mask=split_valid, other=-1e30)
    sums = tl.load(max_sum_ptr + index * 2 + 1, mask=split_valid, other=0.0)
    weight = tl.exp2(maxes - tl.max(maxes, axis=0))  # an empty segment has max -1e30 and weighs nothing
    dims = tl.arange(0, HEAD_DIM_P)
    acc = tl.load(partial_ptr + index[:, None] * HEAD_DIM_P + dims[None, :], mask=split_valid[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(sums * weight, axis=0)
    tl.store(out_ptr + token * stride_o_token + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def tile_shape(group: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, num_warps): 16 rows for decode-only batches (a decode's GROUP heads fill
    them), 64 with short chunks, 128 when a long prefill chunk makes the step compute-bound."""
    rows, num_warps = (16, 4) if max_query_len <= 1 else (64, 4) if max_query_len < 128 else (128, 8)
    block_q = max(1, rows // group)
    return block_q, max(16, triton.next_power_of_2(block_q * group)), num_warps


# A decode-only batch is split when its requests x KV heads make fewer than two programs per
# streaming multiprocessor; each segment keeps at least MIN_SPLIT_KEYS keys.
MIN_SPLIT_KEYS = 512
MAX_SPLITS = 32


def num_kv_splits(num_programs: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    if max_query_len > 1:
        return 1
    wanted = -(-2 * num_sms // num_programs)
    return max(1, min(wanted, max_seq_len // MIN_SPLIT_KEYS, MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, block_n: int = 64, num_splits: int | None = None) -> torch.Tensor:
    """q: [T, nh, hd] -> [T, nh, hd]; caches: [num_blocks, block_size, nkv, hd] contiguous.
    `num_splits`: context segments per request (None: chosen from the batch and the GPU)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_reqs = meta.seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    block_q, block_m, num_warps = tile_shape(group, meta.max_query_len)
    assert num_splits is None or 1 <= num_splits <= MAX_SPLITS
    if num_splits is None:
        num_splits = 1 if q.device.type != "cuda" else num_kv_splits(
            num_reqs * num_kv_heads, meta.max_query_len, meta.max_seq_len, _num_sms(q.device))
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        partial = torch.empty(num_splits, num_tokens, num_heads, head_dim_p, dtype=torch.float32, device=q.device)
        max_sum = torch.empty(num_splits, num_tokens, num_heads, 2, dtype=torch.float32, device=q.device)
    else:
        partial = max_sum = out  # not read
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, partial, max_sum, meta.query_start_loc, meta.seq_lens, meta.block_table,
        scale * 1.4426950408889634, num_reqs, num_tokens, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), meta.block_table.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        SPLIT=num_splits > 1, num_warps=num_warps, num_stages=2)
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial, max_sum, num_splits, num_tokens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            SPLITS_P=MAX_SPLITS)  # fixed, so no split count compiles a new variant mid-run
    return out
