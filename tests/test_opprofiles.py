"""Operator-table profiles in runs (the committed default, --profile roofline, mismatches,
`sim calibrate --from-ops`) and, on the shared H100 tables when present, that the derived curves
are the tables' own rows: TP 1, TP 2's halved shapes and all-reduces, fp8."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backends.costmodel.optables.backend import OpTableBackend
from backends.costmodel.optables.derive import derive, gemm_shapes
from backends.costmodel.optables.model import OperatorModel, StepOverhead
from backends.costmodel.optables.profile import load_op_profile, model_shape
from backends.costmodel.optables.tables import load_tables
from sim.app.cli import main
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.errors import ServesimError
from tests.helpers import shared_dir
from tests.optables_fixture import TINY, table_set, write_tables

SHARED = shared_dir() / "gpu-data" / "aiconfigurator"
needs_tables = pytest.mark.skipif(not (SHARED / "h100_sxm__vllm-0.24.0__gemm_perf.parquet").exists(),
                                  reason="needs ../shared/gpu-data")


def test_the_committed_profile_of_a_deployment_is_its_default_and_roofline_forces_the_datasheet():
    plan = resolve(ReplayOptions())  # Llama-3.1-8B on an H100, TP 1, bf16
    assert isinstance(plan.backend.inner, OpTableBackend)  # with the host's seconds (backends/host_time.py)
    assert Path(plan.options.profile).name == "H100-SXM__Llama-3.1-8B__tp1__bf16__kv-bf16.json"
    assert plan.as_dict()["profile"] == plan.options.profile  # what summary.json records
    assert not isinstance(resolve(ReplayOptions(profile="roofline")).backend, OpTableBackend)
    fp8 = resolve(ReplayOptions(model="Llama-3.1-70B", hardware="H200", tp=4, dtype="fp8"))
    assert Path(fp8.options.profile).name == "H200__Llama-3.1-70B__tp4__fp8__kv-bf16.json"
    assert not isinstance(resolve(ReplayOptions(hardware="A100-80GB")).backend, OpTableBackend)  # no tables
    # An fp8 KV cache has committed profiles of its own (the tables measure fp8 attention kernels).
    kv8 = resolve(ReplayOptions(model="Llama-3.1-70B", hardware="H200", tp=4, dtype="fp8", kv_cache_dtype="fp8"))
    assert Path(kv8.options.profile).name == "H200__Llama-3.1-70B__tp4__fp8__kv-fp8.json"
    assert kv8.backend.ops.kv_cache_dtype == "fp8"


def test_a_profile_of_another_deployment_is_refused():
    path = resolve(ReplayOptions()).options.profile
    with pytest.raises(ServesimError, match=r"was derived for tp 1, not 2; derive one with `sim calibrate "
                                            r"--from-ops \.\.\. --tp 2`"):
        resolve(ReplayOptions(profile=path, tp=2))
    with pytest.raises(ServesimError, match="whose shapes differ from Mistral-7B's"):
        resolve(ReplayOptions(profile=path, model="Mistral-7B"))
    with pytest.raises(ServesimError, match="a fitted profile was measured on one device"):
        resolve(ReplayOptions(model="tiny", profile="profiles/tiny-cpu.json", dtype="fp8"))


COMMITTED_8B = Path(__file__).parents[1] / "profiles" / "ops" / "H100-SXM__Llama-3.1-8B__tp1__bf16__kv-bf16.json"
COMMITTED_70B_TP4 = COMMITTED_8B.with_name("H100-SXM__Llama-3.1-70B__tp4__bf16__kv-bf16.json")


def _edit(data: dict, path: tuple, value) -> dict:
    inner = data
    for key in path[:-1]:
        inner = inner[key]
    if value is DELETE:
        del inner[path[-1]]
    else:
        inner[path[-1]] = value
    return data


DELETE = object()


@pytest.mark.parametrize("source,path,value,message", [
    (COMMITTED_8B, ("model_config", "hidden_size"), 1e999, "model_config.hidden_size = inf, expected a whole number"),
    (COMMITTED_8B, ("model_config", "num_key_value_heads"), 0, "model_config.num_key_value_heads = 0"),
    (COMMITTED_8B, ("tp",), 0, "tp = 0, expected a whole number at least 1"),
    (COMMITTED_8B, ("operators", "gemm"), None, "operators.gemm = None, expected an object"),
    (COMMITTED_8B, ("operators", "gemm", "o"), DELETE, "operators.gemm.o = None, expected the GEMM's curve"),
    (COMMITTED_8B, ("operators", "gemm", "qkv", "m"), [], "operators.gemm.qkv.m = [], expected a list of sizes"),
    (COMMITTED_8B, ("operators", "gemm", "qkv", "m"), [2, 1], "operators.gemm.qkv.m = [2, 1], expected sizes in "
                                                              "increasing order"),
    (COMMITTED_8B, ("operators", "gemm", "qkv", "seconds"), [1e-5, 2e-5], "operators.gemm.qkv.seconds = [1e-05, "
                                                                          "2e-05], expected a list of"),
    (COMMITTED_8B, ("operators", "gemm", "down", "seconds", 3), -1.0, "operators.gemm.down.seconds[3] = -1.0"),
    (COMMITTED_8B, ("operators", "gemm", "lm_head", "n"), float("nan"), "operators.gemm.lm_head.n = nan"),
    (COMMITTED_8B, ("operators", "attention", "context", "batch"), [], "operators.attention.context.batch = []"),
    (COMMITTED_8B, ("operators", "attention", "generation", "seconds"), [],
     "operators.attention.generation.seconds = [], expected 12 rows"),
    (COMMITTED_8B, ("operators", "memory", "bandwidth_bytes_per_s"), -1, "operators.memory.bandwidth_bytes_per_s = -1"),
    (COMMITTED_8B, ("operators", "memory", "kernel_floor_s"), "x", "operators.memory.kernel_floor_s = 'x'"),
    (COMMITTED_8B, ("client_overhead", "fixed_s"), 1e999, "client_overhead.fixed_s = inf"),
    (COMMITTED_70B_TP4, ("operators", "allreduce"), [], "operators.allreduce = [], expected an object"),
    (COMMITTED_70B_TP4, ("operators", "allreduce", "graph", "seconds"), [1.0],
     "operators.allreduce.graph.seconds = [1.0], expected a list of 23 times"),
    (COMMITTED_70B_TP4, ("operators", "allreduce", "link_bytes_per_s"), 0, "operators.allreduce.link_bytes_per_s = 0"),
    # Numbers that passed as finite but priced a step to infinity (an internal error, ValueError: 'list' argument
    # must have no negative elements), or a whole number too large for numpy's arrays (TypeError in a lookup).
    (COMMITTED_8B, ("operators", "gemm", "o", "seconds", 0), 1e308, "operators.gemm.o.seconds[0] = 1e+308, expected "
                                                                    "a finite number above 0 and at most 1000"),
    (COMMITTED_8B, ("operators", "gemm", "o", "seconds", 0), 2**70, "operators.gemm.o.seconds[0] = "
                                                                    "1180591620717411303424, expected a finite number"),
    (COMMITTED_8B, ("operators", "memory", "kernel_floor_s"), 1e306, "operators.memory.kernel_floor_s = 1e+306"),
    (COMMITTED_8B, ("operators", "memory", "bandwidth_bytes_per_s"), 1e-300,
     "operators.memory.bandwidth_bytes_per_s = 1e-300, expected a finite number at least 1"),
    (COMMITTED_70B_TP4, ("operators", "allreduce", "link_bytes_per_s"), 1e-300,
     "operators.allreduce.link_bytes_per_s = 1e-300"),
])
def test_an_operator_profile_of_bad_numbers_is_refused_naming_the_field(tmp_path, source, path, value, message):
    """A profile's derived curves were taken as they were: an edited or damaged file was an internal error
    (OverflowError, ZeroDivisionError, IndexError, KeyError, AttributeError), or priced its steps from
    negative seconds. Every committed profile is still read."""
    data = _edit(json.loads(source.read_text()), path, value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ServesimError) as e:
        load_op_profile(bad)
    assert str(e.value).startswith(f"{bad}: ") and message in str(e.value), str(e.value)
    for committed in sorted(COMMITTED_8B.parent.glob("*.json")):
        load_op_profile(committed)


def test_calibrate_from_ops_writes_what_the_tables_give(tmp_path):
    write_tables(tmp_path, system="tiny_gpu")
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
                                  "rope_theta": 10000.0, "rms_norm_eps": 1e-5}))
    out = tmp_path / "p.json"
    assert main(["calibrate", "--from-ops", str(tmp_path), "--system", "tiny_gpu", "--model", str(config),
                 "--hardware", "H100-SXM", "--tp", "2", "--out", str(out), "--quiet"]) == 0
    profile = load_op_profile(out)
    assert (profile.tp, profile.dtype, profile.hardware, profile.source["system"]) == (2, "bf16", "H100-SXM", "tiny_gpu")
    assert profile.model_config == model_shape(TINY)
    direct = OperatorModel(derive(table_set(), TINY, 2, nvlink_bytes_per_s=450e9), TINY, 2, "bf16", "bf16",
                           StepOverhead(0.0, "none"))
    q, c = np.array([[1, 1, 30]]), np.array([[40, 9, 30]])
    assert OpTableBackend(profile.op_model()).step_seconds(q, c, np.array([3]))[0] == \
        OpTableBackend(direct).step_seconds(q, c, np.array([3]))[0]
    assert main(["calibrate", "--from-ops", str(tmp_path), "--model", str(config), "--out", str(out)]) == 2
    # An fp8 checkpoint's profile is derived in fp8 (the tables' fp8 rows), as vLLM serves it.
    quantized = tmp_path / "tiny-fp8.json"
    quantized.write_text(json.dumps({**json.loads(config.read_text()),
                                     "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert main(["calibrate", "--from-ops", str(tmp_path), "--system", "tiny_gpu", "--model", str(quantized),
                 "--hardware", "H100-SXM", "--out", str(out), "--quiet", "--overwrite"]) == 0
    assert load_op_profile(out).dtype == "fp8"


@pytest.fixture(scope="module")
def h100():
    return load_tables(SHARED, "h100_sxm")


def table_curve(tables, dtype, n, k):
    g = tables.gemm
    rows = g[(g["gemm_dtype"] == dtype) & (g["n"] == n) & (g["k"] == k)].sort_values("m")
    return rows["m"].tolist(), (rows["latency"] * 1e-3).tolist()


@needs_tables
def test_tp1_profile_reproduces_the_tables_gemm_times(h100):
    from backends.presets import MODELS

    model = MODELS["Llama-3.1-8B"]
    d = derive(h100, model)
    for op in ("qkv", "o"):  # on the grid: (6144, 4096) and (4096, 4096)
        n, k = gemm_shapes(model, 1)[op]
        assert (d["gemm"][op]["m"], d["gemm"][op]["seconds"]) == table_curve(h100, "bfloat16", n, k)
    ops = OperatorModel(d, model, 1, "bf16", "bf16", StepOverhead(0.0, "none"))
    i = d["gemm"]["qkv"]["m"].index(64)  # a grid m: a layer's GEMMs are the four curves' own values
    assert ops.gemms(np.array([64.0]))[0] == sum(d["gemm"][op]["seconds"][i] for op in ("qkv", "o", "gate_up", "down"))


@needs_tables
def test_tp2_looks_up_halved_shapes_and_adds_the_tables_all_reduces(h100):
    from backends.presets import MODELS

    model = MODELS["Llama-3.1-8B"]
    shapes = gemm_shapes(model, 2)
    assert {op: shapes[op] for op in ("qkv", "o", "gate_up", "down")} == \
        {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)}
    d = derive(h100, model, tp=2, nvlink_bytes_per_s=450e9)
    for op in ("qkv", "o", "down"):  # these three are on the grid
        assert (d["gemm"][op]["m"], d["gemm"][op]["seconds"]) == table_curve(h100, "bfloat16", *shapes[op])
    ops = OperatorModel(d, model, 2, "bf16", "bf16", StepOverhead(0.0, "none"))
    a = h100.custom_allreduce
    graph = a[(a["num_gpus"] == 2) & (a["kernel_source"] == "vLLM_custom_graph") & (a["message_size"] == 8 * 4096)]
    eager = a[(a["num_gpus"] == 2) & (a["kernel_source"] == "vLLM_custom_eager") & (a["message_size"] == 4 * 2**20)]
    parts = ops.decode_steps(np.array([8]), np.array([8 * 1000]))
    # 2 x 32 + 1 all-reduces of 8 tokens x 4096 bf16 elements (the table's message_size counts elements), and
    # the logits' all-gather (8 x 128256 rows of bf16, priced as an all-reduce of half of it: 4,104,192 bytes).
    gather = ops.allreduce(np.array([8 * 128256 * 2 / 2]), np.array([False]))[0]
    assert parts["allreduce"][0] == pytest.approx(65 * graph["latency"].iloc[0] * 1e-3 + gather, rel=1e-12)
    assert gather < eager["latency"].iloc[0] * 1e-3


@needs_tables
def test_fp8_uses_the_fp8_gemm_rows(h100):
    from backends.presets import MODELS

    model = MODELS["Llama-3.1-8B"]
    d = derive(h100, model, dtype="fp8")
    assert (d["gemm"]["qkv"]["m"], d["gemm"]["qkv"]["seconds"]) == table_curve(h100, "fp8", 6144, 4096)
    assert d["gemm"]["qkv"]["kernel"] == "CutlassFP8ScaledMMLinearKernel"
    assert d["gemm"]["lm_head"]["dtype"] == "bf16"
