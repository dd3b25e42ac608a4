"""The roofline's tensor-parallel and fp8 terms."""

import numpy as np
import pytest

from backends.costmodel.tensor_parallel import (
    layer_gemms_seconds,
    ring_allreduce_seconds,
    tp_allreduce_seconds,
)
from backends.hardware import HARDWARE
from backends.model_config import ModelConfig

LLAMA = ModelConfig.from_preset("Llama-3.1-8B")
H100 = HARDWARE["H100-SXM"]


def gemms(tokens, tp=1, dtype="bf16"):
    return layer_gemms_seconds(LLAMA, tokens, tp, dtype, H100, gemm_efficiency=0.7, memory_efficiency=0.85)


def test_tp2_halves_compute_bound_gemms_exactly_and_weight_reads_nearly():
    assert gemms(8192, tp=2) == gemms(8192) / 2  # every GEMM's FLOPs halve
    weights = 32 * sum(g.k * g.n for g in LLAMA.gemms(1)) * 2
    activations = 32 * sum(g.k + g.n for g in LLAMA.gemms(1)) * 2
    assert gemms(1) == pytest.approx((weights + activations) / (3.35e12 * 0.85), rel=1e-12)  # a decode reads weights
    assert gemms(1, tp=2) == pytest.approx(gemms(1) / 2, rel=0.01)


def test_fp8_halves_the_weight_reads_and_doubles_the_peak():
    assert gemms(1, dtype="fp8") == pytest.approx(gemms(1) / 2, rel=0.01)
    assert gemms(8192, dtype="fp8") == pytest.approx(gemms(8192) * 989.4 / 1978.9, rel=1e-12)
    a100 = HARDWARE["A100-80GB"]  # no fp8 tensor cores: weight-only fp8, bf16 FLOP/s
    big = layer_gemms_seconds(LLAMA, 8192, 1, "fp8", a100, 0.7, 0.85)
    assert big == layer_gemms_seconds(LLAMA, 8192, 1, "bf16", a100, 0.7, 0.85)


def test_two_ring_allreduces_per_layer():
    message = 256 * 4096 * 2  # 256 tokens of bf16 hidden states
    one = 2 * 1 / 2 * message / 450e9 + 5e-6
    assert ring_allreduce_seconds(message, 2, 450e9) == one
    assert tp_allreduce_seconds(LLAMA, 256, 2, H100) == 2 * 32 * one
    assert tp_allreduce_seconds(LLAMA, 256, 1, H100) == 0.0
    four = 2 * 3 / 4 * message / 450e9 + 5e-6
    steps = tp_allreduce_seconds(LLAMA, np.array([256, 1]), 4, H100)  # arrays of steps too
    assert steps[0] == 2 * 32 * four and steps[1] == 2 * 32 * (2 * 3 / 4 * 8192 / 450e9 + 5e-6)


def test_a_group_past_a_node_rings_over_the_network_between_nodes():
    """The presets are 8-GPU NVLink nodes whose GPUs each reach other nodes at 50 GB/s (ConnectX-7
    400 Gb/s): TP 16 rings over that, TP 8 over NVLink; the hardware says which link a group uses."""
    message = 256 * 4096 * 2
    assert H100.gpus_per_node == 8 and H100.inter_node_bandwidth == 50e9
    assert H100.group_link(8) == ("nvlink", 450e9) and H100.group_link(16) == ("inter-node", 50e9)
    assert not H100.spans_nodes(8) and H100.spans_nodes(9)
    sixteen = 2 * 15 / 16 * message / 50e9 + 5e-6
    assert tp_allreduce_seconds(LLAMA, 256, 16, H100) == 2 * 32 * sixteen
    eight = tp_allreduce_seconds(LLAMA, 256, 8, H100)
    assert eight == 2 * 32 * (2 * 7 / 8 * message / 450e9 + 5e-6) and eight < 2 * 32 * sixteen
    # A network faster than the link (an NVLink rack's trays) leaves the link as it is.
    import dataclasses
    rack = dataclasses.replace(H100, gpus_per_node=4, inter_node_bandwidth=900e9)
    assert rack.group_link(16) == ("nvlink", 450e9)
    # Not stated (a hardware file without the fields): one node, as before.
    assert dataclasses.replace(H100, gpus_per_node=None).group_link(64) == ("nvlink", 450e9)
    # A node size without the network between nodes: a group past it cannot be priced, and says so.
    from sim.errors import ServesimError
    with pytest.raises(ServesimError, match="16 GPUs in one group span nodes of 8 .* no inter_node_bandwidth"):
        dataclasses.replace(H100, inter_node_bandwidth=None).group_link(16)


def test_a_hardware_file_states_its_node(tmp_path):
    """gpus_per_node and inter_node_bandwidth in a hardware file (8.0 read as 8, as JSON may write
    it); summary.json's hardware entry carries them."""
    import json

    from backends.hardware import Hardware

    spec = {"peak_bf16_flops": 1e15, "peak_fp8_flops": 2e15, "memory_bandwidth": 3e12,
            "memory_bytes": 80_000_000_000, "nvlink_bandwidth": 450e9, "gpus_per_node": 8.0,
            "inter_node_bandwidth": 25e9}
    path = tmp_path / "node.json"
    path.write_text(json.dumps(spec))
    hw = Hardware.from_json(path)
    assert hw.gpus_per_node == 8 and isinstance(hw.gpus_per_node, int) and hw.group_link(16) == ("inter-node", 25e9)
    assert hw.as_dict()["gpus_per_node"] == 8 and hw.as_dict()["inter_node_bandwidth"] == 25e9
    path.write_text(json.dumps(dict(spec, gpus_per_node=2.5)))
    from sim.errors import ServesimError
    with pytest.raises(ServesimError, match="gpus_per_node must be a whole number"):
        Hardware.from_json(path)
