"""A mixture-of-experts model's step priced from the tables package's measured tables, operator by operator.

`MoETableCostModel` is the MoE roofline (backends/costmodel/roofline.py, `MoERooflineCostModel`) with
each operator a measured table prices replaced by the table's time; an operator no table prices
stays the roofline's, and `sources` says which, per operator (summary.json's `cost_model`):

- moe: the fused-MoE kernel from `moe_perf` (vLLM's tables) at the model's exact shape (hidden,
  moe_intermediate_size, top-k, experts), MoE TP and EP, expert dtype and token distribution
  (`--moe-distribution`: by default, `auto`, the family's skewed routing, `family_distribution`;
  or balanced, or power-law:ALPHA for the skewed ones measured),
  log-log in tokens between grid points, exact on them. The kernel, where servesim knows the one
  vLLM's layer serves the experts' dtype with on the GPU (`dispatched_moe_kernel`: Marlin for int4,
  FlashInfer's TRT-LLM MXFP4 kernel on B200 and B300, OpenAI's Triton MXFP4 kernels on H100 and
  H200), is that one, from a table that names it: the tables of vLLM before 0.24 time vLLM's
  standalone helpers instead (`HELPER_KERNELS`). Else the one vLLM 0.33 picks on Hopper
  (vllm/model_executor/layers/fused_moe/oracle/fp8.py, `_get_priority_backends`: block fp8 runs
  Triton under TP and FlashInfer CUTLASS under EP), else the one the tables measured most. A kernel
  the server was told to run (`--moe-kernel`, a launch script's VLLM_MXFP4_USE_MARLIN=1 or
  VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1) is that kernel's rows, carried from another model's shape
  where none measure this one (`transferred_moe_curve`), and refused where the tables measure it
  nowhere.
  The version: the row's own, else the nearest that measures the shape (`pick_moe_curve`: a version
  whose table lacks it yields to the next nearest, as AIConfigurator's sibling versions fill a
  shape). A shape or MoE TP/EP layout no version holds in the dtype is carried from the nearest
  measured one by the two layers' rooflines (`transferred_moe_curve(any_layout=True)`); only an
  expert dtype the system's tables never measure is the roofline's.
  Tokens: the MoE layer of a DP > 1 deployment sees every DP rank's tokens (the dispatch gathers
  them): a DP group's lockstep step prices it once from every rank's tokens (`dp_moe_parts`,
  backends/costmodel/roofline.py; sim/data_parallel.py), and a step priced alone (`execute`)
  takes every rank as loaded as this one.
- linear: attention's QKV and O projections, the dense MLPs and the shared experts from the GEMM
  table (`gemm_curve`, the operator-table model's own) in the checkpoint's dtype. An MLA model's
  linear stays the roofline's; where its MLA module tables price attention (below), its
  projections are in them and linear is the roofline's dense MLPs and shared experts alone.
  Block-fp8 weights (Qwen3-235B-A22B-FP8, Qwen3-30B-A3B-FP8, MiniMax-M2) are priced from the per-tensor
  fp8 rows at the same shape, not the block-fp8 rows: AIConfigurator's collector times every GEMM
  inside a CUDA graph except block fp8 (ai-dynamo/aiconfigurator, collector/vllm/collect_gemm.py,
  `run_gemm`: `use_cuda_graph=gemm_type != "fp8_block"`), so those rows carry the host's launch time:
  at small m they sit on floors of 55 us (FlashInfer), 78-85 us (DeepGEMM) and 150-180 us (CUTLASS
  block) that are the same on H100 and H200 (a GPU-bound time would differ by their bandwidths,
  1.37x), where the per-tensor fp8 and bf16 kernels take 6-12 us at the same shapes. vLLM runs its
  decode steps as CUDA graphs and does not pay them. Where the GPU is the bound (large m and n x k),
  the block-fp8 rows are 1.04-1.18x the per-tensor ones at the same shape (H200).
- attention: full-attention GQA layers from the context and generation attention tables (as the
  dense operator model prices them); sliding-window layers from the rows measured at the layer's
  window (`window_size`), at the window's KV length; MLA layers from the MLA module tables
  (backends/costmodel/optables/mla.py: the whole layer, its projections, norms, RoPE and KV-cache
  write included, so that linear, kv_write and elementwise leave them out: nothing counted twice),
  else the roofline's.
- allreduce: two per layer under TP, vLLM's custom all-reduce table up to 8 MiB, NCCL's table past it;
  with the small kernels priced (below), the vocab-parallel embedding's and the logits' all-gather (as an
  all-reduce of half its bytes) too, as the dense operator model counts them.
- router, lm_head, kv_write, elementwise, overhead (`_derive_small_kernels`): as the dense operator model
  prices them (backends/costmodel/optables/model.py). The router's [hidden, experts] GEMM and the LM head
  from the bf16 GEMM rows; every elementwise kernel (the add+RMSNorms, RoPE, Qwen3's q/k norms, the
  KV-cache write, fp8's activation quantization, SiLU-and-mul of the dense MLPs and shared experts, the
  router's top-k where the moe_perf rows took the routing precomputed, the embedding, the final norm and
  the sampler's three passes over the fp32 logits) the GEMM table's kernel floor plus the roofline's bytes
  at the table's achieved HBM bandwidth (`derive_memory`), less the routed experts' SiLU-and-mul where
  moe_perf prices the layer (its kernel runs it); and no fixed per-step overhead: the engine
  core's CPU time is the host-time model's (backends/host_time.py). A system whose GEMM table has no bf16
  rows at m = 1 keeps the roofline's for these and its 1 ms a step.
- dispatch and combine (DP > 1): vLLM's default all2all backend, `allgather_reducescatter`
  (vllm/config/parallel.py, `all2all_backend`; vllm/distributed/device_communicators/all2all.py,
  `AgRsAll2AllManager`): `dispatch` all-gathers each member's hidden states (bf16), top-k
  weights (fp32) and top-k ids (int32) over the MoE group (the DP group, or the tp x dp EP group
  under sequence-parallel MoE); `combine` reduce-scatters the MoE output (bf16, every rank's
  tokens) back (`MoERooflineCostModel.dp_moe_parts` says how). Both from the NCCL table
  (`all_gather`, `reduce_scatter` among the group's GPUs, message_size in 2-byte elements as
  collect_nccl.py stores them), the roofline's ring where the table has no rows.

Interpolation: exact on grid points, log-log between them; tokens past a curve's last point are
scaled linearly (counted in `extrapolated`, per operator, and said in summary.json) and sizes
below the first are clamped to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from backends.costmodel.frame import StepAggregates
from backends.costmodel.optables.derive import measured_ring_below, ring_scaled
from backends.costmodel.optables.interp import Curve, Grid, fill_rows_by_scaling
from backends.costmodel.optables.mla import MLAModule, MLATables, mla_module
from backends.costmodel.optables.model import CUDA_GRAPH_SIZES, graph_sizes_array, padded_tokens
from backends.costmodel.roofline import MoERooflineCostModel, chunk_pieces, fp4_native
from backends.costmodel.tensor_parallel import ring_allreduce_over, runs_custom_allreduce
from backends.sampler import PricesSampler, sampler_seconds
from sim.backend import StepResult
from sim.batch import Batch
from sim.errors import ServesimError

# servesim's expert dtypes (ModelConfig.linear_dtypes) -> moe_perf's moe_dtype
MOE_DTYPES = {"bf16": "bfloat16", "fp8": "fp8", "fp8-block": "fp8_block", "mxfp4": "w4a16_mxfp4", "int4": "int4_wo",
              "nvfp4": "nvfp4"}
# servesim's weight dtypes -> gemm_perf's gemm_dtype
LINEAR_DTYPES = {"bf16": "bfloat16", "fp8": "fp8", "fp8-block": "fp8_block", "nvfp4": "nvfp4"}
DISTRIBUTION = re.compile(r"^power-law:(?P<alpha>\d+(\.\d+)?)$")
ACTIVATION_BYTES = 2  # bf16 hidden states
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 2**20  # vLLM's custom all-reduce takes messages up to 8 MiB (derive.py)
RUN_CHUNK = 256  # decode steps per cached stretch of a batch size's step times (see MoETableCostModel.decode_run)
MAX_RUN_CHUNKS = 4096  # cached stretches at most (16 MiB); the cache starts afresh past it
MAX_FIRST_CHUNKS = 1 << 16  # first prefill chunks' attention kept by length (see _first_chunk_seconds)
# the collectives' curves (None: not from a table), and the bounds of rings no table measures (`nccl_floor`)
COLLECTIVES = ("_ar_custom", "_ar_custom_eager", "_ar_nccl", "_gather", "_scatter", "_ar_floor", "_gather_floor",
               "_scatter_floor")
NO_STEP = StepAggregates(0, 0, 0, 0, 0, 0, 0, 0, 0)  # for the parts that do not depend on the step's requests


def check_moe_distribution(flag: str, value: str) -> None:
    m = DISTRIBUTION.match(value)
    if value not in ("auto", "balanced") and (m is None or not float(m.group("alpha")) > 0):
        raise ServesimError(f"{flag} {value!r}: give auto, balanced or power-law:ALPHA with ALPHA above 0 "
                            "(the moe_perf tables measure power-law:1.01 and power-law:1.2)")


def family_distribution(model) -> str:
    """`--moe-distribution auto`: how a MoE family's router spreads a step's tokens over its experts.
    A trained router is skewed (some experts take many more tokens than others), so a step's
    fused-MoE kernel waits on its busiest experts when many tokens run (slower than balanced) and
    reads fewer experts' weights when few do (a decode step: faster than balanced). The moe_perf
    tables measure that skew as a power law of exponent ALPHA; AIConfigurator, whose tables these
    are, prices every MoE model with one (its `workload_distribution` default, "power_law"): alpha
    1.01 for the DeepSeek family (aiconfigurator_core/sdk/models/deepseek.py, `_power_law_alpha`;
    servesim's MLA models: DeepSeek-V3/R1, Kimi K2) and Llama 4 (sdk/models/hybrid_moe.py, the
    model its common.py names Llama4ForConditionalGeneration's) and 1.2 for the others
    (sdk/models/moe.py: Qwen3-MoE, Mixtral, gpt-oss, MiniMax)."""
    return "power-law:1.01" if model.kv_lora_rank or model.model_type == "llama4_text" else "power-law:1.2"


def table_distribution(value: str) -> str:
    """--moe-distribution's value (not auto) as moe_perf names it: balanced, power_law_1.2."""
    check_moe_distribution("--moe-distribution", value)
    m = DISTRIBUTION.match(value)
    return "balanced" if m is None else f"power_law_{m.group('alpha')}"


@dataclass(frozen=True)
class MoEShape:
    """What one moe_perf lookup is keyed by (the table's own columns)."""

    hidden_size: int
    inter_size: int
    topk: int
    num_experts: int
    moe_tp_size: int
    moe_ep_size: int
    moe_dtype: str
    distribution: str


def moe_kernel(kernels: list[str], moe_dtype: str, ep: int) -> str:
    """The fused-MoE kernel vLLM runs on Hopper, among those measured (see the module doc)."""
    if moe_dtype == "fp8_block":
        want = "flashinfer_cutlass" if ep > 1 else "triton"
        for k in kernels:
            if want in k:
                return k
    return kernels[0]


# The kernel_source labels of the tables that time one of vLLM's standalone helpers (AIConfigurator's
# collector before vLLM 0.24, ai-dynamo/aiconfigurator collector/vllm/collect_moe.py, `run_moe_torch`:
# `fused_experts` called with each quant config, or a bare FusedMoE module), not the kernel a served
# layer dispatched. vllm_marlin_int4_moe, for one, is `fused_experts` with `int4_w4a16_moe_quant_config`:
# the Triton or CUDA WNA16 kernel, not Marlin. The 0.24 tables name the layer's method, backend and
# experts class instead (vllm_compressedtensorswna16marlinmoe_marlin_marlinexperts); the package's own
# notes call the 0.19 and 0.22 MoE folders bridging tables flagged for retirement
# (systems/data/*/moe/vllm/0.24.0/collection_meta.yaml).
HELPER_KERNELS = frozenset({"vllm_fused_moe", "vllm_mxfp4_moe", "vllm_marlin_int4_moe",
                            "vllm_flashinfer_trtllm_moe_fp4"})


def dispatched_moe_kernel(moe_dtype: str, sm_version: int | None, online: bool = False) -> tuple[str, str] | None:
    """(what its kernel_source contains, its name) of the fused-MoE kernel vLLM's layer runs by
    default for experts of `moe_dtype` on a GPU of compute capability `sm_version`, where servesim
    knows it; None where it does not (the lanes are then `moe_kernel`'s choice). `online`: the
    experts are quantized by the server (`--dtype fp8`: vLLM's --quantization fp8), not the checkpoint.

    - per-tensor fp8 quantized online: vLLM's online Fp8MoEMethod asks for fp8 weights with dynamic
      per-tensor activation scales (vllm/model_executor/layers/quantization/online/fp8.py), and
      `select_fp8_moe_backend` (vllm/model_executor/layers/fused_moe/oracle/fp8.py) takes the first
      backend in its order that supports them: FlashInfer's CUTLASS and TRT-LLM kernels take static
      activation scales only (a ModelOpt checkpoint's), DeepGEMM block scales only, vLLM's CUTLASS is
      not allowed there, so Triton (its `fused_experts`); Marlin (weight-only) on a GPU without fp8
      tensor cores (before SM 89).

    - int4 (compressed-tensors WNA16, Kimi K2's experts): Marlin
      (vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe.py,
      `CompressedTensorsWNA16MarlinMoEMethod`).
    - MXFP4 (gpt-oss): `get_mxfp4_backend` (vllm/model_executor/layers/quantization/mxfp4.py) with its
      default environment and FlashInfer installed: FlashInfer's TRT-LLM MXFP4 x BF16 kernel on the
      SM 100 family (B200, B300), OpenAI's Triton kernels on SM 90 (H100, H200), Marlin elsewhere."""
    if moe_dtype == "int4_wo":
        return "marlin", "Marlin (CompressedTensorsWNA16MarlinMoEMethod)"
    if moe_dtype == "fp8" and online and sm_version is not None:
        if sm_version < 89:
            return "marlin", "Marlin (Fp8MoeBackend.MARLIN: fp8 weights only, no fp8 tensor cores)"
        return "triton", "Triton (Fp8MoeBackend.TRITON: --dtype fp8's dynamic activation scales)"
    if moe_dtype == "w4a16_mxfp4" and sm_version is not None:
        if sm_version // 10 == 10:
            return "flashinfer_trtllm_mxfp4_bf16", "FlashInfer TRT-LLM MXFP4 x BF16 (Mxfp4Backend.SM100_FI_MXFP4_BF16)"
        if sm_version == 90:
            return "oaitriton", "OpenAI's Triton MXFP4 kernels (Mxfp4Backend.TRITON)"
        return "marlin", "Marlin (Mxfp4Backend.MARLIN)"
    return None


def names_kernel(kernel_source: str, part: str) -> bool:
    """Whether a lane's kernel_source names the served kernel `part` (`dispatched_moe_kernel`). Of the
    helpers, `vllm_fused_moe` (`fused_experts` with an unquantized, fp8 or block-fp8 config) is the
    Triton kernel (vllm/model_executor/layers/fused_moe/fused_moe.py)."""
    if kernel_source == "vllm_fused_moe":
        return part == "triton"
    return kernel_source not in HELPER_KERNELS and part in kernel_source


def moe_curve(frame, shape: MoEShape, lane: str | None = None) -> tuple[str, np.ndarray, np.ndarray] | str:
    """(kernel, tokens, seconds) of the fused MoE layer at `shape`; a reason string where the
    table does not hold that shape (the caller falls back to the roofline and says why). `lane`:
    only the kernels whose kernel_source names it (`names_kernel`)."""
    f = frame
    rows = f[(f["hidden_size"] == shape.hidden_size) & (f["inter_size"] == shape.inter_size)
             & (f["topk"] == shape.topk) & (f["num_experts"] == shape.num_experts)]
    if rows.empty:
        return (f"no moe_perf rows for hidden {shape.hidden_size}, inter {shape.inter_size}, top-{shape.topk} of "
                f"{shape.num_experts} experts")
    rows = rows[rows["moe_dtype"] == shape.moe_dtype]
    if rows.empty:
        return f"no moe_perf rows in {shape.moe_dtype} for this model's shape"
    rows = rows[(rows["moe_tp_size"] == shape.moe_tp_size) & (rows["moe_ep_size"] == shape.moe_ep_size)]
    if rows.empty:
        return f"no moe_perf rows at MoE TP {shape.moe_tp_size}, EP {shape.moe_ep_size}"
    rows = rows[rows["distribution"] == shape.distribution]
    if rows.empty:
        return f"no moe_perf rows with the {shape.distribution} token distribution"
    if lane is not None:
        rows = rows[[names_kernel(str(k), lane) for k in rows["kernel_source"]]]
        if rows.empty:
            return f"no moe_perf rows of the {lane} kernel at this shape"
    counts = rows["kernel_source"].value_counts()
    kernel = moe_kernel([str(k) for k in counts.index], shape.moe_dtype, shape.moe_ep_size)
    curve = rows[rows["kernel_source"] == kernel].groupby("num_tokens")["seconds"].mean().sort_index()
    return kernel, curve.index.to_numpy(dtype=np.float64), curve.to_numpy(dtype=np.float64)


# --moe-kernel: the fused-MoE kernel a server was told to run (an environment variable or flag of
# its launch script) instead of vLLM's default; (what its kernel_source contains, its name)
NAMED_KERNELS = {
    "marlin": ("marlin", "Marlin (--moe-kernel marlin: vLLM's VLLM_MXFP4_USE_MARLIN=1 for MXFP4 experts)"),
    "triton": ("triton", "Triton (--moe-kernel triton)"),
    "flashinfer": ("flashinfer", "FlashInfer (--moe-kernel flashinfer)"),
    "flashinfer-mxfp8": ("mxfp4_mxfp8", "FlashInfer's TRT-LLM MXFP4 x MXFP8 kernel (--moe-kernel flashinfer-mxfp8: "
                                        "vLLM's VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1)"),
}
MOE_KERNELS = ("auto", *NAMED_KERNELS)
# A named kernel that quantizes the activations too runs the experts' weights as another moe_dtype of
# the tables: MXFP4 weights with MXFP8 activations (vLLM's Mxfp4Backend.SM100_FI_MXFP4_MXFP8_TRTLLM).
KERNEL_DTYPES = {("flashinfer-mxfp8", "w4a16_mxfp4"): "w4a8_mxfp4_mxfp8"}
TABLE_TO_DTYPE = {**{v: k for k, v in MOE_DTYPES.items()}, "w4a8_mxfp4_mxfp8": "mxfp4"}  # the weights' dtype
FP8_COMPUTE = ("fp8", "fp8_block", "w4a8_mxfp4_mxfp8")  # moe_dtypes whose GEMMs run on the fp8 tensor cores


def moe_layer_roofline(hardware, shape: MoEShape, tokens) -> np.ndarray:
    """The datasheet roofline of one fused-MoE layer of `shape` on one GPU (as
    `MoERooflineCostModel.moe_seconds` prices a layer): tokens x top-k / EP assignments through the
    local experts' gate-up and down (inter / MoE TP wide), the weights of the experts that receive a
    token read once, computed at the bf16 peak (W4A16 and bf16 experts) or the fp8 peak (fp8, block
    fp8, and MXFP4 weights with MXFP8 activations)."""
    from backends.model_config import linear_bytes

    dtype = TABLE_TO_DTYPE.get(shape.moe_dtype, "bf16")
    h, i = shape.hidden_size, shape.inter_size // shape.moe_tp_size
    assignments = np.asarray(tokens, dtype=np.float64) * shape.topk / shape.moe_ep_size
    active = np.minimum(-(-shape.num_experts // shape.moe_ep_size), assignments)
    peak = hardware.peak_flops("fp8" if shape.moe_dtype in FP8_COMPUTE else "bf16")
    flops = 6.0 * assignments * h * i
    num_bytes = active * (linear_bytes(h, 2 * i, dtype) + linear_bytes(i, h, dtype)) \
        + assignments * (3 * h + 3 * i) * ACTIVATION_BYTES
    return np.maximum(flops / peak, num_bytes / hardware.memory_bandwidth)


def transferred_moe_curve(tables: list, shape: MoEShape, lane: str | None, hardware, floor_s: float | None = None,
                          any_layout: bool = False):
    """(table, source shape, (kernel, tokens, seconds)) of the kernel `lane` at `shape` where no
    version measures it there but one measures it at another model's shape with the same expert
    dtype, MoE TP, EP and token distribution. A layer's time is taken as the kernel's fixed cost
    (its floor: the least time any row of any version measures the kernel at, any shape, dtype or
    TP: its launches and routing bookkeeping, which a smaller model does not shrink; Marlin's is
    39 us on H100) plus its work, and the work (measured time less the floor) is carried from the
    source shape in proportion to the two shapes' rooflines (`moe_layer_roofline`), at the same
    tokens per expert (tokens x top-k / experts: the same GEMM rows per expert and the same share
    of experts reached). The source is the nearest version's, then the shape nearest in expert size
    (hidden x intermediate) and tokens per expert; its curve from one token. None where none.
    `floor_s`: another fixed cost (scripts/moe_carry_loo.py compares 0, a proportional carry).

    `any_layout`: the source may also be measured at another MoE TP and EP (the rooflines price each
    layout's per-GPU share: inter / MoE TP wide experts, tokens x top-k / EP assignments, experts / EP
    held), nearest first in per-GPU expert size, experts per top-k slot and experts held; `lane` None
    takes the kernel vLLM runs (`moe_kernel`) among those measured for the dtype. This is the carry of
    a layout or shape no version measures in the dtype (`pick_moe_curve`'s last pass, before the
    roofline alone)."""
    def of_kernel(frame):
        if lane is None:
            rows = frame[(frame["moe_dtype"] == shape.moe_dtype) & (frame["distribution"] == shape.distribution)]
            if rows.empty:
                return rows
            counts = rows["kernel_source"].value_counts()
            kernel = moe_kernel([str(k) for k in counts.index if str(k) not in HELPER_KERNELS]
                                or [str(k) for k in counts.index], shape.moe_dtype, shape.moe_ep_size)
            return frame[frame["kernel_source"] == kernel]
        return frame[np.array([names_kernel(str(k), lane) for k in frame["kernel_source"]], dtype=bool)]

    kernel_rows = [of_kernel(t.frame) for t in tables]
    if all(rows.empty for rows in kernel_rows):
        return None
    floor = min(float(rows["seconds"].min()) for rows in kernel_rows if not rows.empty) if floor_s is None else floor_s
    best = None
    for t, f in zip(tables, kernel_rows):
        rows = f[(f["moe_dtype"] == shape.moe_dtype) & (f["distribution"] == shape.distribution)]
        if not any_layout:
            rows = rows[(rows["moe_tp_size"] == shape.moe_tp_size) & (rows["moe_ep_size"] == shape.moe_ep_size)]
        for key, group in rows.groupby(["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size", "moe_ep_size",
                                        "kernel_source"]):
            hidden, inter, topk, experts, tp, ep, kernel = key
            if (int(hidden), int(inter), int(topk), int(experts), int(tp), int(ep)) == (
                    shape.hidden_size, shape.inter_size, shape.topk, shape.num_experts, shape.moe_tp_size,
                    shape.moe_ep_size):
                continue  # the shape itself: a carry is for what is not measured
            curve = group.groupby("num_tokens")["seconds"].mean().sort_index()
            if curve.index[0] > 1 or len(curve) < 2:
                continue
            distance = (abs(math.log(hidden * inter / tp / (shape.hidden_size * shape.inter_size / shape.moe_tp_size)))
                        + abs(math.log(experts / topk * shape.topk / shape.num_experts))
                        + (abs(math.log(experts / ep * shape.moe_ep_size / shape.num_experts)) if any_layout else 0.0))
            if best is None or distance < best[0]:
                source = replace(shape, hidden_size=int(hidden), inter_size=int(inter), topk=int(topk),
                                 num_experts=int(experts), moe_tp_size=int(tp), moe_ep_size=int(ep))
                best = (distance, t, source, str(kernel), curve)
        if best is not None:
            break  # the nearest version that measures the kernel at all
    if best is None:
        return None
    _, table, source, kernel, curve = best
    xs = curve.index.to_numpy(dtype=np.float64)
    measured = Curve(xs, curve.to_numpy(dtype=np.float64))
    # This shape's token counts at the source's tokens per expert; the work per roofline second
    # held at the source curve's ends beyond them (never extrapolated).
    per_token = (shape.topk / shape.num_experts) / (source.topk / source.num_experts)
    at = np.clip(xs * per_token, xs[0], xs[-1])
    seconds, _ = measured.many(at)
    work = np.maximum(seconds - floor, 0.0) / moe_layer_roofline(hardware, source, at)  # per roofline second
    return table, source, (kernel, xs, floor + work * moe_layer_roofline(hardware, shape, xs))


def pick_moe_curve(tables: list, shape: MoEShape, auto: bool, served: tuple[str, str] | None,
                   carry_on=None, named: bool = False):
    """(table, shape priced, (kernel, tokens, seconds), why) of the fused MoE layer, from `tables`
    (LayoutTables of one system's moe_perf, nearest version first), else the first table's reason
    it does not hold the shape (the roofline prices it then).

    In order: a curve of the kernel vLLM serves these experts with (`served`, `dispatched_moe_kernel`),
    then any measured kernel (`moe_kernel`'s choice), each from the nearest version that measures the
    shape from one token up (the smallest step a deployment runs); a curve that starts higher only
    where none does. Within each, the family's skew (the shape's distribution), then, with `auto`,
    the balanced rows. A version's table that lacks the shape yields to the next nearest that has it,
    never to the roofline while one does.

    `carry_on` (the Hardware): where no version measures the served kernel at this shape, it is
    carried from another shape that one measures it at (`transferred_moe_curve`) before any other
    kernel at this shape is taken: on the tables, a kernel carried from another shape lands within
    8-12% median (scripts/moe_carry_loo.py), where another kernel at the same shape can be 2.4-2.8x
    off (the WNA16 helper against Marlin). Only where none does, the passes after it. `named`: the
    server was told its kernel (`--moe-kernel`), and the notes say so.

    Last, where no version measures the shape at this MoE TP and EP in the dtype at all (Qwen3-30B-A3B
    at MoE TP 8; a model whose shape the tables lack), the kernel is carried from the nearest shape and
    layout that one measures (`transferred_moe_curve(any_layout=True)`): left out of the tables one at a
    time, such a carry lands within 6-12% median of the measured curve, where the roofline alone is
    55-76% short (scripts/moe_carry_loo.py --layouts)."""
    shapes = [shape]
    if auto and shape.distribution != "balanced":
        shapes.append(replace(shape, distribution="balanced"))
    passes = ([(served[0], True)] if served is not None else []) + [(None, True), (None, False)]
    nearest = tables[0]
    for lane, from_one in passes:
        if lane is None and from_one and carry_on is not None and served is not None:
            carried = _carried(tables, shapes, served[0], carry_on, any_layout=False)
            if carried is not None:
                t, s, found, source = carried
                return t, s, found, f"; {served[1]}, measured at no version at this shape: {_carry_words(t, source, False)}"
        for s in shapes:
            for t in tables:
                found = moe_curve(t.frame, s, lane)
                if isinstance(found, str) or (from_one and found[1][0] > 1):
                    continue
                why = ""
                if lane is not None and served is not None:
                    why = f"; {served[1]}, " + ("the kernel the server was told to run" if named
                                                else "the kernel vLLM serves these experts with by default")
                if t is not nearest:
                    why += f"; vLLM {nearest.version}'s table does not measure it at this shape"
                return t, s, found, why
    reason = moe_curve(nearest.frame, shape)
    if not isinstance(reason, str):
        reason = "a curve that does not start at one token"
    if carry_on is not None:
        # No version measures this shape at this layout: carry the kernel from the nearest shape and
        # layout measured in the dtype (the served kernel's rows first), as the roofline alone prices a
        # layer 2-4x too fast (scripts/moe_carry_loo.py --layouts).
        for lane in ([served[0]] if served is not None else []) + [None]:
            carried = _carried(tables, shapes, lane, carry_on, any_layout=True)
            if carried is not None:
                t, s, found, source = carried
                return t, s, found, f"; {reason}: {_carry_words(t, source, True)}"
    return f"{reason} ({Path(nearest.path).name} vLLM {nearest.version}; no other version measures it)"


def _carried(tables: list, shapes: list[MoEShape], lane: str | None, hardware, any_layout: bool):
    """(table, shape priced, (kernel, tokens, seconds), source shape) of the first of `shapes` (the
    family's skew, then balanced) that `transferred_moe_curve` carries the kernel `lane` to; None."""
    for shape in shapes:
        carried = transferred_moe_curve(tables, shape, lane, hardware, any_layout=any_layout)
        if carried is not None:
            table, source, found = carried
            return table, shape, found, source
    return None


def _carry_words(table, source: MoEShape, layout: bool) -> str:
    """How a carried curve was made, for summary.json's and validate.csv's MoE source."""
    where = f"hidden {source.hidden_size}, inter {source.inter_size}, top-{source.topk} of {source.num_experts} experts"
    if layout:
        where += f", MoE TP {source.moe_tp_size} EP {source.moe_ep_size}"
    return (f"the kernel's floor plus its work at {where} (vLLM {table.version}) scaled by the two "
            f"{'layers' if layout else 'shapes'}' rooflines at the same tokens per expert")


def nccl_curve(frame, op: str, num_gpus: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(message bytes, seconds) of one NCCL collective among num_gpus GPUs in half precision
    (message_size counts 2-byte elements), or None where the table has no such rows."""
    if frame is None:
        return None
    rows = frame[(frame["op_name"] == op) & (frame["num_gpus"] == num_gpus) & (frame["nccl_dtype"] == "half")]
    if rows.empty:
        return None
    curve = rows.groupby("message_size")["seconds"].mean().sort_index()
    return curve.index.to_numpy(dtype=np.float64) * ACTIVATION_BYTES, curve.to_numpy(dtype=np.float64)


def nccl_lookup(frame, op: str, num_gpus: int) -> Curve | None:
    """`nccl_curve` as a Curve (log-log between its points), or None."""
    pair = nccl_curve(frame, op, num_gpus)
    return None if pair is None else Curve(*pair)


def nccl_floor(frame, op: str, num_gpus: int) -> tuple[Curve, int] | None:
    """(the lower bound of one NCCL collective among `num_gpus` GPUs the table does not measure, the
    GPUs it is carried from): the table's rows among the most GPUs it measures below `num_gpus`
    (`measured_ring_below`), each time scaled to the larger ring's bytes (`ring_scaled`); None."""
    below = measured_ring_below(frame, op, num_gpus)
    if below is None:
        return None
    message_bytes, seconds, most = below
    return Curve(np.asarray(message_bytes, dtype=np.float64), np.asarray(ring_scaled(seconds, most, num_gpus))), most


def at_least(ring: float, floor: Curve | None, size: float) -> float:
    """A ring's seconds no faster than `floor` (`nccl_floor`) at `size` bytes (a bound, not counted as a
    table's extrapolation); the ring's where there is no floor."""
    return ring if floor is None else max(ring, float(floor.many(max(size, 1.0))[0]))


class MoETableCostModel(PricesSampler, MoERooflineCostModel):
    """The MoE roofline with each operator a table measures priced from the table (module doc)."""

    name = "costmodel"

    def __init__(self, model, hardware, tables, tp: int = 1, dtype: str = "bf16", kv_cache_dtype: str = "auto",
                 enable_expert_parallel: bool = False, dp: int = 1, distribution: str = "auto",
                 moe_table=None, mla_tables: MLATables | str | None = None, derived: dict | None = None,
                 moe_kernel: str = "auto"):
        """`tables`: a TableSet of the system (load_layout: gemm, attention, custom all-reduce, NCCL);
        `moe_table`: the system's moe_perf LayoutTables, nearest version first (read_layout_tables; one
        LayoutTable is taken as a list of one), or None; `mla_tables`: its
        MLA module tables (mla.read_mla_tables), None where it has none, or why they cannot be read.
        `derived`: what `derived()` gave for the same arguments instead (the tables then are not
        read: None). `moe_kernel`: the fused-MoE kernel the server was told to run (`NAMED_KERNELS`),
        or auto: vLLM's default for the experts' dtype on this GPU (`dispatched_moe_kernel`)."""
        if moe_kernel not in MOE_KERNELS:
            raise ServesimError(f"--moe-kernel {moe_kernel!r}: give one of {', '.join(MOE_KERNELS)}")
        self.moe_kernel = moe_kernel
        self._tables_ready = False
        self._sampler_by_rows: dict[int, float] = {}  # the sampler's seconds by logits rows (`PricesSampler`)
        super().__init__(model, hardware, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                         enable_expert_parallel=enable_expert_parallel, dp=dp)
        auto = distribution == "auto"
        if auto:
            distribution = family_distribution(model)
        self.distribution = table_distribution(distribution)
        self.extrapolated: dict[str, int] = {}
        self._mla: MLAModule | None = None
        self._mla_reason = ""
        self._small: tuple[float, float, bool] | None = None  # (kernel floor s, bandwidth B/s, routing in moe_perf)
        self._small_kernels = 0.0  # elementwise kernels a step, where `_small` prices them
        self._router_curve: Curve | None = None
        self._lm_head_curve: Curve | None = None
        if derived is None:
            self._derive(tables, kv_cache_dtype, distribution, auto, moe_table, mla_tables)
        else:
            self._restore(derived)
        self._by_tokens: dict[int, tuple] = {}  # dense()'s table parts by token count
        self.graph_sizes = CUDA_GRAPH_SIZES  # vLLM's defaults on an H100 or H200 (set_cuda_graph_sizes)
        self._tables_ready = True
        self._dense_cache.clear()
        # The fast paths of `execute` and `decode_run` (full attention priced from the tables: GQA, or MLA
        # from its module tables):
        # the parts that depend on the step's token and logits counts alone, kept by those counts;
        # decode runs' stretches (see decode_run); first prefill chunks' attention by length.
        self._fast = self._attention is not None and self.decodes_from_sums
        self._step_parts: dict[tuple[int, int], tuple[dict, float]] = {}
        self._run_parts: dict[int, tuple[dict, float]] = {}
        self._run_chunks: dict[tuple[int, int, int], tuple] = {}
        self._first_chunks: dict[int, float] = {}

    # ---- derivation

    def _derive(self, tables, kv_cache_dtype: str, distribution: str, auto: bool, moe_table,
                mla_tables: MLATables | str | None) -> None:
        self.system = tables.system
        self.sources: dict[str, str] = {}
        self.notes: list[str] = []
        m = self.model
        self._moe = self._attention = None
        kernel_in_table = None  # the moe_perf rows' kernel_source, where a table prices the MoE layer
        # moe
        moe_tables = [] if moe_table is None else [moe_table] if not isinstance(moe_table, list) else moe_table
        if not m.num_experts:
            pass
        elif not moe_tables:
            self.sources["moe"] = f"roofline: {tables.system} has no moe_perf table for vLLM"
        else:
            from backends.costmodel.optables.systems import system_sm_version

            shape = MoEShape(m.hidden_size, m.moe_intermediate_size, m.num_experts_per_tok, m.num_experts,
                             self.moe_tp, self.ep, MOE_DTYPES.get(self.experts_dtype, self.experts_dtype),
                             self.distribution)
            named = self.moe_kernel != "auto"
            served = NAMED_KERNELS[self.moe_kernel] if named else dispatched_moe_kernel(
                shape.moe_dtype, system_sm_version(tables.system), online=not (m.expert_dtype or m.weight_dtype))
            shape = replace(shape, moe_dtype=KERNEL_DTYPES.get((self.moe_kernel, shape.moe_dtype), shape.moe_dtype))
            picked = pick_moe_curve(moe_tables, shape, auto, served, self.hardware, named)
            if (served is not None and served[0] == "triton" and shape.moe_dtype == "fp8"
                    and (isinstance(picked, str) or not names_kernel(picked[2][0], "triton"))):
                # The Triton kernel (--dtype fp8's, or named by --moe-kernel triton) is not measured in
                # per-tensor fp8 on this system (H100's tables time it with block scales only): the same
                # kernel's block-fp8 rows price it, fp8 weights on the fp8 tensor cores with 128 x 128
                # scales, not another kernel's.
                block = pick_moe_curve(moe_tables, replace(shape, moe_dtype="fp8_block"), auto, served, None, named)
                if not isinstance(block, str) and names_kernel(block[2][0], "triton"):
                    table, priced, found, why = block
                    picked = (table, priced, found, f"{why}; not measured in per-tensor fp8 on {tables.system}: "
                              "priced from the same kernel's block-fp8 rows")
            if named and (isinstance(picked, str) or not names_kernel(picked[2][0], served[0])):
                raise ServesimError(
                    f"--moe-kernel {self.moe_kernel}: no version of {tables.system}'s moe_perf tables measures "
                    f"{served[0]} for {shape.moe_dtype} experts at MoE TP {shape.moe_tp_size}, EP "
                    f"{shape.moe_ep_size} ({shape.distribution}), at this model's shape or another; leave "
                    f"--moe-kernel auto for the kernel vLLM picks")
            if isinstance(picked, str):
                self.sources["moe"] = f"roofline: {picked}{self._marlin_said if shape.moe_dtype == 'nvfp4' else ''}"
            else:
                table, priced, (kernel, xs, ys), why = picked
                if priced.distribution != shape.distribution:
                    # The family's skew is not measured at this shape, the balanced one is: take it, and say so.
                    self.notes.append(f"moe: no {shape.distribution} rows at this shape; priced balanced")
                    self.distribution = "balanced"
                if served is not None and not names_kernel(kernel, served[0]):
                    self.notes.append(f"moe: {served[1]}, the kernel vLLM serves {shape.moe_dtype} experts with by "
                                      f"default on this GPU, is not measured at this shape; priced with {kernel}")
                self._moe = Curve(xs, ys)
                kernel_in_table = kernel
                self.sources["moe"] = (f"moe_perf vLLM {table.version} ({table.how}{why}): {kernel}, "
                                       f"{priced.moe_dtype}, MoE TP {priced.moe_tp_size} EP {priced.moe_ep_size}, "
                                       f"{priced.distribution}; tokens {int(xs[0])}..{int(xs[-1])}")
        if m.num_experts and not auto and self._moe is None:
            # (balanced too: the roofline that would price the layer spreads no tokens over experts)
            raise ServesimError(f"--moe-distribution {distribution} is priced from the moe_perf rows measured with "
                                f"it, and none price this layer ({self.sources['moe']}); give auto"
                                + (" (the roofline then prices the layer)" if distribution == "balanced"
                                   else " or balanced"))
        if m.kv_lora_rank:
            self._derive_mla(tables.system, mla_tables, kv_cache_dtype)
        self._linear_curves = self._derive_linear(tables)
        self._derive_attention(tables, kv_cache_dtype)
        self._derive_collectives(tables)
        self._derive_small_kernels(tables, kernel_in_table)

    def derived(self) -> dict | None:
        """What the tables gave this model (curves, grids, sources, notes, the MoE distribution as
        priced, the MLA module's grids or why there are none) as JSON's values, floats as Python
        writes them back exactly (`_restore` makes the same model from them); None where an array
        is not of float64 (it would not come back the same)."""
        mla = self._mla
        grids = [] if mla is None else [mla.context, mla.generation]
        if self._attention is not None and mla is None:
            grids += list(self._attention.values())
        arrays = [c.ys for c in (self._moe, self._router_curve, self._lm_head_curve,
                                 *(getattr(self, name) for name in COLLECTIVES)) if c is not None]
        arrays += [c.ys for c, _ in self._linear_curves or []]
        arrays += [g.grid for g in grids]
        if any(np.asarray(a).dtype != np.float64 for a in arrays):
            return None

        def curve(c: Curve | None):
            return None if c is None else {"xs": c.xs.tolist(), "ys": c.ys.tolist(), "power": c.power}

        def grid(g: Grid) -> dict:
            return {"xa": g.xa.tolist(), "xb": g.xb.tolist(), "grid": g.grid.tolist(), "power_a": g.power_a,
                    "power_b": g.power_b}

        return {"system": self.system, "sources": dict(self.sources), "notes": list(self.notes),
                "distribution": self.distribution, "moe": curve(self._moe),
                "linear": None if self._linear_curves is None else [[curve(c), n] for c, n in self._linear_curves],
                # an MLA model's attention is its module's generation grid (`_derive_attention`)
                "attention": None if self._attention is None or mla is not None else [
                    {"window": w, "kind": k, **grid(g)} for (w, k), g in self._attention.items()],
                "mla": None if mla is None else {"context": grid(mla.context), "generation": grid(mla.generation),
                                                 "source": mla.source},
                "mla_reason": self._mla_reason,
                "collectives": {name: curve(getattr(self, name)) for name in COLLECTIVES},
                "small": None if self._small is None else list(self._small),
                "router": curve(self._router_curve), "lm_head": curve(self._lm_head_curve)}

    def _restore(self, derived: dict) -> None:
        def curve(c):
            return None if c is None else Curve(np.array(c["xs"], dtype=np.float64),
                                                np.array(c["ys"], dtype=np.float64), c["power"])

        def grid(g) -> Grid:
            return Grid(np.array(g["xa"], dtype=np.float64), np.array(g["xb"], dtype=np.float64),
                        np.array(g["grid"], dtype=np.float64), g["power_a"], g["power_b"])

        self.system, self.sources, self.notes = derived["system"], dict(derived["sources"]), list(derived["notes"])
        self.distribution = derived["distribution"]
        self._moe = curve(derived["moe"])
        self._linear_curves = None if derived["linear"] is None else [(curve(c), n) for c, n in derived["linear"]]
        self._attention = None if derived["attention"] is None else {
            (g["window"], g["kind"]): grid(g) for g in derived["attention"]}
        self._mla, self._mla_reason = None, derived["mla_reason"]
        if derived["mla"] is not None:
            mla = derived["mla"]
            module = MLAModule(grid(mla["context"]), grid(mla["generation"]), mla["source"])
            self._set_mla(module)
            self._attention = {(0, "generation"): module.generation}  # as _derive_attention sets it
        for name in COLLECTIVES:
            setattr(self, name, curve(derived["collectives"][name]))
        self._router_curve, self._lm_head_curve = curve(derived["router"]), curve(derived["lm_head"])
        self._small = None if derived["small"] is None else (float(derived["small"][0]), float(derived["small"][1]),
                                                             bool(derived["small"][2]))
        if self._small is not None:
            self._set_small()

    def _derive_mla(self, system: str, mla_tables: MLATables | str | None, kv_cache_dtype: str) -> None:
        """The MLA module tables' grids for this model (mla.py), or the reason they cannot price it."""
        m = self.model
        if mla_tables is None:
            self._mla_reason = f"{system} has no {'DSA' if m.index_topk else 'MLA'} module tables for vLLM"
        elif isinstance(mla_tables, str):
            self._mla_reason = mla_tables
        else:
            found = mla_module(mla_tables, m, self._heads, self.weights_dtype, kv_cache_dtype)
            if isinstance(found, str):
                self._mla_reason = f"{found} ({mla_tables.describe})"
            else:
                self._set_mla(found)

    def _set_mla(self, module: MLAModule) -> None:
        """Price MLA layers from `module`; the roofline's RoPE per token, which it holds (elementwise)."""
        m = self.model
        self._mla = module
        q_k_width = (self._heads + self._kv_heads) * m.qk_rope_head_dim
        self._rope_s_per_token = m.num_hidden_layers * ACTIVATION_BYTES * 2 * q_k_width / self._bytes_s

    def _gemm_rows(self, tables, dtype: str):
        from backends.costmodel.optables.derive import kernels_by_preference

        name = LINEAR_DTYPES.get(dtype)
        g = tables.gemm
        rows = g[g["gemm_dtype"] == name] if name is not None else g.iloc[:0]
        kernels = kernels_by_preference(tables, "gemm", rows) if not rows.empty else []
        if not kernels:
            return None, None
        return kernels[0], rows[rows["kernel_source"] == kernels[0]]

    @property
    def _marlin_said(self) -> str:
        """What a roofline note adds where NVFP4 weights meet a GPU without fp4 tensor cores."""
        return "" if fp4_native(self.hardware.name) else (
            f" (without fp4 tensor cores on {self.hardware.name}, vLLM runs NVFP4 weight-only with Marlin: "
            "4-bit weights at bf16's rate)")

    def _derive_linear(self, tables) -> list[tuple[Curve, int]] | None:
        """(curve, layers) of every linear GEMM the roofline's `linear` counts, or None (roofline)."""
        from backends.costmodel.optables.derive import gemm_curve

        m, tp, h = self.model, self.tp, self.model.hidden_size
        if m.kv_lora_rank:
            if self._mla is None:
                self.sources["linear"] = f"roofline: MLA's projections (no MLA module table prices them: {self._mla_reason})"
            else:  # see the module doc: the gemm table's block-fp8 rows were not measured as vLLM runs them
                self.sources["linear"] = ("roofline: the dense MLPs and shared experts, as before (MLA's projections "
                                          "in attention's MLA module tables)")
            return None
        # Block-fp8 weights are priced from the per-tensor fp8 rows: the same fp8 weight bytes and tensor-core
        # work, measured inside a CUDA graph as vLLM runs its steps; the block-fp8 rows were measured without one
        # (the module doc).
        table_dtype = "fp8" if self.weights_dtype == "fp8-block" else self.weights_dtype
        kernel, rows = self._gemm_rows(tables, table_dtype)
        if rows is None:
            marlin = self._marlin_said if table_dtype == "nvfp4" else ""  # (an NVFP4 checkpoint's note only)
            self.sources["linear"] = f"roofline: no {table_dtype} GEMM rows on {tables.system}{marlin}"
            return None
        nh, nkv, hd = self._heads, self._kv_heads, m.head_dim
        layers = m.num_attention_layers  # (a DeciLM layer without attention has no projections)
        shapes = [((nh + 2 * nkv) * hd, h, layers, "qkv"), (h, nh * hd, layers, "o")]
        for width, num_layers in m.dense_mlp_widths.items():  # (DeciLM: each MLP width its own shapes)
            i = width // tp
            width_said = f" {width}" if m.mlp_widths else ""
            shapes += [(2 * i, h, num_layers, f"dense gate_up{width_said}"), (h, i, num_layers, f"dense down{width_said}")]
        if m.num_experts and m.shared_expert_intermediate_size:
            s = m.shared_expert_intermediate_size // tp
            shapes += [(2 * s, h, m.num_moe_layers, "shared gate_up"), (h, s, m.num_moe_layers, "shared down")]
        curves = []
        for n, k, layers, what in shapes:
            ms, seconds = gemm_curve(rows, n, k, what, self.notes)
            curves.append((Curve(ms.astype(np.float64), seconds), layers))
        self.sources["linear"] = f"gemm_perf {tables.versions.get('gemm', ('?',))[0]}: {kernel}" + (
            " (per-tensor fp8 rows for block-fp8 weights: the block-fp8 rows are measured without a CUDA graph)"
            if table_dtype != self.weights_dtype else "")
        return curves

    def _derive_small_kernels(self, tables, moe_kernel_source: str | None) -> None:
        """The kernels no table times one by one, priced as the dense operator model prices them
        (backends/costmodel/optables/model.py): each elementwise kernel (the fused add+RMSNorms, RoPE,
        Qwen3's q/k norms, the KV-cache write, fp8's activation quantization, SiLU-and-mul of the dense
        MLPs and shared experts, the router's top-k where the moe_perf rows took the routing
        precomputed, the embedding, the final norm and the sampler's passes over the fp32 logits) the
        GEMM table's kernel floor plus its bytes over the table's achieved HBM bandwidth
        (`derive_memory`); the router's [hidden, experts] GEMM and the LM head from the bf16 GEMM rows;
        the logits' all-gather under TP as an all-reduce of half its bytes, and the vocab-parallel
        embedding's all-reduce. The step then has no fixed overhead: the engine core's CPU time is the
        host-time model's (backends/host_time.py), as for a dense model priced from the tables.
        Without a bf16 GEMM at m = 1 to read the floor and bandwidth from, these stay the roofline's
        and so does its per-step overhead."""
        from backends.costmodel.optables.derive import derive_memory, gemm_curve

        m = self.model
        self._small = None
        self._router_curve = self._lm_head_curve = None
        try:
            memory = derive_memory(tables)
        except ServesimError as e:
            self.sources["elementwise"] = f"roofline, and a step overhead of {self.eff.step_overhead_s * 1e3:g} ms ({e})"
            return
        # The moe_perf rows of the MXFP4 layer ran vLLM's FusedMoE module, routing included; the others
        # ran `fused_experts` on top-k ids computed beforehand (collector/vllm/collect_moe.py, `run_moe_torch`).
        routing_in_table = moe_kernel_source is not None and "mxfp4" in moe_kernel_source
        self._small = (float(memory["kernel_floor_s"]), float(memory["bandwidth_bytes_per_s"]), routing_in_table)
        kernel, rows = self._gemm_rows(tables, "bf16")
        gemms = [("lm_head", self._vocab)] + ([("router", m.num_experts)] if m.num_experts else [])
        for op, n in gemms:
            if rows is None:
                self.sources[op] = f"roofline: no bf16 GEMM rows on {tables.system}"
                continue
            try:
                ms, seconds = gemm_curve(rows, n, m.hidden_size, op, self.notes)
            except ServesimError as e:  # a grid with holes (a folder of tables of another source)
                self.sources[op] = f"roofline: {e}"
                continue
            setattr(self, f"_{op}_curve", Curve(ms.astype(np.float64), seconds))
            self.sources[op] = f"gemm_perf {tables.versions.get('gemm', ('?',))[0]}: {kernel} (bf16)"
        self._set_small()

    def _set_small(self) -> None:
        """What `_small` gives: no fixed per-step overhead, and the sources that say so."""
        assert self._small is not None
        floor, bandwidth, routing_in_table = self._small
        self._small_kernels = self._small_kernels_per_step(routing_in_table)
        self.eff = replace(self.eff, step_overhead_s=0.0)
        how = (f"each kernel the GEMM table's floor ({floor * 1e6:.1f} us) plus its bytes at the table's "
               f"bandwidth ({bandwidth / 1e12:.2f} TB/s)")
        if self._mla is None:
            self.sources["kv_write"] = how
        self.sources["elementwise"] = how + ("" if self._mla is None else ", less MLA's RoPE (in attention's MLA "
                                                                         "module tables)")
        self.sources["overhead"] = "none: the engine core's CPU time per step is the host-time model's"

    def _small_kernels_per_step(self, routing_in_table: bool) -> float:
        """The elementwise kernels of one step (`_derive_small_kernels`): its layers' (the KV-cache
        write counted apart, in kv_write), the embedding and the final norm."""
        m = self.model
        norms = 2 if m.sandwich_norms else 1  # the fused add+RMSNorms of each sublayer (attention, MLP)
        per_attention = 0
        if self._mla is None:
            per_attention += 1 + (1 if m.qk_norm else 0)  # RoPE; Qwen3's q/k norms
        if self.weights_dtype in ("fp8", "fp8-block", "nvfp4"):
            per_attention += 1  # the attention output's quantization
        # (a DeciLM layer's no-op attention or MLP has neither its norm nor its kernels)
        kernels = float(m.num_sublayers * norms + m.num_attention_layers * per_attention
                        + m.num_dense_mlp_layers)  # SiLU-and-mul of dense MLPs
        if m.num_experts:
            kernels += m.num_moe_layers * ((0 if routing_in_table else 1)  # the router's top-k
                                           + (1 if m.shared_expert_intermediate_size else 0))
        return kernels + 2  # the embedding and the final norm

    def _derive_attention(self, tables, kv_cache_dtype: str) -> None:
        from backends.costmodel.optables.derive import _attention_grid, attention_kernel

        m = self.model
        if m.kv_lora_rank:
            if self._mla is None:
                self.sources["attention"] = f"roofline: MLA ({self._mla_reason})"
                return
            self._attention = {(0, "generation"): self._mla.generation}  # the decodes' lookups, as GQA's
            self.sources["attention"] = self._mla.source
            shared = m.num_hidden_layers - m.num_indexer_layers if m.index_topk else 0
            if shared:
                self.sources["attention"] += (
                    f"; the {shared} layers of {m.num_hidden_layers} that reuse an earlier layer's top-k (no "
                    "indexer of their own) carried from the measured layer by the roofline's seconds without and "
                    "with the indexer, for the same requests")
            self.sources["kv_write"] = "in attention (the MLA module tables write the latents to the KV cache)"
            self.sources["elementwise"] = "roofline, less MLA's RoPE (in attention's MLA module tables)"
            return
        kv = "fp8" if kv_cache_dtype == "fp8" else "bf16"
        grids = {}
        for window in sorted({0} | ({m.sliding_window} if self._sliding_layers else set())):
            for kind, length, offset in (("context", "isl", 0), ("generation", "step", 1)):
                frame = getattr(tables, f"{kind}_attention")
                try:
                    kernel = attention_kernel(tables, kind, kv, m.head_dim)
                except ServesimError as e:
                    self.sources["attention"] = f"roofline: {e}"
                    return
                rows = frame[(frame["kernel_source"] == kernel) & (frame["window_size"] == window)
                             & (frame["kv_cache_dtype"] == {"bf16": "bfloat16", "fp8": "fp8"}[kv])
                             & (frame["head_dim"] == m.head_dim) & (frame["num_heads"] == self._heads)
                             & (frame["num_key_value_heads"] == self._kv_heads)]
                if rows.empty:
                    self.sources["attention"] = (f"roofline: no {kind} attention rows for {self._heads} heads, "
                                                 f"{self._kv_heads} KV heads, head_dim {m.head_dim}, window {window}")
                    return
                batch, lengths, grid = _attention_grid(rows, length, offset)
                full, _ = fill_rows_by_scaling(np.asarray(batch, dtype=np.float64), grid)
                power = 2.0 if kind == "context" else 1.0
                grids[window, kind] = Grid(batch, lengths, full, power_b=power)
        self._attention = grids
        windows = f"; sliding layers at window {m.sliding_window}" if self._sliding_layers else ""
        if self._chunked_layers:
            windows += (f"; chunked-local layers as full attention over their {m.attention_chunk_size}-token "
                        "chunk's tokens so far")
        self.sources["attention"] = (f"attention tables {tables.versions.get('generation_attention', ('?',))[0]}"
                                     f"{windows}")

    def _derive_collectives(self, tables) -> None:
        self._ar_custom = self._ar_custom_eager = self._ar_nccl = self._gather = self._scatter = None
        # Where no NCCL rows measure a group (past a node, or a GPU count the table lacks), its ring is
        # never faster than NCCL's among the most GPUs measured, bytes scaled (`nccl_floor`).
        self._ar_floor = self._gather_floor = self._scatter_floor = None
        if self.tp > 1:
            # vLLM's custom all-reduce only within a node, and over PCIe only between two GPUs
            # (custom_all_reduce.py, `CustomAllreduce.__init__`; the dense model's `derive_allreduce`)
            spans = self.hardware.spans_nodes(self.tp)
            a = tables.custom_allreduce if runs_custom_allreduce(self.hardware.link, self.tp, spans) else None
            for mode, name in (("graph", "_ar_custom"), ("eager", "_ar_custom_eager")):
                rows = None if a is None else a[(a["num_gpus"] == self.tp) & a["kernel_source"].str.contains(mode)]
                if rows is not None and not rows.empty:
                    c = rows.groupby("message_size")["seconds"].mean().sort_index()
                    setattr(self, name, Curve(c.index.to_numpy(dtype=np.float64) * ACTIVATION_BYTES, c.to_numpy()))
            # (NCCL's table measures one node's GPUs: a TP group past a node rings over the network)
            self._ar_nccl = None if spans else nccl_lookup(tables.nccl, "all_reduce", self.tp)
            floor = None if self._ar_nccl is not None else nccl_floor(tables.nccl, "all_reduce", self.tp)
            bound = ""
            if floor is not None:
                self._ar_floor, most = floor
                bound = f" (never faster than NCCL's table among {most} GPUs, its bytes scaled to {self.tp})"
            if self._ar_custom is None and self._ar_nccl is None:
                self.sources["allreduce"] = f"roofline: no all-reduce table for {self.tp} GPUs on {tables.system}{bound}"
            else:
                self.sources["allreduce"] = ("custom all-reduce table (CUDA graph; eager past the graphs where it has "
                                             "eager rows) up to 8 MiB" if self._ar_custom
                                             else "no custom all-reduce table") + (
                    ", NCCL table past it" if self._ar_nccl is not None else f", the roofline's ring past it{bound}")
        if self.dp > 1 and self.model.num_experts:
            g = self.moe_group
            group = f"among {g} GPUs ({'the EP group, sequence-parallel MoE' if self.sequence_parallel_moe else 'the DP group'})"
            # The group's members lie among the engine's tp x dp GPUs (a DP group's stand tp apart):
            # past a node it rings over the network between nodes, which no NCCL table (one node's
            # GPUs) measures.
            link, bandwidth = self.hardware.group_link(self.moe_span, members=g)
            crosses = self.hardware.spans_nodes(self.moe_span)
            self._gather = None if crosses else nccl_lookup(tables.nccl, "all_gather", g)
            self._scatter = None if crosses else nccl_lookup(tables.nccl, "reduce_scatter", g)
            bounds = {}
            for op, name, table in (("all_gather", "_gather_floor", self._gather),
                                    ("reduce_scatter", "_scatter_floor", self._scatter)):
                floor = None if table is not None else nccl_floor(tables.nccl, op, g)
                if floor is not None:
                    setattr(self, name, floor[0])
                    bounds[op] = f"; never faster than NCCL's {op} table among {floor[1]} GPUs, its bytes scaled to {g}"
            how = "vLLM's allgather_reducescatter (AgRsAll2AllManager)"
            over = ("the network between nodes" if link == "inter-node" else "the link") + (
                "" if bandwidth is None else f" at {bandwidth / 1e9:g} GB/s")
            def why(op: str) -> str:
                return (f"the group lies among {self.moe_span} GPUs, past a node of {self.hardware.gpus_per_node}: "
                        "no NCCL table (one node's GPUs)" if crosses else f"no NCCL {op} table")
            self.sources["dispatch"] = (f"NCCL all_gather table {group}, {how}" if self._gather is not None
                                        else f"roofline: a ring over {over} {group} ({why('all_gather')}"
                                             f"{bounds.get('all_gather', '')}), {how}")
            self.sources["combine"] = (f"NCCL reduce_scatter table {group}, {how}" if self._scatter is not None
                                       else f"roofline: a ring over {over} {group} ({why('reduce_scatter')}"
                                            f"{bounds.get('reduce_scatter', '')}), {how}")

    # ---- pricing

    def _count(self, op: str, scaled) -> None:
        n = int(np.count_nonzero(scaled))
        if n:
            self.extrapolated[op] = self.extrapolated.get(op, 0) + n

    def _count_flags(self, *scaled: bool) -> None:
        """`_count("attention", [...])` of scalar lookups' flags, without making an array of them."""
        n = sum(scaled)
        if n:
            self.extrapolated["attention"] = self.extrapolated.get("attention", 0) + n

    def _curve_at(self, op: str, curve: Curve, x):
        """The curve's time at one size (counted in `extrapolated` when scaled past its grid)."""
        if curve.xs[0] <= x <= curve.xs[-1]:  # within the grid: the scalar lookup, exactly `many`'s value
            return curve.at(x)[0]
        t, scaled = curve.many(x)
        self._count(op, scaled)
        return t

    def _pair(self, op: str, pair: Curve, size):
        return self._curve_at(op, pair, np.maximum(size, 1.0))

    def _dense_moe(self, t):
        if getattr(self, "_tables_ready", False):
            return 0.0  # `_token_parts` prices it
        return super()._dense_moe(t)

    def moe_seconds(self, t):
        if self._moe is None or not getattr(self, "_tables_ready", False):
            return super().moe_seconds(t)
        return self.model.num_moe_layers * self._curve_at("moe", self._moe, t)

    def dispatch_seconds(self, num_bytes: float) -> float:
        if self._gather is None:
            return at_least(super().dispatch_seconds(num_bytes), self._gather_floor, num_bytes)
        return float(self._pair("dispatch", self._gather, num_bytes))

    def combine_seconds(self, num_bytes: float) -> float:
        if self._scatter is None:
            return at_least(super().combine_seconds(num_bytes), self._scatter_floor, num_bytes)
        return float(self._pair("combine", self._scatter, num_bytes))

    def dense(self, t: int, num_logits: int) -> tuple:
        if not getattr(self, "_tables_ready", False):
            return super().dense(t, num_logits)
        by_tokens = self._by_tokens.get(t)
        if by_tokens is None:  # the roofline's parts of t tokens, the tables' where they price them
            graph = t <= self.graph_sizes[-1]
            # vLLM pads a graph's step to its size, and the padding routes to experts as tokens do: its input ids
            # are the buffer's earlier tokens, not zeros (vllm/v1/worker/gpu_model_runner.py zeroes only their
            # positions), so the MoE layer is priced at the padded count with the step's distribution.
            t_run = int(padded_tokens(t, self.graph_sizes)) if t else 0
            linear, router, moe, kv_write, layers_elementwise, allreduce = self.dense_tokens(t_run)
            linear, moe, allreduce = self._token_parts(t_run, linear, moe, allreduce, graph)
            if self._mla is not None:  # the module tables hold MLA's KV-cache write (mla.py)
                kv_write = 0.0
            elif self._small is not None and t:
                floor, bandwidth, _ = self._small
                kv_write = kv_write * (self._bytes_s / bandwidth) + self.model.num_attention_layers * floor
            if self._router_curve is not None:
                router = self.model.num_moe_layers * float(self._curve_at("router", self._router_curve, t_run)) if t else 0.0
            if self._moe is not None and t:  # the routed experts' SiLU-and-mul is in the moe_perf kernel's time
                layers_elementwise = layers_elementwise - t_run * self._experts_activation_s()
            by_tokens = self._by_tokens[t] = (linear, router, moe, kv_write, layers_elementwise, allreduce, t_run)
        linear, router, moe, kv_write, layers_elementwise, allreduce, t_run = by_tokens
        elementwise = self.elementwise_seconds(layers_elementwise, t, num_logits)
        if self._mla is not None:  # and MLA's RoPE
            elementwise = elementwise - t_run * self._rope_s_per_token
        if self._small is None:
            return linear, router, moe, kv_write, elementwise, self.lm_head_seconds(num_logits), allreduce
        # The small kernels as the dense operator model prices them (`_derive_small_kernels`): the
        # roofline's bytes at the table's bandwidth, and each kernel's floor.
        floor, bandwidth, _ = self._small
        elementwise = elementwise * (self._bytes_s / bandwidth)
        if t:
            elementwise = elementwise + self._small_kernels * floor
        lm_head = 0.0
        if num_logits:
            elementwise = elementwise + self._sampler_seconds(num_logits, floor, bandwidth)
            lm_head = (self._curve_at("lm_head", self._lm_head_curve, num_logits) if self._lm_head_curve is not None
                       else self.lm_head_seconds(num_logits))
            if self.tp > 1:  # the logits' all-gather, as an all-reduce of half its bytes (outside the graph)
                allreduce = allreduce + self._hidden_allreduce(num_logits * self._vocab * self.tp * ACTIVATION_BYTES / 2,
                                                               graph=False)
        return linear, router, moe, kv_write, elementwise, lm_head, allreduce

    @property
    def prices_sampler(self) -> bool:
        """Whether the sampler is priced from the tables (their kernel floor and bandwidth); without a bf16 GEMM
        at m = 1 to read them from, the step's small kernels stay the roofline's, which price greedy's."""
        return self._small is not None

    def set_cuda_graph_sizes(self, sizes) -> None:
        """The deployment's CUDA-graph capture sizes (`sim.config.cuda_graph_sizes`): a step of at most the
        largest is padded to the next size up (every token-count part priced at it) and runs its
        all-reduces as graph kernels; the parts and decode runs priced with other sizes are dropped."""
        sizes = graph_sizes_array(sizes)
        if np.array_equal(sizes, self.graph_sizes):
            return
        self.graph_sizes = sizes
        self._by_tokens = {}
        self._dense_cache.clear()
        self._step_parts.clear()
        self._run_parts.clear()
        self._run_chunks.clear()

    def _forget_sampler(self) -> None:
        """Drop the sampler's seconds and the steps and decode runs priced with another sampler (sim validate
        keeps one model for the rows of a deployment, whose clients' sampling may differ)."""
        self._sampler_by_rows = {}
        self._dense_cache.clear()
        self._step_parts.clear()
        self._run_parts.clear()
        self._run_chunks.clear()

    def _sampler_seconds(self, num_logits: int, floor: float, bandwidth: float) -> float:
        """The sampler's seconds for `num_logits` rows (backends/sampler.py), kept by rows for the sampling set."""
        found = self._sampler_by_rows.get(num_logits)
        if found is None:
            found = self._sampler_by_rows[num_logits] = float(sampler_seconds(
                self.sampling, self.sampler_version, num_logits, self._vocab * self.tp, floor, bandwidth))
        return found

    def _experts_activation_s(self) -> float:
        """The roofline's elementwise seconds a token of the routed experts' SiLU-and-mul takes (read
        gate and up, write): `fused_experts`, which the moe_perf rows time, runs it itself
        (collector/vllm/collect_moe.py), so a table-priced MoE layer leaves it out of elementwise."""
        m = self.model
        i = m.moe_intermediate_size // self.moe_tp
        return m.num_moe_layers * ACTIVATION_BYTES * 3 * i * m.num_experts_per_tok / self.ep / self._bytes_s

    def _token_parts(self, t: int, linear, moe, allreduce, graph: bool = True) -> tuple:
        """(linear, moe, allreduce) of t tokens from the tables (the roofline's where none); `graph`: the
        step runs in a CUDA graph (its all-reduces the graph kernel's)."""
        m, h = self.model, self.model.hidden_size
        tokens = max(t, 1)
        if self._linear_curves is not None:
            linear = sum(layers * self._curve_at("linear", c, tokens) for c, layers in self._linear_curves)
            linear = float(linear) if t else 0.0
        elif self._mla is not None:  # the roofline's dense MLPs and shared experts (MLA's projections: attention)
            linear = max(0.0, float(linear - self._attention_linear_all(t)))
        if m.num_experts and self.dp == 1:
            moe = float(self.moe_seconds(tokens)) if t else 0.0
        elif m.num_experts:  # every DP rank as loaded as this one: the kernel, dispatch and combine
            moe = self.lockstep_moe_seconds(t)
        if self.tp > 1 and (self._ar_custom is not None or self._ar_nccl is not None or self._ar_floor is not None):
            # two a layer; with the small kernels priced, the vocab-parallel embedding's too (as the dense model's)
            count = m.num_sublayers + (0 if self._small is None else 1)  # (DeciLM: none for a no-op sublayer)
            allreduce = float(count * self._hidden_allreduce(t * h * ACTIVATION_BYTES, graph)) if t else 0.0
        return linear, moe, allreduce

    def _hidden_allreduce(self, size: float, graph: bool = True) -> float:
        """One all-reduce of `size` bytes among the TP GPUs: vLLM's custom all-reduce table up to
        8 MiB (its CUDA-graph kernel's rows inside a graph, its eager rows outside one, as the dense
        operator model prices them), NCCL's past it, else a ring over the link."""
        if self._ar_custom is not None and size <= CUSTOM_ALLREDUCE_MAX_BYTES:
            custom = self._ar_custom if graph or self._ar_custom_eager is None else self._ar_custom_eager
            return self._curve_at("allreduce", custom, max(size, 1))
        if self._ar_nccl is not None:
            return self._pair("allreduce", self._ar_nccl, size)
        return at_least(float(ring_allreduce_over(size, self.tp, self.hardware)), self._ar_floor, size)

    def _window_attention(self, window: int, q: int, c: int) -> float:
        """One layer's attention of one request from the tables at `window` (0: full attention)."""
        kv = c if window == 0 else min(c, window + q - 1)
        if q == 1:
            t, scaled = self._attention[window, "generation"].at(1, kv)
            self._count_flags(scaled)
            return t
        pairs = q * (kv - q) + q * (q + 1) / 2.0 if kv >= q else q * (q + 1) / 2.0
        isl = (math.sqrt(8.0 * pairs + 1.0) - 1.0) / 2.0
        t, scaled = self._attention[window, "context"].at(1, isl)
        read, scaled_read = self._attention[window, "generation"].at(1, kv)
        self._count_flags(scaled, scaled_read)
        return max(t, read)

    def request_seconds(self, q: int, c: int) -> float:
        if self._attention is None or not getattr(self, "_tables_ready", False):
            return super().request_seconds(q, c)
        if self._mla is not None:
            return self._chunks_attention([(q, c)])
        total = 0.0
        if self._full_layers:
            total += self._full_layers * self._window_attention(0, q, c)
        if self._sliding_layers:
            total += self._sliding_layers * self._window_attention(self.model.sliding_window, q, c)
        if self._chunked_layers:  # each piece within one chunk a full attention over the chunk so far
            pieces = chunk_pieces(q, c, self.model.attention_chunk_size)
            one = sum(self._window_attention(0, qi, ci) for qi, ci in pieces)
            if len(pieces) > 1:  # virtual requests of one kernel launch: no more than the full attention over
                # the same queries, which does all their work and more (not a kernel's floor per piece)
                one = min(one, self._window_attention(0, q, c))
            total += self._chunked_layers * one
        return total

    def _chunks_attention(self, chunks: list[tuple[int, int]]) -> float:
        """Every layer's attention of a step's prefill chunks: MLA's as one batch from the module
        tables (mla.MLAModule.chunks), GQA's each on its own (request_seconds)."""
        if self._mla is None:
            return sum(self.request_seconds(q, c) for q, c in chunks)
        if not chunks:
            return 0
        t, off = self._mla.chunks(chunks)
        if off:
            self.extrapolated["attention"] = self.extrapolated.get("attention", 0) + off
        return self._sparse_module_layers(chunks) * t

    def _decodes_attention(self, window: int, kv_lens: list[int]) -> float:
        """One layer's attention of a step's decodes as one batch at their mean KV length (the
        generation table's batch x KV length grid, as the dense operator model prices them)."""
        if not kv_lens:
            return 0.0
        t, scaled = self._attention[window, "generation"].at(len(kv_lens), sum(kv_lens) / len(kv_lens))
        self._count_flags(scaled)
        return t

    def parts(self, agg: StepAggregates, chunks: list[tuple[int, int]], dense: tuple) -> dict:
        if self._attention is None:
            return super().parts(agg, chunks, dense)
        if not self.decodes_from_sums:  # sliding layers: `chunks` are every request's (q, c)
            parts = super().parts(agg, [], dense)
            decodes = [c for q, c in chunks if q == 1]
            w = self.model.sliding_window
            prefills = [(q, c) for q, c in chunks if q != 1]
            # (an MLA or DSA module prices a step's chunks as one batch, as on the fast path)
            attention = self._chunks_attention(prefills) if self._mla is not None else \
                sum(self.request_seconds(q, c) for q, c in prefills)
            if self._full_layers:
                layers = self._sparse_module_layers([(1, c) for c in decodes]) if self._mla is not None and decodes \
                    else self._full_layers
                attention += layers * self._decodes_attention(0, decodes)
            if self._sliding_layers:
                attention += self._sliding_layers * self._decodes_attention(w, [min(c, w) for c in decodes])
            if self._chunked_layers:
                chunk = self.model.attention_chunk_size
                attention += self._chunked_layers * self._decodes_attention(0, [(c - 1) % chunk + 1 for c in decodes])
            parts["attention"] = attention
            return parts
        # Full-attention GQA: the decodes as one batch at their mean KV length (the generation
        # table's batch x KV length grid, as the dense operator model prices them), each prefill
        # chunk on its own.
        parts = super().parts(agg, [], dense)
        if np.ndim(agg.num_decodes) == 0 and np.ndim(agg.decode_sum_context) == 0:  # one step: scalar lookups
            n0 = int(agg.num_decodes)
            attention = 0.0
            if n0:
                t0, scaled0 = self._attention[0, "generation"].at(n0, max(agg.decode_sum_context / n0, 1.0))
                self._count_flags(scaled0)
                attention = self.model.num_attention_layers * t0
            parts["attention"] = attention + self._chunks_attention(chunks)
            return parts
        n = np.asarray(agg.num_decodes, dtype=np.float64)
        mean = np.asarray(agg.decode_sum_context, dtype=np.float64) / np.maximum(n, 1.0)
        t, scaled = self._attention[0, "generation"].many(np.maximum(n, 1.0), np.maximum(mean, 1.0))
        self._count("attention", scaled & (n > 0))
        decodes = self.model.num_attention_layers * np.where(n > 0, t, 0.0)
        others = self._chunks_attention(chunks)
        attention = decodes + others
        parts["attention"] = float(attention) if np.ndim(attention) == 0 else attention
        return parts

    # ---- the fast paths: exactly `parts` and `total`'s values, with less done per step

    def _base_parts(self, num_tokens: int, num_logits: int) -> tuple[dict, float]:
        """`parts` of a step of these counts with its attention left to fill (the roofline's parts
        from `dense`, in their order), and the sum of all of them but attention in `total`'s order."""
        parts = MoERooflineCostModel.parts(self, NO_STEP, [], self._dense(num_tokens, num_logits))
        rest = 0.0
        for key, value in parts.items():
            if key != "attention":
                rest = rest + value
        return parts, rest

    def execute(self, batch: Batch) -> StepResult:
        """`CostModel.execute`'s result (`batch_aggregates`, `parts`, `total`, every part a float)
        from the batch's lists: the parts that depend on its token and logits counts alone are kept
        by those counts, the decodes' sums taken with list methods where the step has at most one
        prefill chunk (most steps), and a lone first chunk's attention kept by its length."""
        if not self._fast:
            return super().execute(batch)
        q, computed = batch.num_scheduled_tokens, batch.num_computed_tokens
        num_tokens, num_logits = sum(q), sum(batch.needs_logits)
        key = (num_tokens, num_logits)
        base = self._step_parts.get(key)
        if base is None:
            parts, rest = self._base_parts(num_tokens, num_logits)
            base = self._step_parts[key] = ({k: float(v) for k, v in parts.items()}, rest)
        num_requests, num_decodes = len(q), q.count(1)
        others = 0  # the chunks' attention, as `parts` takes it (`_chunks_attention`: MLA's as one batch)
        if num_decodes == num_requests:
            decode_sum = sum(computed) + num_decodes  # the decodes' contexts after the step
        elif num_requests - num_decodes == 1 and (chunk := num_tokens - num_decodes) > 1:
            before = computed[q.index(chunk)]
            decode_sum = sum(computed) - before + num_decodes
            others = self._first_chunk_seconds(chunk) if before == 0 else self.request_seconds(chunk, before + chunk)
        else:  # batch_aggregates' chunks: every request that is not a decode (q = 0 too), in order
            decode_sum = 0
            chunks = []
            for qi, ci in zip(q, computed):
                if qi == 1:
                    decode_sum += ci + 1
                else:
                    chunks.append((qi, ci + qi))
            others = self._chunks_attention(chunks)
        attention = 0.0
        if num_decodes:
            t, scaled = self._attention[0, "generation"].at(num_decodes, max(decode_sum / num_decodes, 1.0))
            if scaled:
                self._count_flags(scaled)
            attention = self.model.num_attention_layers * t
        attention = attention + others
        parts = dict(base[0])
        parts["attention"] = float(attention)
        return StepResult(float(base[1] + attention), parts)

    def _first_chunk_seconds(self, chunk: int) -> float:
        """`request_seconds(chunk, chunk)`: a prompt's first chunk with nothing computed before it,
        kept by its length unless a lookup was off the grid (those are counted at every step)."""
        seconds = self._first_chunks.get(chunk)
        if seconds is None:
            before = self.extrapolated.get("attention", 0)
            seconds = self.request_seconds(chunk, chunk)
            if self.extrapolated.get("attention", 0) == before:
                if len(self._first_chunks) >= MAX_FIRST_CHUNKS:
                    self._first_chunks.clear()
                self._first_chunks[chunk] = seconds
        return seconds

    def decode_run(self, context_lens, num_steps: int, active_steps=None) -> tuple[np.ndarray, dict]:
        """`CostModel.decode_run`'s result. Each step's values depend on the number of requests n
        and the sum s of their contexts alone, and while the same requests decode s = r + n q with
        r = s mod n fixed and q one more each step: so a run's attention and seconds are read from
        stretches of RUN_CHUNK consecutive q, each computed once with the array lookups `parts`
        makes (the same operations on the same numbers) and kept by (n, r, stretch). A run whose
        requests leave part way (synchronous scheduling) is read stretch by stretch of the steps
        with the same requests (asynchronously every run ends at the first finish: one stretch)."""
        if self._fast and num_steps > 0:
            contexts = context_lens if isinstance(context_lens, list) else [int(c) for c in context_lens]
            n = len(contexts)
            first_sum = sum(contexts)
            if n and first_sum + n * num_steps < 1 << 52:  # sums exact as float64
                if active_steps is None or min(active_steps) >= num_steps:
                    return self._decode_run_of(n, first_sum, num_steps)
                pieces = run_pieces(contexts, num_steps, active_steps)
                if pieces is not None:
                    return self._decode_pieces(pieces, num_steps)
        return super().decode_run(context_lens, num_steps, active_steps)

    def _decode_run_of(self, n: int, first_sum: int, num_steps: int) -> tuple[np.ndarray, dict]:
        base = self._run_base(n)
        attention: list[np.ndarray] = []
        seconds: list[np.ndarray] = []
        self._run_values(n, first_sum, 0, num_steps, base[1], attention, seconds)
        parts = dict(base[0])
        parts["attention"] = attention[0] if len(attention) == 1 else np.concatenate(attention)
        return (seconds[0] if len(seconds) == 1 else np.concatenate(seconds)), parts

    def _decode_pieces(self, pieces: list[tuple[int, int, int, int]], num_steps: int) -> tuple[np.ndarray, dict]:
        """A run's steps in pieces (start, end, requests n, their contexts' sum at step 0, so
        r + n q at step j with q counted from the run's first step): the dense parts as arrays
        filled piece by piece and the parts in their order, as `CostModel.decode_run` makes them."""
        dense = tuple(np.empty(num_steps) for _ in self._dense(1, 1))
        attention: list[np.ndarray] = []
        seconds: list[np.ndarray] = []
        for start, end, n, first_sum in pieces:
            for column, value in zip(dense, self._dense(n, n)):
                column[start:end] = value
            self._run_values(n, first_sum, start, end, self._run_base(n)[1], attention, seconds)
        parts = MoERooflineCostModel.parts(self, NO_STEP, [], dense)
        parts["attention"] = np.concatenate(attention)
        return np.concatenate(seconds), parts

    def _run_base(self, n: int) -> tuple[dict, float]:
        base = self._run_parts.get(n)
        if base is None:
            base = self._run_parts[n] = self._base_parts(n, n)
        return base

    def _run_values(self, n: int, first_sum: int, start: int, end: int, rest: float, attention: list,
                    seconds: list) -> None:
        """Appends the attention and seconds (read-only arrays) of steps start..end-1 of n requests
        whose contexts after step j sum to first_sum + n j, from the kept stretches."""
        r = first_sum % n
        q = (first_sum - r) // n + start
        q_end = q + end - start
        chunks = self._run_chunks
        while q < q_end:
            c = q // RUN_CHUNK
            chunk = chunks.get((n, r, c))
            if chunk is None:
                chunk = self._run_chunk(n, r, c, rest)
            lo, hi = q - c * RUN_CHUNK, min(q_end - c * RUN_CHUNK, RUN_CHUNK)
            attention.append(chunk[0][lo:hi])
            seconds.append(chunk[1][lo:hi])
            if chunk[2] is not None:
                self._count("attention", chunk[2][lo:hi])
            q = (c + 1) * RUN_CHUNK

    def _run_chunk(self, n: int, r: int, c: int, rest: float) -> tuple:
        """(attention, seconds, off-grid mask or None) of the decode-only steps of n requests whose
        contexts after the step sum to r + n q, for q in stretch c: `parts`' array path (mean
        context, the generation grid, layers x) and `total`'s sum (the other parts' sum, then
        attention)."""
        if len(self._run_chunks) >= MAX_RUN_CHUNKS:
            self._run_chunks = {}
        q = np.arange(c * RUN_CHUNK, (c + 1) * RUN_CHUNK, dtype=np.float64)
        mean = (r + n * q) / n  # parts' decode_sum_context / n (sums below 2**52 are exact)
        t, scaled = self._attention[0, "generation"].along_b(float(n), np.maximum(mean, 1.0))
        attention = self.model.num_attention_layers * t
        seconds = rest + attention
        attention.flags.writeable = seconds.flags.writeable = False
        chunk = self._run_chunks[n, r, c] = (attention, seconds, scaled if scaled.any() else None)
        return chunk

    def cost_model_summary(self) -> dict:
        """summary.json's `cost_model`: the table or roofline that priced each operator, and what was scaled."""
        out = {"kind": "operator tables (MoE)", "system": self.system, "operators": dict(self.sources)}
        for op in ("router", "kv_write", "elementwise", "lm_head", "overhead"):
            if op != "router" or self.model.num_experts:  # (a dense model, Gemma or DeciLM, routes nothing)
                out["operators"].setdefault(op, "roofline")
        if self.extrapolated:
            out["scaled_past_grid"] = dict(self.extrapolated)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def run_pieces(contexts: list[int], num_steps: int, active_steps) -> list[tuple[int, int, int, int]] | None:
    """The steps of a decode run whose request i decodes in its first active_steps[i] steps only,
    in pieces of the same requests: (start, end, their number, their contexts' sum at step 0), as
    `run_aggregates` (backends/costmodel/frame.py) counts them; None where steps are left with no
    request."""
    leaving = sorted((a, c) for a, c in zip(active_steps, contexts) if a < num_steps)
    running, total = len(contexts), sum(contexts)
    pieces = []
    step = 0
    for active, context in leaving:  # in the order they leave
        if active > step:
            pieces.append((step, active, running, total))
            step = active
        running -= 1
        total -= context
    if step < num_steps:
        if not running:
            return None
        pieces.append((step, num_steps, running, total))
    return pieces


def max_tokens_per_s(cost_model, max_tokens: int) -> float:
    """The most tokens per second a step of at most `max_tokens` tokens allows with its linear
    layers, router, MoE layers and all-reduces alone (attention and the rest come on top), for the
    MoE roofline or table model (`dense`): `sim validate`'s physical check, as
    OperatorModel.max_gemm_tokens_per_s is the dense model's."""
    sizes = sorted({2 ** i for i in range(max(int(max_tokens), 1).bit_length())} | {max(int(max_tokens), 1)})
    best = 0.0
    for t in sizes:
        linear, router, moe, _, _, _, allreduce = cost_model.dense(t, 0)
        best = max(best, t / float(linear + router + moe + allreduce))
    return best


def moe_table_model(model, hardware, system: str, data_dir: Path, tp: int = 1, dtype: str = "bf16",
                    kv_cache_dtype: str = "auto", enable_expert_parallel: bool = False, dp: int = 1,
                    distribution: str = "auto", vllm_version: str | None = None,
                    cache: Path | None = None, moe_kernel: str = "auto") -> MoETableCostModel:
    """The table-priced model of `system`'s vLLM tables (each at `vllm_version` or the nearest;
    None: the newest) in the package's layout under `data_dir`. With `cache` (a folder), what the
    tables give this deployment is kept there (`derived_cache_path`) and read back by later runs,
    which then read no table."""
    from backends.costmodel.optables.mla import read_mla_tables
    from backends.costmodel.optables.systems import read_layout_tables
    from backends.costmodel.optables.tables import load_layout

    args = dict(tp=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype, enable_expert_parallel=enable_expert_parallel, dp=dp,
                distribution=distribution)
    if moe_kernel != "auto":  # (the cache files of vLLM's default kernel keep their names)
        args["moe_kernel"] = moe_kernel
    path = None
    if cache is not None:
        path = derived_cache_path(cache, model, system, data_dir, vllm_version, **args)
        derived = read_derived(path)
        if derived is not None:
            # A file that is not curves this code wrote (damaged, edited: a key gone, a value of another
            # kind) is derived afresh below and rewritten, as one that is not JSON is.
            try:
                restored = MoETableCostModel(model, hardware, None, **args, derived=derived)
            except (ServesimError, KeyError, TypeError, ValueError, IndexError, AttributeError):
                restored = None
            if restored is not None and restored.derived() == derived:
                return restored
    tables = load_layout(data_dir, system, "vllm", vllm_version)
    moe_table = read_layout_tables(data_dir, system, "moe", "vllm", "moe_perf", vllm_version) \
        if model.num_experts else None
    mla_tables = read_mla_tables(data_dir, system, vllm_version, sparse=bool(model.index_topk)) if model.kv_lora_rank \
        else None
    priced = MoETableCostModel(model, hardware, tables, **args, moe_table=moe_table, mla_tables=mla_tables)
    derived = None if path is None else priced.derived()
    if derived is not None:
        write_derived(path, derived)
    return priced


# ---- the derived curves' cache

DERIVED_FORMAT = 3  # 2: the distribution as priced and the MLA module's grids (or why none) are kept; 3: the small kernels
DERIVING_MODULES = ("moe", "mla", "derive", "interp", "tables", "systems")  # backends/costmodel/optables/: what derives
PRESETS = Path(__file__).parents[2] / "presets.py"  # mla.measured_shape's fallback for a checkpoint's MLA shape
TENSOR_PARALLEL = Path(__file__).parents[1] / "tensor_parallel.py"  # derive's ring all-reduce where no table measures it


@lru_cache(maxsize=1)
def deriving_code_digest() -> str:
    """A digest of the source of the modules that derive a model from the tables: a cache file
    written by other code is never read."""
    digest = hashlib.sha256()
    for name in DERIVING_MODULES:
        digest.update((Path(__file__).parent / f"{name}.py").read_bytes())
    digest.update(PRESETS.read_bytes())
    digest.update(TENSOR_PARALLEL.read_bytes())
    return digest.hexdigest()


def _file_stats(folder: Path, relative_to: Path) -> list[tuple[str, int, int]]:
    """(path relative to `relative_to`, size, modification time) of every file under `folder`."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            stat = os.stat(os.path.join(root, name))
            out.append((os.path.relpath(os.path.join(root, name), relative_to), stat.st_size, stat.st_mtime_ns))
    return out


def derived_cache_path(cache: Path, model, system: str, data_dir: Path, vllm_version: str | None, **args) -> Path:
    """The cache file of one deployment: named by a digest of everything its derivation reads (the
    model's every field, the system, the tables' folder, package version and files (the system's,
    its MLA module tables among them, the reuse manifest and, for an MLA model, the checkpoints'
    config.json files that give the shapes the MLA tables measured: names, sizes and times), the
    vLLM version asked for, TP, DP, EP, dtypes, the token distribution as asked and as resolved
    (`auto`: the family's, `family_distribution`)) and of the deriving code."""
    from backends.costmodel.optables.systems import MANIFEST, package_version

    data_dir = Path(data_dir).resolve()
    files = _file_stats(data_dir / system, data_dir)
    manifest = data_dir.parent / MANIFEST
    if manifest.is_file():
        files.append((MANIFEST, manifest.stat().st_size, manifest.stat().st_mtime_ns))
    if model.kv_lora_rank:  # mla.measured_shape reads model_configs/ beside systems/
        files += _file_stats(data_dir.parent.parent / "model_configs", data_dir.parent.parent)
    distribution = args.get("distribution", "auto")
    key = {"format": DERIVED_FORMAT, "code": deriving_code_digest(), "package": package_version(),
           "data_dir": str(data_dir), "files": sorted(files), "system": system, "vllm_version": vllm_version,
           "model": dataclasses.asdict(model), "args": args,
           "distribution": family_distribution(model) if distribution == "auto" else distribution}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:20]
    return Path(cache) / "moe" / f"{cache_name(model.name)}-{digest}.json"


CACHE_NAME_CHARS = 100  # a model's name in a cache file's name, at most (a file name holds 255 bytes)


def cache_name(name: str) -> str:
    """A model's name as it goes into a cache file's name: slashes made underscores, and a name longer
    than CACHE_NAME_CHARS (a config.json in a folder of a long name) cut, with a digest of the whole
    name so that two long names still name two files. A name of 250 characters made a file name the
    file system refuses: the MoE cache was never written, and the dense one's write was an internal error."""
    name = name.replace("/", "_")
    if len(name.encode()) <= CACHE_NAME_CHARS:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return name.encode()[:CACHE_NAME_CHARS - 13].decode(errors="ignore") + "-" + digest


def read_derived(path: Path) -> dict | None:
    """A cache file's derived curves, or None where there is none (or it cannot be read: derive afresh)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data.get("derived") if isinstance(data, dict) and data.get("format") == DERIVED_FORMAT else None


def write_derived(path: Path, derived: dict) -> None:
    """Write a cache file under a temporary name, then rename it (a run reading it at once sees it
    whole or not at all); a cache that cannot be written is left out (the run goes on)."""
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
            temp = f.name
            json.dump({"format": DERIVED_FORMAT, "derived": derived}, f)
        os.replace(temp, path)
    except OSError:
        if temp is not None:
            Path(temp).unlink(missing_ok=True)
