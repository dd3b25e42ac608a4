"""The roofline's terms for one GPU of a tensor-parallel engine, in weights of either precision.

A GEMM takes max(FLOPs / (peak x efficiency), bytes / effective bandwidth): its FLOPs at the peak
of its weights' dtype (fp8 weights use the fp8 tensor cores where the GPU has them) and its bytes
the weights (one byte each in fp8, two in bf16) plus the bf16 activations read and written.

Under tensor parallelism of degree T each GPU runs its shard of every GEMM (`ModelConfig.gemms`)
and two all-reduces per layer join the shards: after attention's O projection and after the
MLP's down projection (vLLM's RowParallelLinear, vllm/model_executor/layers/linear.py), each
over the step's [tokens, hidden] bf16 activations. Without measured tables an all-reduce is
priced as a ring over the GPUs' link (NVLink, or PCIe where the hardware states only that),
2 (T - 1) / T x bytes / bandwidth, plus a fixed latency; a group of more GPUs than a node holds
(`Hardware.gpus_per_node`) rings over the network between nodes where that is slower
(`Hardware.group_link`).
ALLREDUCE_LATENCY_S: vLLM's custom all-reduce inside CUDA graphs takes 4.2 - 4.9 microseconds
for messages up to 32 KiB on H100 SXM at TP 2 and 4 (AIConfigurator's measurements inside vLLM
0.24, ../shared/gpu-data/aiconfigurator/h100_sxm__vllm-0.24.0__custom_allreduce_perf.parquet), and
4.6 - 5.2 at TP 8: over NVLink's switch one kernel reaches every GPU at once, whatever their number.
Over PCIe a collective is a ring, and each of its steps waits on a hop (`collective_latency_s`):
NCCL's smallest all-reduces measure 6.0 - 6.2 us among 2 GPUs, 11.9 - 12.9 among 4 and 22.4 - 24.2
among 8 on L40S and RTX PRO 6000 Server, its all-gathers 5.3 - 5.9, 8.6 - 9.2 and 13.6 - 14.2
(aiconfigurator-core 0.12.0's tables: systems/data/{l40s,rtx_pro_6000_server}/comm/nccl/), which is
3.5 us plus 1.5 us a step: 2 (T - 1) steps an all-reduce (reduce-scatter, then all-gather), T - 1 an
all-gather or a reduce-scatter. vLLM runs NCCL there: its custom all-reduce needs NVLink beyond two
GPUs (vllm/distributed/device_communicators/custom_all_reduce.py, `CustomAllreduce.__init__`).

Every function takes ints or numpy arrays of token counts (one per step) alike.
"""

from __future__ import annotations

import numpy as np

from backends.hardware import Hardware
from backends.model_config import DTYPE_BYTES, Gemm, ModelConfig

ACTIVATION_BYTES = 2  # bf16 activations, whatever the weights' dtype
ALLREDUCE_LATENCY_S = 5e-6
PCIE_COLLECTIVE_LAUNCH_S = 3.5e-6
PCIE_RING_STEP_S = 1.5e-6


def collective_latency_s(link: str | None, num_gpus: int, ring_steps: int) -> float:
    """The fixed time of one collective among `num_gpus` GPUs whose nodes join them by `link` (the
    hardware's own, `Hardware.link`, across nodes too: a ring that also crosses the network between
    nodes has at least the hops of one inside a node): over PCIe its ring's `ring_steps` hops (2 (T - 1)
    for an all-reduce, T - 1 for an all-gather or a reduce-scatter) at `PCIE_RING_STEP_S` each beside a
    launch; over NVLink `ALLREDUCE_LATENCY_S` whatever the number of GPUs (a group past an NVLink node:
    not measured here, the same)."""
    if num_gpus <= 1:
        return 0.0
    if link == "pcie":
        return PCIE_COLLECTIVE_LAUNCH_S + ring_steps * PCIE_RING_STEP_S
    return ALLREDUCE_LATENCY_S


def allreduce_latency_s(link: str | None, num_gpus: int) -> float:
    """`collective_latency_s` of an all-reduce: a ring's 2 (T - 1) steps."""
    return collective_latency_s(link, num_gpus, 2 * (num_gpus - 1))


def runs_custom_allreduce(link: str | None, num_gpus: int, spans_nodes: bool) -> bool:
    """Whether vLLM runs its custom all-reduce for a group of `num_gpus` GPUs joined by `link`: within a
    node only, and over PCIe between two GPUs only ("not supported on more than two PCIe-only GPUs";
    vllm/distributed/device_communicators/custom_all_reduce.py, `CustomAllreduce.__init__`)."""
    return not spans_nodes and (link == "nvlink" or num_gpus == 2)


def ring_allreduce_over(message_bytes, tp: int, hardware: Hardware, efficiency: float = 1.0):
    """One all-reduce of `message_bytes` among `tp` GPUs of `hardware`, no table measuring it: a ring over
    their link (the network between nodes where the group crosses them and that is slower), its hops the
    node's link's (`allreduce_latency_s`)."""
    bandwidth = hardware.group_link(tp)[1]
    return ring_allreduce_seconds(message_bytes, tp, bandwidth * efficiency, allreduce_latency_s(hardware.link, tp))


def gemm_seconds(num_tokens, gemm: Gemm, dtype: str, flops_s: float, bytes_s: float):
    """One GEMM of `num_tokens` rows: `flops_s` is the achieved FLOP/s for the weights' dtype,
    `bytes_s` the achieved memory bandwidth."""
    t = num_tokens
    flops = 2.0 * t * gemm.k * gemm.n
    num_bytes = gemm.k * gemm.n * DTYPE_BYTES[dtype] + t * (gemm.k + gemm.n) * ACTIVATION_BYTES
    return np.maximum(flops / flops_s, num_bytes / bytes_s)


def layer_gemms_seconds(model: ModelConfig, num_tokens, tp: int, dtype: str, hardware: Hardware,
                        gemm_efficiency: float, memory_efficiency: float):
    """Every layer's QKV, O, gate-up and down GEMMs on one GPU, summed over the layers."""
    flops_s = hardware.peak_flops(dtype) * gemm_efficiency
    bytes_s = hardware.memory_bandwidth * memory_efficiency
    total = 0.0
    for gemm in model.gemms(tp):
        total = total + gemm_seconds(num_tokens, gemm, dtype, flops_s, bytes_s)
    return model.num_hidden_layers * total


def ring_allreduce_seconds(message_bytes, tp: int, bandwidth: float, latency_s: float = ALLREDUCE_LATENCY_S):
    """One all-reduce of `message_bytes` among `tp` GPUs as a ring: each GPU sends and receives
    2 (T - 1) / T of the message. Zero on one GPU."""
    if tp == 1:
        return 0.0 * message_bytes
    return 2.0 * (tp - 1) / tp * message_bytes / bandwidth + latency_s


def tp_allreduce_seconds(model: ModelConfig, num_tokens, tp: int, hardware: Hardware, efficiency: float = 1.0):
    """The step's all-reduces: two per layer, each of [tokens, hidden] bf16 activations (one per
    sublayer, `ModelConfig.num_sublayers`: a DeciLM layer's no-op attention or MLP has none)."""
    if tp == 1:
        return 0.0 * num_tokens
    hardware.check_tp(tp)
    message = num_tokens * model.hidden_size * ACTIVATION_BYTES
    return model.num_sublayers * ring_allreduce_over(message, tp, hardware, efficiency)
