"""One model's operator curves, derived from a system's operator tables (backends/costmodel/optables/tables.py).

What a profile stores (`derive` returns it, plain JSON data): for the model's per-GPU shapes at
tensor-parallel degree `tp` and GEMM dtype `dtype`,

- GEMMs: one time curve over its own rows' m grid for each of QKV, O, gate-up, down (dtype's rows)
  and the LM head (bf16 rows: vLLM does not quantize lm_head). A shape off the grid is
  interpolated between the neighbouring grid n and k, log-log (bilinear in log n, log k of log
  time, at every grid m); a dimension past the grid's largest is split into equal parts that
  are on it (p GEMMs of n / p: the same FLOPs and weight bytes) and one below the smallest is
  clamped to it; both are noted in `notes`.
- attention: of the kernel the tables measured for the framework version (FlashAttention 3 on
  Hopper, others elsewhere: `attention_kernel`), the context (prefill) grid over batch x isl and the generation (decode) grid over
  batch x KV length, for the model's per-GPU heads, KV heads, head_dim and KV-cache dtype.
  The tables are triangular (few cells with batch x length past ~128k tokens); missing cells
  are the column's largest measured batch scaled linearly in batch (independent sequences on a
  full GPU), marked in `measured`. A head count absent from the tables is interpolated linearly
  in heads between the nearest present counts with the same KV heads and head_dim (noted).
- all-reduce (read only under TP > 1): vLLM's custom all-reduce, CUDA-graph and eager kernels, up
  to 8 MiB, where vLLM uses it (NVLink, or two PCIe GPUs); NCCL past it and where the custom kernel
  is off: the system's NCCL table where there is one, else a ring over the hardware's stated link
  (NVLink or PCIe bandwidth, stored here too). The tables count messages in bf16 elements.
- memory: HBM bandwidth achieved by the table's own memory-bound GEMMs (the median of bf16
  GEMMs at m = 1 with the largest weights: bytes / time) and the kernel floor (the table's
  shortest GEMM): elementwise kernels are priced from these two, not from a datasheet.

The generation table's `step` is the number of cached tokens before the decoded one, so the
KV length a decode attends is step + 1 (AIConfigurator's collector, collector/vllm/collect_attn.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from backends.costmodel.optables.interp import fill_rows_by_scaling
from backends.costmodel.optables.tables import GEMM_DTYPES, KERNELS, KV_DTYPES, TableSet
from backends.costmodel.tensor_parallel import allreduce_latency_s, runs_custom_allreduce
from backends.hardware import node_link
from sim.errors import ServesimError

if TYPE_CHECKING:
    import pandas as pd

GEMM_OPS = ("qkv", "o", "gate_up", "down")
MiB = 2**20
# vLLM's custom all-reduce takes messages below 8 MiB (CustomAllreduce(max_size=8192 * 1024),
# vllm/distributed/device_communicators/custom_all_reduce.py; on Hopper with symmetric memory
# the limit is min(8 MiB, CUSTOM_ALL_REDUCE_MAX_SIZES["9.0"][tp]) = 256 KiB at tp = 8, and torch's
# symmetric-memory all-reduce takes 256 KiB..64 MiB, all_reduce_utils.py). The tables measure the
# custom kernel only: it prices every message up to 8 MiB (for tp = 8 past 256 KiB it stands in for
# symmetric memory, which no table measures); larger messages (symmetric memory, NCCL) are priced
# from the NVLink bandwidth.
TABLE_ALLREDUCE_MAX_BYTES = 8 * MiB
ALLREDUCE_ELEMENT_BYTES = 2  # the tables' all-reduces are of bf16 elements (see _curve)
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 (vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE)


def per_gpu_heads(model: dict, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one GPU. KV heads fewer than tp are replicated, one per GPU
    (vLLM's QKVParallelLinear, vllm/model_executor/layers/linear.py)."""
    nh, nkv = model["num_attention_heads"], model["num_key_value_heads"]
    if nh % tp:
        raise ServesimError(f"--tp {tp} does not divide the model's {nh} attention heads")
    if (nkv % tp) if nkv >= tp else (tp % nkv):
        raise ServesimError(f"--tp {tp} and the model's {nkv} KV heads: one must divide the other")
    return nh // tp, max(1, nkv // tp)


def gemm_shapes(model: dict, tp: int) -> dict[str, tuple[int, int]]:
    """(n, k) = (out, in) features of each GEMM on one GPU at tensor-parallel degree tp."""
    h, i, hd = model["hidden_size"], model["intermediate_size"], model["head_dim"]
    if i % tp:
        raise ServesimError(f"--tp {tp} does not divide the model's intermediate_size {i}")
    nh, nkv = per_gpu_heads(model, tp)
    vocab = -(-model["vocab_size"] // VOCAB_PADDING) * VOCAB_PADDING
    return {"qkv": ((nh + 2 * nkv) * hd, h), "o": (h, nh * hd), "gate_up": (2 * i // tp, h),
            "down": (h, i // tp), "lm_head": (-(-vocab // tp), h)}


def _axis(value: int, grid: np.ndarray, name: str, notes: list) -> tuple[int, float, list]:
    """How to reach `value` on an axis of the GEMM grid: (parts, value per part, [(grid value,
    log-space weight)])."""
    parts = 1
    if value > grid[-1]:
        parts = math.ceil(value / grid[-1])
        notes.append(f"GEMM {name} = {value} is past the table's largest ({int(grid[-1])}): "
                     f"priced as {parts} GEMMs of {name} = {value / parts:g}")
    per_part = value / parts
    if per_part < grid[0]:
        notes.append(f"GEMM {name} = {value} is below the table's smallest ({int(grid[0])}): clamped to it")
        per_part = float(grid[0])
    i = int(np.searchsorted(grid, per_part, side="right") - 1)
    if grid[i] == per_part:
        return parts, per_part, [(int(grid[i]), 1.0)]
    w = math.log(per_part / grid[i]) / math.log(grid[i + 1] / grid[i])
    return parts, per_part, [(int(grid[i]), 1.0 - w), (int(grid[i + 1]), w)]


SPIKE = 1.5  # a measured time more than this many times both its m-neighbours' is a spike (despiked)


def despiked(times: pd.Series) -> tuple[pd.Series, int]:
    """One grid shape's GEMM times along m without their isolated spikes, and how many there were.

    Within one kernel configuration a GEMM's time does not fall as rows are added (a smaller m
    runs the same tiles, padded), and vLLM's configuration steps (e.g. cutlass's m buckets) hold
    for a stretch of m, so both neighbours of a point share its step. A time more than SPIKE x
    both its neighbours' (the first m: x its one neighbour's) is a measurement's noise, not the
    kernel's: it is read as the larger neighbour. B200's fp8 table has such a first point (m = 1,
    the first measured for each shape) at 335 of its shapes; about 1.5% of every table's interior
    points are such spikes. A deployment confirms it: Llama-3.1-70B fp8 on 4 B200s decodes 4
    requests in 8.0 ms a step (InferenceMAX), where the table's spike at m = 4 would make it 12.3."""
    t = times.to_numpy()
    out = t.copy()
    if len(t) >= 2 and t[0] > SPIKE * t[1]:
        out[0] = t[1]
    if len(t) >= 3:
        left, middle, right = t[:-2], t[1:-1], t[2:]
        neighbours = np.maximum(left, right)
        spikes = middle > SPIKE * neighbours
        out[1:-1] = np.where(spikes, neighbours, middle)
    num = int(np.count_nonzero(out != t))
    if not num:
        return times, 0
    fixed = times.copy()
    fixed.iloc[:] = out
    return fixed, num


def gemm_curve(rows: pd.DataFrame, n: int, k: int, what: str, notes: list) -> tuple[np.ndarray, np.ndarray]:
    """(m grid, seconds) of an n x k GEMM from one dtype's rows, each grid shape's times despiked
    along m (`despiked`): bilinear in (log n, log k) of log time at every m the neighbouring grid
    shapes share."""
    ns, ks = np.sort(rows["n"].unique()), np.sort(rows["k"].unique())
    parts_n, _, wn = _axis(n, ns, f"{what} n", notes)
    parts_k, _, wk = _axis(k, ks, f"{what} k", notes)
    curves = []
    for gn, a in wn:
        for gk, b in wk:
            cell = rows[(rows["n"] == gn) & (rows["k"] == gk)]
            if cell.empty:
                raise ServesimError(f"the GEMM table has no rows for n = {gn}, k = {gk} (needed for {what})")
            times, num_spikes = despiked(cell.groupby("m")["seconds"].mean())
            if num_spikes:
                notes.append(f"{what}: {num_spikes} isolated spike(s) of the GEMM table at n = {gn}, k = {gk} "
                             f"(more than {SPIKE:g}x both m-neighbours) read as their neighbours")
            curves.append((a * b, times))
    ms = sorted(set.intersection(*(set(c.index) for _, c in curves)))
    log_t = sum(w * np.log(c.loc[ms].to_numpy()) for w, c in curves)
    if len(curves) == 1:  # on the grid: the measured times themselves
        seconds = curves[0][1].loc[ms].to_numpy()
    else:
        seconds = np.exp(log_t)
    return np.asarray(ms, dtype=np.int64), seconds * (parts_n * parts_k)


def kernels_by_preference(tables: TableSet, kind: str, rows: pd.DataFrame) -> list[str]:
    """The kernels of `rows` the framework may read (the layout's reuse manifest), the version's own
    before those only a reuse.yaml donor measured, then by their number of rows."""
    own = rows[~rows["reused"]] if "reused" in rows.columns else rows
    out = []
    for part in (own, rows):
        for k in part["kernel_source"].value_counts().index:
            if str(k) not in out and tables.kernel_allowed(kind, str(k)):
                out.append(str(k))
    return out


def gemm_kernel(tables: TableSet, dtype: str) -> tuple[str, pd.DataFrame]:
    """The kernel whose rows price `dtype`'s GEMMs, and its rows: the one vLLM picks on Hopper
    (`KERNELS`) where the tables have it, else the kernel the tables measured most for that dtype
    (one per dtype on most systems: e.g. A100's `vllm_default`, Blackwell's nvfp4 kernels)."""
    g = tables.gemm
    rows = g[g["gemm_dtype"] == GEMM_DTYPES[dtype]]
    allowed = kernels_by_preference(tables, "gemm", rows)
    if not allowed:
        have = ", ".join(sorted(str(x) for x in g["gemm_dtype"].unique()))
        raise ServesimError(f"{tables.files['gemm']}: no {GEMM_DTYPES[dtype]} GEMM rows for {tables.system} "
                            f"(GEMM dtypes there: {have})")
    kernel = KERNELS.get(("gemm", dtype))
    if kernel not in allowed:
        kernel = str(allowed[0])  # value_counts: the most rows first
    return kernel, rows[rows["kernel_source"] == kernel]


def derive_gemms(tables: TableSet, model: dict, tp: int, dtype: str, notes: list) -> dict:
    """Each GEMM's curve on the m grid its own rows have (shapes may be measured to different m)."""
    if dtype not in GEMM_DTYPES:
        raise ServesimError(f"unknown dtype {dtype!r}; choose {', '.join(GEMM_DTYPES)}")
    out = {}
    for op, (n, k) in gemm_shapes(model, tp).items():
        op_dtype = "bf16" if op == "lm_head" else dtype
        kernel, rows = gemm_kernel(tables, op_dtype)
        ms, seconds = gemm_curve(rows, n, k, op, notes)
        out[op] = {"n": n, "k": k, "dtype": op_dtype, "kernel": kernel, "m": ms.tolist(), "seconds": seconds.tolist()}
    return out


def attention_kernel(tables: TableSet, kind: str, kv_dtype: str, head_dim: int) -> str:
    """The attention kernel of `kind` (context, generation) the tables measured for this KV-cache
    dtype and head_dim: vLLM's FlashAttention 3 where there (Hopper), else the kernel with the most
    such rows (FlashAttention 2 on Ada, FlashInfer's TRT-LLM kernels on Blackwell, ...)."""
    frame = getattr(tables, f"{kind}_attention")
    rows = frame[(frame["window_size"] == 0) & (frame["kv_cache_dtype"] == KV_DTYPES[kv_dtype])
                 & (frame["head_dim"] == head_dim)]
    allowed = kernels_by_preference(tables, f"{kind}_attention", rows)
    if not allowed:
        have = sorted({(str(a), str(b), int(c)) for a, b, c in
                       frame[["kernel_source", "kv_cache_dtype", "head_dim"]].drop_duplicates().values})
        raise ServesimError(f"{tables.files[kind + '_attention']}: no {kind} attention rows for KV cache {kv_dtype}, "
                            f"head_dim {head_dim} on {tables.system} ({tables.framework} {tables.version}); "
                            f"(kernel, KV dtype, head_dim) there: {have}")
    preferred = KERNELS[("attention", None)]
    return preferred if preferred in allowed else allowed[0]


def _attention_rows(frame: pd.DataFrame, heads: int, kv_heads: int, head_dim: int, kv_dtype: str,
                    kernel: str) -> pd.DataFrame:
    return frame[(frame["kernel_source"] == kernel) & (frame["window_size"] == 0)
                 & (frame["kv_cache_dtype"] == KV_DTYPES[kv_dtype]) & (frame["head_dim"] == head_dim)
                 & (frame["num_heads"] == heads) & (frame["num_key_value_heads"] == kv_heads)]


def _attention_grid(frame: pd.DataFrame, length: str, offset: int) -> tuple[list, list, np.ndarray]:
    piv = frame.groupby(["batch_size", length])["seconds"].mean().unstack(length).sort_index()
    piv = piv.reindex(sorted(piv.columns), axis=1)
    return piv.index.tolist(), [int(c) + offset for c in piv.columns], piv.to_numpy()


def derive_attention(tables: TableSet, model: dict, tp: int, kv_dtype: str, notes: list) -> dict:
    """Context and generation attention grids for the model's per-GPU head configuration."""
    if kv_dtype not in KV_DTYPES:
        raise ServesimError(f"unknown KV-cache dtype {kv_dtype!r}; choose bf16 or fp8")
    heads, kv_heads = per_gpu_heads(model, tp)
    hd = model["head_dim"]
    out = {}
    for kind, length, offset in (("context", "isl", 0), ("generation", "step", 1)):
        frame = getattr(tables, f"{kind}_attention")
        kernel = attention_kernel(tables, kind, kv_dtype, hd)
        rows = _attention_rows(frame, heads, kv_heads, hd, kv_dtype, kernel)
        if not rows.empty:
            batch, lengths, grid = _attention_grid(rows, length, offset)
        else:
            batch, lengths, grid = _between_head_counts(frame, heads, kv_heads, hd, kv_dtype, length, offset, kind, notes,
                                                        tables, kernel)
        full, filled = fill_rows_by_scaling(np.asarray(batch, dtype=np.float64), grid)
        out[kind] = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": hd, "kv_cache_dtype": kv_dtype,
                     "kernel": kernel, "batch": batch,
                     "isl" if kind == "context" else "kv_len": lengths,
                     "seconds": full.tolist(), "measured": (~filled).tolist()}
    return out


def _between_head_counts(frame, heads, kv_heads, hd, kv_dtype, length, offset, kind, notes, tables, kernel):
    """A grid for a head count the tables lack: linear in heads between the nearest present ones
    (same kernel, KV heads, head_dim, KV dtype), on the cells both have."""
    k = frame[(frame["kernel_source"] == kernel) & (frame["window_size"] == 0)
              & (frame["kv_cache_dtype"] == KV_DTYPES[kv_dtype]) & (frame["head_dim"] == hd)
              & (frame["num_key_value_heads"] == kv_heads)]
    present = sorted(k["num_heads"].unique())
    below = [h for h in present if h < heads]
    above = [h for h in present if h > heads]
    if not below or not above:
        same = frame[(frame["kernel_source"] == kernel) & (frame["head_dim"] == hd)
                     & (frame["kv_cache_dtype"] == KV_DTYPES[kv_dtype])]
        have = sorted({(int(a), int(b)) for a, b in same[["num_heads", "num_key_value_heads"]].values})
        raise ServesimError(f"{tables.files[kind + '_attention']}: no {kind} attention rows of kernel {kernel} for "
                            f"{heads} heads, {kv_heads} KV heads, head_dim {hd}, KV cache {kv_dtype} on "
                            f"{tables.system} ({tables.framework} {tables.version}), nor head counts on both sides "
                            f"to interpolate; (heads, KV heads) there: {have}")
    lo, hi = below[-1], above[0]
    b0, l0, g0 = _attention_grid(k[k["num_heads"] == lo], length, offset)
    b1, l1, g1 = _attention_grid(k[k["num_heads"] == hi], length, offset)
    batch = [b for b in b0 if b in b1]
    lengths = [x for x in l0 if x in l1]
    import pandas as pd  # here, not at import: a replay loading a profile never needs it

    g0 = pd.DataFrame(g0, index=b0, columns=l0).loc[batch, lengths].to_numpy()
    g1 = pd.DataFrame(g1, index=b1, columns=l1).loc[batch, lengths].to_numpy()
    w = (heads - lo) / (hi - lo)
    notes.append(f"{kind} attention: no rows for {heads} heads; linear between {lo} and {hi} heads")
    return batch, lengths, (1 - w) * g0 + w * g1


def _curve(rows: pd.DataFrame) -> tuple[list[int], list[float]]:
    """(message bytes, seconds) of all-reduce rows of bf16 elements: the tables' `message_size`
    counts elements (AIConfigurator's collector/collect_all_reduce.py all-reduces a bf16 tensor of
    `message_size` elements; collect_nccl.py stores bytes // bytes per element), 2 bytes each."""
    curve = rows.groupby("message_size")["seconds"].mean().sort_index()
    return [int(x) * ALLREDUCE_ELEMENT_BYTES for x in curve.index], curve.tolist()


def ring_scaled(seconds, measured_gpus: int, num_gpus: int) -> list[float]:
    """A measured ring collective's times among `measured_gpus` GPUs carried to a ring of `num_gpus`
    (more, past the table: across nodes, or a count it does not measure) as a lower bound: a ring
    moves (n - 1) / n of the message through each GPU's links (2 (n - 1) / n for an all-reduce), and
    the larger ring crosses every hop of the smaller, so each message takes at least the measured
    time times ((num_gpus - 1) / num_gpus) / ((measured_gpus - 1) / measured_gpus). (Found by a review
    with odd layouts: L40S at TP 16, past its 8-GPU node, was priced as a ring at the PCIe link's
    32 GB/s, 19 times faster a step than the NCCL table's own 8-GPU rows at 1-2 GB/s.)"""
    factor = ((num_gpus - 1) / num_gpus) / ((measured_gpus - 1) / measured_gpus)
    return [float(t) * factor for t in seconds]


def measured_ring_below(frame: pd.DataFrame | None, op: str, num_gpus: int) -> tuple[list[int], list[float], int] | None:
    """(message bytes, seconds, GPUs) of NCCL's `op` (half precision) among the most GPUs, two or more,
    that the table measures below `num_gpus`; None where it measures none: what a ring of `num_gpus`
    the table lacks is bounded by (`ring_scaled`)."""
    if frame is None:
        return None
    rows = frame[(frame["op_name"] == op) & (frame["num_gpus"] < num_gpus) & (frame["num_gpus"] >= 2)
                 & (frame["nccl_dtype"] == "half")]
    if rows.empty:
        return None
    most = int(rows["num_gpus"].max())
    message_bytes, seconds = _curve(rows[rows["num_gpus"] == most])
    return message_bytes, seconds, most


def derive_allreduce(tables: TableSet, tp: int, nvlink_bytes_per_s: float | None,
                     pcie_bytes_per_s: float | None = None, notes: list | None = None,
                     fusion_max_bytes: float = 0.0, gpus_per_node: int | None = None,
                     inter_node_bytes_per_s: float | None = None) -> dict | None:
    """How an all-reduce among tp GPUs is priced (nothing at TP 1: the table is not read there).

    vLLM's custom all-reduce takes messages below 8 MiB where every GPU reaches every other over
    NVLink, or on two GPUs over PCIe (custom_all_reduce.py: "not supported on more than two PCIe-only
    GPUs"); the tables' CUDA-graph and eager rows price it. Larger messages, and every message where
    the custom kernel is not used, go to NCCL: the system's NCCL table (`nccl_perf`, all_reduce, half)
    where there is one for tp GPUs, else a ring over the hardware's stated link (NVLink or PCIe:
    2 (tp - 1) / tp of the message through each GPU's link, plus tensor_parallel's fixed latency).

    `fusion_max_bytes` > 0: the deployment turns on vLLM's FlashInfer all-reduce fusion
    (`compilation_config.pass_config.enable_fi_allreduce_fusion`; vllm/compilation/passes/fusion/
    allreduce_rms_fusion.py, AllReduceFusedAddRMSNormPattern), which replaces each all-reduce of the
    hidden states up to that size (FI_ALLREDUCE_FUSION_MAX_SIZE_MB, or the deployment's
    VLLM_FLASHINFER_ALLREDUCE_FUSION_THRESHOLDS_MB) and the RMSNorm after it with
    `flashinfer.comm.allreduce_fusion`, whose all-reduce is TensorRT-LLM's kernel (FlashInfer's
    trtllm_allreduce_fusion). Those messages are priced from the system's TensorRT-LLM all-reduce
    table (`fused`), the measured kernel closest to what runs; the package's reuse manifest
    reserves those rows for TensorRT-LLM, and this is the one place they are read for vLLM.

    More GPUs than a node holds (`gpus_per_node`): vLLM's custom all-reduce is off for a group that
    spans nodes (vllm/distributed/device_communicators/custom_all_reduce.py, CustomAllreduce.__init__:
    "Custom allreduce is disabled because this process group spans across nodes"), and FlashInfer's
    fused all-reduce is not priced there either (its workspace is CUDA IPC memory, which one node's
    GPUs share: flashinfer.comm.trtllm_create_ipc_workspace_for_all_reduce_fusion); every message
    goes to NCCL, its table where there is one for tp GPUs, else a ring whose bottleneck is the
    network between nodes (`inter_node_bytes_per_s`) where that is slower than the link. A ring
    priced where the NCCL table has no rows for tp GPUs takes at least the time of NCCL's smallest
    all-reduce among the most GPUs it measures (a ring of more GPUs has more hops to cross)."""
    notes = [] if notes is None else notes
    if tp == 1:
        return None
    if nvlink_bytes_per_s is not None and nvlink_bytes_per_s > 0:
        link, bandwidth = "nvlink", float(nvlink_bytes_per_s)
    elif pcie_bytes_per_s is not None and pcie_bytes_per_s > 0:
        link, bandwidth = "pcie", float(pcie_bytes_per_s)
    else:
        raise ServesimError(f"--tp {tp} needs the hardware's link (nvlink_bandwidth or pcie_bandwidth) to price "
                            "its all-reduces; give a --hardware that states one")
    spans_nodes = gpus_per_node is not None and tp > gpus_per_node
    hops = link  # the link inside a node decides a ring's hops (`allreduce_latency_s`), across nodes too
    link, bandwidth = node_link(link, bandwidth, tp, gpus_per_node, inter_node_bytes_per_s,
                                f"the hardware of {tables.system}")
    out: dict = {"num_gpus": tp, "link": link, "link_bytes_per_s": bandwidth, "table_max_bytes": 0}
    if link == "nvlink":
        out["nvlink_bytes_per_s"] = bandwidth
    if spans_nodes:
        out["gpus_per_node"] = gpus_per_node
    custom_used = runs_custom_allreduce(hops, tp, spans_nodes)
    a = tables.custom_allreduce
    rows = a[a["num_gpus"] == tp] if a is not None and custom_used else None
    if rows is not None and not rows.empty:
        curves = {}
        for mode in ("graph", "eager"):
            kernel = KERNELS[("allreduce", mode)]
            mine = rows[rows["kernel_source"] == kernel]
            if not mine.empty:
                message_bytes, seconds = _curve(mine)
                curves[mode] = {"kernel": kernel, "message_bytes": message_bytes, "seconds": seconds}
        if not curves:
            kinds = ", ".join(sorted(str(k) for k in rows["kernel_source"].unique()))
            raise ServesimError(f"{tables.files['custom_allreduce']}: no {KERNELS[('allreduce', 'graph')]} or "
                                f"{KERNELS[('allreduce', 'eager')]} rows for {tp} GPUs on {tables.system} "
                                f"({tables.framework} {tables.version}; kernels there: {kinds})")
        # A system measured in one mode only (Intel's B60 has no CUDA graphs: its tables hold the eager
        # kernel alone) prices the other mode's messages with the kernel it measures, and says so.
        for mode, other in (("graph", "eager"), ("eager", "graph")):
            if mode not in curves:
                curves[mode] = dict(curves[other])
                notes.append(f"all-reduce: no {KERNELS[('allreduce', mode)]} rows for {tp} GPUs on {tables.system}; "
                             f"its messages priced with {curves[other]['kernel']}")
        out.update(curves, table_max_bytes=TABLE_ALLREDUCE_MAX_BYTES)
    elif custom_used:
        where = "no custom all-reduce table" if a is None else f"no custom all-reduce rows for {tp} GPUs"
        notes.append(f"all-reduce: {where} on {tables.system}; every message priced as NCCL's")
    elif spans_nodes:
        notes.append(f"all-reduce: {tp} GPUs span nodes of {gpus_per_node}: vLLM's custom kernel is off; every "
                     "message priced as NCCL's")
    else:
        notes.append(f"all-reduce: vLLM's custom kernel is off on {tp} PCIe GPUs; every message priced as NCCL's")
    if fusion_max_bytes > 0 and custom_used:
        f = tables.fused_allreduce
        fused = None if f is None else f[(f["num_gpus"] == tp) & (f["op_name"] == "all_reduce")]
        if fused is not None and not fused.empty:
            message_bytes, seconds = _curve(fused)
            version = f["version"].iloc[0] if "version" in f.columns else "?"
            out["fused"] = {"kernel": f"FlashInfer all-reduce fusion (TensorRT-LLM's all-reduce, trtllm {version})",
                            "message_bytes": message_bytes, "seconds": seconds, "max_bytes": float(fusion_max_bytes)}
        else:
            notes.append(f"all-reduce: no TensorRT-LLM all-reduce table for {tp} GPUs on {tables.system}; the "
                         "FlashInfer-fused all-reduces priced as vLLM's custom kernel")
    n = tables.nccl
    nccl = None if n is None else n[(n["op_name"] == "all_reduce") & (n["num_gpus"] == tp)
                                    & (n["nccl_dtype"] == "half")]
    if nccl is not None and not nccl.empty:
        message_bytes, seconds = _curve(nccl)
        out["nccl"] = {"kernel": "NCCL all_reduce (half)", "message_bytes": message_bytes, "seconds": seconds}
    else:
        # The ring's fixed time: at least NCCL's smallest all-reduce among the most GPUs the table
        # measures (fewer than tp: a ring of more GPUs has more hops), else the custom kernel's.
        below = measured_ring_below(n, "all_reduce", tp)
        floor, floor_from = allreduce_latency_s(hops, tp), ""  # where no table measures it
        if below is not None:
            message_bytes, seconds, most = below
            measured = min(seconds)
            if measured > floor:
                floor, floor_from = measured, f", at least NCCL's smallest all-reduce among {most} GPUs"
            # Nor is any message faster than that measured ring of fewer GPUs, whose every hop the larger
            # ring crosses too (`ring_scaled`).
            out["nccl_floor"] = {"kernel": f"NCCL all_reduce (half) among {most} GPUs, x the ring's bytes for {tp}",
                                 "message_bytes": message_bytes, "seconds": ring_scaled(seconds, most, tp)}
            floor_from += f"; never faster than NCCL's all-reduce among {most} GPUs (its bytes scaled to {tp})"
        out["ring_latency_s"] = floor
        notes.append(f"all-reduce: no NCCL table for {tp} GPUs on {tables.system}; NCCL's messages priced as a "
                     f"ring over {link} at {bandwidth / 1e9:g} GB/s plus {floor * 1e6:.1f} us{floor_from}")
    return out


def derive_memory(tables: TableSet) -> dict:
    g = tables.gemm
    rows = g[(g["gemm_dtype"] == "bfloat16") & (g["m"] == 1)]
    if rows.empty:
        raise ServesimError(f"{tables.files['gemm']}: no bf16 GEMM at m = 1 to measure the memory bandwidth from")
    weight_bytes = rows["n"] * rows["k"] * 2
    big = rows[weight_bytes >= weight_bytes.max() / 4]
    bandwidth = float(np.median(big["n"] * big["k"] * 2 / big["seconds"]))
    return {"bandwidth_bytes_per_s": bandwidth, "kernel_floor_s": float(g["seconds"].min()),
            "how": "bandwidth: median weight bytes / time of the bf16 GEMMs at m = 1 with at least a quarter "
                   "of the largest one's weights; kernel floor: the shortest GEMM in the table"}


def derive(tables: TableSet, model: dict, tp: int = 1, dtype: str = "bf16", kv_cache_dtype: str = "bf16",
           nvlink_bytes_per_s: float | None = None, pcie_bytes_per_s: float | None = None,
           allreduce_fusion_max_bytes: float = 0.0, gpus_per_node: int | None = None,
           inter_node_bytes_per_s: float | None = None) -> dict:
    """Everything the operator model needs for one model, TP degree and dtype (see the module doc)."""
    notes: list[str] = []
    return {"gemm": derive_gemms(tables, model, tp, dtype, notes),
            "attention": derive_attention(tables, model, tp, kv_cache_dtype, notes),
            "allreduce": derive_allreduce(tables, tp, nvlink_bytes_per_s, pcie_bytes_per_s, notes,
                                          allreduce_fusion_max_bytes, gpus_per_node, inter_node_bytes_per_s),
            "memory": derive_memory(tables), "notes": notes}
