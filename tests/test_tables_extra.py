"""The field's published tables: AIConfigurator's layout, versions, reuse.yaml, the import that refuses
only what a run reads, and PCIe links.

The first tests run anywhere, on a tiny fixture in the package's layout (tests/data/aic_layout:
synthetic closed-form times from tests/optables_fixture.py; vLLM 0.20.0 and 0.22.0, whose context
attention was measured with another kernel and whose generation attention reuses 0.20.0's by
reuse.yaml; an LM head measured to m = 256 only; a custom all-reduce for 2 GPUs; an NCCL table for
2 and 4). The last ones need the tables extra (aiconfigurator-core) and skip where it is absent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from backends.costmodel.optables.derive import derive
from backends.costmodel.optables.model import OperatorModel, StepOverhead
from backends.costmodel.optables.systems import choose_version
from backends.costmodel.optables.tables import load_tables
from sim.app.cli import main
from sim.errors import ServesimError
from tests.helpers import shared_dir
from tests.optables_fixture import TINY, ar_ms, gemm_ms, table_set

LAYOUT = Path(__file__).parent / "data" / "aic_layout"
TINY_1024 = dict(TINY, vocab_size=1024)  # its LM head, n = 1024, is the shape measured to m = 256
NVLINK, PCIE = 450e9, 32e9


@pytest.fixture(autouse=True)
def _yaml():
    pytest.importorskip("yaml")  # reuse.yaml (pyyaml comes with the tables extra)


def op_model(derived, model=TINY_1024, tp=1):
    return OperatorModel(derived, model, tp, "bf16", "bf16", StepOverhead(0.0, "none"))


def test_the_version_asked_else_the_nearest_else_the_newest():
    have = ["0.14.0", "0.19.0", "0.24.0"]
    assert choose_version(have, "0.19.0") == ("0.19.0", "as asked")
    assert choose_version(have, None) == ("0.24.0", "the newest")
    assert choose_version(have, "0.12.0")[0] == "0.14.0"
    assert choose_version(have, "0.22.0")[0] == "0.24.0"
    assert choose_version(have, "0.21.5")[0] == "0.19.0"  # minor 21 is 2 from 19 and 3 from 24
    assert choose_version(["0.20.0", "0.22.0"], "0.21.0")[0] == "0.22.0"  # a tie goes to the newer
    assert choose_version(have, "1.0.0")[0] == "0.24.0"
    assert "the nearest to 0.12.0" in choose_version(have, "0.12.0")[1]


def test_the_layout_reads_each_kind_at_its_version_and_follows_reuse_yaml():
    tables = load_tables(LAYOUT, "tiny_gpu", version="0.22.0")
    assert {k: v for k, (v, _) in tables.versions.items()} == {
        "gemm": "0.20.0", "context_attention": "0.22.0", "generation_attention": "0.22.0",
        "custom_allreduce": "0.20.0"}
    assert "the nearest to 0.22.0" in tables.versions["gemm"][1]
    # 0.22.0 has no generation table of its own: its reuse.yaml reads 0.20.0's.
    assert tables.files["generation_attention"].parent.name == "0.20.0"
    # ... and says so wherever the version is said (summary.json, a profile's source): it read "as asked"
    assert tables.versions["generation_attention"][1] == "as asked; its rows read from 0.20.0 by its reuse.yaml"
    assert tables.files["context_attention"].parent.name == "0.22.0" and tables.nccl is not None
    d = derive(tables, TINY_1024)
    # The attention kernel is the one the version measured: 0.22.0's context rows are FlashAttention 2.
    assert d["attention"]["context"]["kernel"] == "vllm_flash_attn_fa2"
    assert d["attention"]["generation"]["kernel"] == "vllm_flash_attn_fa3"
    assert d["attention"]["context"]["seconds"][0][0] == pytest.approx((0.01 + 16**2 * 1e-7) * 1.1e-3, rel=1e-12)
    old = derive(load_tables(LAYOUT, "tiny_gpu", version="0.20.0"), TINY_1024)
    assert old["attention"]["context"]["kernel"] == "vllm_flash_attn_fa3"
    assert load_tables(LAYOUT, "tiny_gpu").versions["context_attention"] == ("0.22.0", "the newest")


def test_each_gemm_is_interpolated_on_its_own_m_grid():
    d = derive(load_tables(LAYOUT, "tiny_gpu"), TINY_1024)
    assert d["gemm"]["lm_head"]["m"][-1] == 256 and d["gemm"]["qkv"]["m"][-1] == 1024
    assert d["gemm"]["lm_head"]["seconds"] == pytest.approx([gemm_ms(m, 1024, 128) * 1e-3 for m in
                                                             (1, 2, 4, 8, 16, 64, 256)], rel=1e-12)
    ops = op_model(d)
    assert ops.lm_head(256) == pytest.approx(gemm_ms(256, 1024, 128) * 1e-3, rel=1e-12)
    assert ops.lm_head(512) == pytest.approx(2 * gemm_ms(256, 1024, 128) * 1e-3, rel=1e-12)  # scaled with m
    assert ops.gemms(1024) == pytest.approx(sum(gemm_ms(1024, n, k) for n, k in
                                                ((256, 128), (128, 128), (512, 128), (128, 256))) * 1e-3, rel=1e-12)


def test_tp1_reads_no_all_reduce_table():
    tables = table_set()
    tables = type(tables)(**{**tables.__dict__, "custom_allreduce": None})
    d = derive(tables, TINY)
    assert d["allreduce"] is None and op_model(d, TINY).allreduce(np.array([1e6]), np.array([True]))[0] == 0.0
    # Under TP 2 the missing table is said, and NCCL's ring over the link prices the all-reduces.
    d2 = derive(tables, TINY, tp=2, nvlink_bytes_per_s=NVLINK)
    assert "graph" not in d2["allreduce"] and any("no custom all-reduce table" in n for n in d2["notes"])
    ops = op_model(d2, TINY, tp=2)
    assert ops.allreduce(np.array([1e6]), np.array([True]))[0] == pytest.approx(1e6 / NVLINK + 5e-6, rel=1e-12)


def test_pcie_two_gpus_use_the_custom_kernel_four_use_nccls_table():
    tables = load_tables(LAYOUT, "tiny_gpu")
    two = derive(tables, TINY, tp=2, pcie_bytes_per_s=PCIE)["allreduce"]
    assert two["link"] == "pcie" and "graph" in two and "nccl" in two and "nvlink_bytes_per_s" not in two
    # The tables count bf16 elements: message_size 128 is 256 bytes.
    assert two["graph"]["message_bytes"][0] == 256 and two["nccl"]["message_bytes"][0] == 512
    four_heads = dict(TINY, num_attention_heads=8, num_key_value_heads=4)
    notes: list = []
    four = derive(tables, four_heads, tp=4, pcie_bytes_per_s=PCIE)
    notes = four["notes"]
    assert "graph" not in four["allreduce"] and any("custom kernel is off on 4 PCIe GPUs" in n for n in notes)
    ops = OperatorModel(four, four_heads, 4, "bf16", "bf16", StepOverhead(0.0, "none"))
    # 2**16 elements (128 KiB) is on the NCCL table's grid: its time exactly, from the smallest message on.
    assert ops.allreduce(np.array([2.0**17]), np.array([True]))[0] == pytest.approx((0.04 + 2**16 * 2e-8) * 1e-3)
    # NVLink at 4 GPUs keeps the custom kernel (the fixture has rows for 2 only: NCCL's table then).
    nv = derive(tables, four_heads, tp=4, nvlink_bytes_per_s=NVLINK)["allreduce"]
    assert nv["link"] == "nvlink" and "nccl" in nv


def test_an_all_reduce_measured_in_one_mode_prices_both_with_it():
    """Intel's B60 has no CUDA graphs: its tables hold vLLM's eager custom all-reduce alone. Steps inside
    a graph are then priced with the eager kernel (said in the notes), not refused; a table with neither
    kernel for the GPU count is refused naming the kernels it has."""
    tables = table_set()
    ar = tables.custom_allreduce
    eager_only = type(tables)(**{**tables.__dict__, "custom_allreduce": ar[ar["kernel_source"] == "vLLM_custom_eager"]})
    d = derive(eager_only, TINY, tp=2, nvlink_bytes_per_s=NVLINK)
    assert d["allreduce"]["graph"]["kernel"] == "vLLM_custom_eager"
    assert any("no vLLM_custom_graph rows for 2 GPUs" in n and "priced with vLLM_custom_eager" in n for n in d["notes"])
    ops = op_model(d, TINY, tp=2)
    size = 2.0**20  # bytes: 2**19 bf16 elements, on the fixture's grid
    assert ops.allreduce(np.array([size]), np.array([True]))[0] == pytest.approx(ar_ms(2**19, graph=False) * 1e-3)
    other = type(tables)(**{**tables.__dict__, "custom_allreduce": ar.assign(kernel_source="some_other_kernel")})
    with pytest.raises(ServesimError, match=r"no vLLM_custom_graph or vLLM_custom_eager rows for 2 GPUs on tiny_gpu "
                                            r"\(vllm 0\.24\.0; kernels there: some_other_kernel\)"):
        derive(other, TINY, tp=2, nvlink_bytes_per_s=NVLINK)


def test_a_missing_table_or_rows_are_refused_by_name(tmp_path):
    copy = tmp_path / "aic"
    shutil.copytree(LAYOUT, copy)
    shutil.rmtree(copy / "systems" / "data" / "tiny_gpu" / "gemm")
    with pytest.raises(ServesimError, match=r"tiny_gpu has no gemm_perf table for vllm"):
        load_tables(copy, "tiny_gpu")
    with pytest.raises(ServesimError, match=r"no operator tables for system h100_sxm; systems there: tiny_gpu"):
        load_tables(LAYOUT, "h100_sxm")
    tables = table_set()
    bf16_only = type(tables)(**{**tables.__dict__, "generation_attention": tables.generation_attention[
        tables.generation_attention["kv_cache_dtype"] == "bfloat16"]})
    with pytest.raises(ServesimError, match=r"no generation attention rows for KV cache fp8, head_dim 32 on tiny_gpu "
                                            r"\(vllm 0\.24\.0\); \(kernel, KV dtype, head_dim\) there: "
                                            r"\[\('vllm_flash_attn_fa3', 'bfloat16', 32\)\]"):
        derive(bf16_only, TINY, kv_cache_dtype="fp8")
    with pytest.raises(ServesimError, match=r"no context attention rows of kernel vllm_flash_attn_fa3 for 8 heads, "
                                            r"2 KV heads, head_dim 32, KV cache bf16 on tiny_gpu \(vllm 0\.24\.0\)"):
        derive(tables, dict(TINY, num_attention_heads=8, num_key_value_heads=2))
    with pytest.raises(ServesimError, match="no nvfp4 GEMM rows for tiny_gpu"):
        from backends.costmodel.optables.derive import gemm_kernel

        gemm_kernel(tables, "fp4")


def test_calibrate_from_a_layout_folder_names_the_versions(tmp_path, capsys):
    models = tmp_path / "toy.json"
    models.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                                  "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096}))
    out = tmp_path / "p.json"
    assert main(["calibrate", "--from-ops", str(LAYOUT), "--system", "tiny_gpu", "--model", str(models),
                 "--out", str(out), "--quiet"]) == 0
    source = json.loads(out.read_text())["source"]
    assert source["table_versions"]["context_attention"] == "0.22.0" and source["framework_version"] == "0.20.0"


# -- with the tables extra -----------------------------------------------------------------------------

SAMPLE = Path(__file__).parents[1] / "traces" / "samples" / "azure_conv_2023_first5min.csv"


def replay(tmp_path, *args) -> dict:
    out = tmp_path / "run"
    assert main(["replay", str(SAMPLE), "--out", str(out), "--overwrite", "--quiet", "--limit", "200", *args]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.fixture
def package(tmp_path, monkeypatch):
    pytest.importorskip("aiconfigurator_core")
    monkeypatch.setenv("SERVESIM_CACHE", str(tmp_path / "cache"))


def test_tp2_on_a_pcie_system_from_its_tables(package, tmp_path):
    summary = replay(tmp_path, "--hardware", "l40s", "--tp", "2")
    tables = summary["options"]["operator_tables"]
    assert tables["system"] == "l40s" and tables["link"] == "pcie" and tables["link_bandwidth"] == 32e9
    assert tables["allreduce"] == "custom all-reduce table, NCCL table"
    assert summary["options"]["profile"].startswith(str(tmp_path / "cache"))
    # Cached: a second run reads the same profile file.
    cached = list((tmp_path / "cache").rglob("*.json"))
    assert len(cached) == 1 and replay(tmp_path, "--hardware", "l40s", "--tp", "2")["options"]["profile"] == \
        str(cached[0])


def test_a_pcie_system_without_tables_runs_tp2_as_a_ring_over_its_link(package, tmp_path):
    summary = replay(tmp_path, "--hardware", "h100_pcie", "--tp", "2")
    assert summary["hardware"]["pcie_bandwidth"] == 64e9 and summary["hardware"]["nvlink_bandwidth"] is None
    assert "operator_tables" not in summary["options"]  # no vLLM tables for it: the roofline
    assert summary["options"]["cost_model"].endswith(  # (said, as a tables-priced run says its own)
        "; all-reduce: a ring over pcie at 64 GB/s a direction plus 6.5 us (no measured all-reduce table)")


def test_tp_past_a_node_turns_the_custom_all_reduce_off_and_rings_over_the_network(package, tmp_path):
    """b200_sxm.yaml: 8 GPUs a node, 100 GB/s per GPU between nodes. TP 16 spans two nodes: vLLM's
    custom all-reduce is off (custom_all_reduce.py), the messages go to NCCL, here a ring whose
    bottleneck is the network; summary.json says the link. Before, NVLink priced 16 GPUs faster
    than 8."""
    from backends.hardware import resolve_hardware

    hw = resolve_hardware("b200_sxm")
    assert (hw.gpus_per_node, hw.inter_node_bandwidth) == (8, 100e9)
    args = ("--model", "Llama-3.1-70B", "--hardware", "b200_sxm")
    eight = replay(tmp_path, *args, "--tp", "8")
    sixteen = replay(tmp_path, *args, "--tp", "16")
    assert eight["options"]["operator_tables"]["link"] == "nvlink"
    tables = sixteen["options"]["operator_tables"]
    assert (tables["link"], tables["link_bandwidth"]) == ("inter-node", 100e9)
    assert tables["allreduce"].startswith("none custom")
    assert sixteen["ttft"]["mean"] > eight["ttft"]["mean"]
    profile = json.loads(Path(sixteen["options"]["profile"]).read_text())
    assert profile["operators"]["allreduce"]["link"] == "inter-node"
    assert any("span nodes of 8" in note for note in profile["operators"]["notes"])
    # No NCCL rows for 16 GPUs: the ring's fixed time is at least NCCL's smallest among 8 (not 5 us).
    allreduce = profile["operators"]["allreduce"]
    assert allreduce["ring_latency_s"] > 20e-6
    assert any("at least NCCL's smallest all-reduce among 8 GPUs" in note for note in profile["operators"]["notes"])
    assert sixteen["tpot"]["mean"] > eight["tpot"]["mean"]


@pytest.mark.slow
def test_an_expert_parallel_group_past_a_node_dispatches_over_the_network(package, tmp_path):
    """Qwen3-30B-A3B with --dp 16 --enable-expert-parallel on h200_sxm (8 GPUs a node): the
    all-gather and reduce-scatter among the 16 GPUs ring over the 50 GB/s network, not NVLink."""
    args = ("--model", "Qwen3-30B-A3B", "--hardware", "h200_sxm", "--enable-expert-parallel", "--limit", "40")
    sixteen = replay(tmp_path, *args, "--dp", "16")["options"]["cost_model"]["operators"]
    assert "the network between nodes at 50 GB/s among 16 GPUs" in sixteen["dispatch"]
    assert "the network between nodes at 50 GB/s among 16 GPUs" in sixteen["combine"]
    eight = replay(tmp_path, *args, "--dp", "8")["options"]["cost_model"]["operators"]
    assert "network" not in eight["dispatch"] and "among 8 GPUs" in eight["dispatch"]


def test_a_dp_group_whose_members_stand_tp_apart_past_a_node_dispatches_over_the_network(package, tmp_path):
    """Found by a new-user run: Qwen3-235B-A22B at --tp 8 --dp 2 on h200_sxm (8 GPUs a node) puts each
    DP rank on a node of its own, so the DP group's two GPUs (GPU i and 8 + i) are on two nodes: its
    all-gather and reduce-scatter ring over the 50 GB/s network. They were priced from the NCCL table
    among 2 GPUs of one node (NVLink), a prefill step's dispatch about 4 times too short. --tp 4 --dp 2
    stays within a node."""
    from backends.costmodel.roofline import MoERooflineCostModel, ring_seconds
    from backends.hardware import HARDWARE
    from backends.model_config import resolve_model

    args = ("--model", "Qwen3-235B-A22B", "--hardware", "h200_sxm", "--limit", "20")
    crossing = replay(tmp_path, *args, "--tp", "8", "--dp", "2")["options"]["cost_model"]["operators"]
    for op in ("dispatch", "combine"):
        assert "the network between nodes at 50 GB/s among 2 GPUs (the DP group)" in crossing[op]
        assert "lies among 16 GPUs, past a node of 8" in crossing[op]
    within = replay(tmp_path, *args, "--tp", "4", "--dp", "2")["options"]["cost_model"]["operators"]
    assert within["dispatch"].startswith("NCCL all_gather table among 2 GPUs")
    # The roofline the same way: 1 MB gathered among the 2 GPUs of a 16-GPU engine, over the network.
    h200, model = HARDWARE["H200"], resolve_model("Qwen3-235B-A22B")
    roofline = MoERooflineCostModel(model, h200, tp=8, dp=2)
    assert roofline.dispatch_seconds(1e6) == ring_seconds(h200, 1e6, 2, 16) == pytest.approx(1 / 2 * 1e6 / 50e9 + 5e-6)
    assert MoERooflineCostModel(model, h200, tp=4, dp=2).dispatch_seconds(1e6) == pytest.approx(1 / 2 * 1e6 / 450e9 + 5e-6)


def test_vllm_version_picks_the_nearest_tables_and_says_so(package, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["replay", str(SAMPLE), "--out", str(out), "--limit", "50", "--hardware", "h100_sxm", "--tp", "2",
                 "--vllm-version", "0.12.0"]) == 0
    assert "custom_allreduce 0.14.0 (the nearest)" in capsys.readouterr().out
    tables = json.loads((out / "summary.json").read_text())["options"]["operator_tables"]
    assert tables["asked_vllm_version"] == "0.12.0" and tables["table_versions"]["custom_allreduce"] == "0.14.0"
    assert tables["table_versions"]["gemm"] == "0.24.0" and "nearest" in tables["table_version_choice"]["gemm"]


def test_a_model_of_a_long_folder_name_is_cached_under_a_name_the_file_system_takes(package, tmp_path, capsys):
    """A config.json in a folder named by 250 characters: the derived profile's cache file was named
    by the whole name, past the file system's 255 bytes, and the run an internal error (OSError)."""
    from tests.test_model_config import LLAMA_31_8B

    folder = tmp_path / ("m" * 250)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B))
    first = replay(tmp_path, "--model", str(folder), "--vllm-version", "0.12.0")["options"]["profile"]
    assert Path(first).is_file() and len(Path(first).name) < 255
    assert replay(tmp_path, "--model", str(folder), "--vllm-version", "0.12.0")["options"]["profile"] == first


def test_a_cache_that_cannot_be_written_is_left_out_with_a_warning(package, tmp_path, monkeypatch, capsys):
    """SERVESIM_CACHE naming a file: the derived profile is not cached, the run goes on and says so
    (it was an internal error, NotADirectoryError), as the MoE cache that cannot be written is left out."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("SERVESIM_CACHE", str(tmp_path / "a-file"))
    replay(tmp_path, "--vllm-version", "0.12.0")
    assert "sim: warning: cannot cache the derived profile" in capsys.readouterr().err


def test_allreduce_fusion_prices_small_all_reduces_from_the_trtllm_table(package, tmp_path, capsys):
    """--allreduce-fusion-max-mb: B200 at TP 8, where vLLM's custom all-reduce measures a step at
    16-32 tokens' messages that FlashInfer's fused one (TensorRT-LLM's kernel) does not have: the
    decode steps are shorter, summary.json says the option, the cache keeps both profiles apart;
    a run priced another way (the roofline) refuses it in one line."""
    args = ("--model", "Llama-3.1-70B", "--hardware", "b200_sxm", "--tp", "8", "--dtype", "fp8")
    plain = replay(tmp_path, *args)
    fused = replay(tmp_path, *args, "--allreduce-fusion-max-mb", "8")
    assert "allreduce_fusion_max_mb" not in plain["options"] and fused["options"]["allreduce_fusion_max_mb"] == 8.0
    assert fused["options"]["operator_tables"]["allreduce"].endswith(
        "FlashInfer's fused all-reduce up to 8 MB from TensorRT-LLM's table")
    assert "FlashInfer" not in plain["options"]["operator_tables"]["allreduce"]
    assert fused["tpot"]["mean"] < 0.9 * plain["tpot"]["mean"]
    assert "fused-allreduce-8mb" in fused["options"]["profile"] and fused["options"]["profile"] != \
        plain["options"]["profile"]
    assert main(["replay", str(SAMPLE), "--out", str(tmp_path / "r"), "--limit", "20", "--profile", "roofline",
                 "--allreduce-fusion-max-mb", "8"]) == 2
    assert "--allreduce-fusion-max-mb prices the fused all-reduces" in capsys.readouterr().err
    # A hardware file names no system of the package: said, naming the flag that asked for one.
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"peak_bf16_flops": 1e15, "peak_fp8_flops": 2e15, "memory_bandwidth": 3e12,
                               "memory_bytes": 80_000_000_000, "nvlink_bandwidth": 450e9}))
    assert main(["replay", str(SAMPLE), "--out", str(tmp_path / "r2"), "--limit", "20", "--hardware", str(gpu),
                 "--tp", "2", "--allreduce-fusion-max-mb", "8"]) == 2
    assert "--allreduce-fusion-max-mb prices from the tables of a system" in capsys.readouterr().err


def test_allreduce_fusion_at_tp1_changes_nothing_and_says_so(package, tmp_path, capsys):
    """One GPU has no all-reduce: the same answers as without the flag, said on the terminal and in
    summary.json."""
    args = ("--model", "Llama-3.1-8B", "--hardware", "b200_sxm", "--tp", "1", "--dtype", "fp8")
    plain = replay(tmp_path, *args)
    fused = replay(tmp_path, *args, "--allreduce-fusion-max-mb", "8")
    assert "changes nothing at --tp 1" in capsys.readouterr().err
    assert fused["options"]["operator_tables"]["allreduce"].startswith("--allreduce-fusion-max-mb changes nothing")
    assert plain["options"]["operator_tables"]["allreduce"] is None
    for metric in ("ttft", "tpot", "e2e"):
        assert fused[metric] == plain[metric]


def test_a_system_name_without_the_extra_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    import backends.costmodel.optables.systems

    monkeypatch.setattr(backends.costmodel.optables.systems, "package_systems_dir", lambda: None)
    assert main(["replay", str(SAMPLE), "--out", str(tmp_path / "r"), "--hardware", "l40s"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[tables]'" in err


SHARED = shared_dir() / "gpu-data" / "aiconfigurator"


@pytest.mark.skipif(not (SHARED / "silicon_qwen3_32b_tp2.csv").exists(), reason="needs ../shared/gpu-data")
def test_validate_a_5_row_cut_with_each_rows_version_and_b200_fp4(package, tmp_path):
    qwen = pd.read_csv(SHARED / "silicon_qwen3_32b_tp2.csv", keep_default_na=False)
    llama = pd.read_csv(SHARED / "silicon_llama3.1.csv", keep_default_na=False)
    b200 = llama[(llama["system"] == "b200_sxm") & (llama["backend"] == "vllm")]
    cut = pd.concat([qwen[(qwen["isl"] == 1024) & (qwen["osl"] == 128)].head(2),
                     b200[(b200["precision"] == "fp8") & (b200["tp_size"] == 8)].sort_values("batch_size").head(2),
                     b200[b200["precision"] == "fp4"].head(1)])
    csv = tmp_path / "cut.csv"
    cut.to_csv(csv, index=False)
    out = tmp_path / "out"
    assert main(["validate", str(csv), "--out", str(out), "--quiet"]) == 0  # the package's tables
    summary = json.loads((out / "validate.json").read_text())
    # B200 rows are simulated, fp4 too (the nvfp4 GEMM rows of b200_sxm's tables).
    assert [(g["system"], g["precision"], g["rows"]) for g in summary["groups"]] == \
        [("b200_sxm", "fp4", 1), ("b200_sxm", "fp8", 2), ("h100_sxm", "", 2)]
    assert summary["skipped"] == []
    rows = pd.read_csv(out / "validate.csv")
    qwen_rows = rows[rows["system"] == "h100_sxm"]
    assert qwen_rows["tables"].str.contains("asked 0.12.0").all()
    assert qwen_rows["tables"].str.contains("custom_allreduce 0.14.0 \\(the nearest\\)").all()
    assert rows[rows["system"] == "b200_sxm"]["tables"].str.contains("asked the newest").all()
    assert np.isfinite(rows["predicted_tpot_ms"]).all()


@pytest.mark.skipif(not (SHARED / "silicon_qwen3_32b_tp2.csv").exists(), reason="needs ../shared/gpu-data")
def test_validate_prices_a_dense_fp8_checkpoint_in_fp8(package, tmp_path):
    # The package's Qwen3-32B-FP8 config.json is a block-fp8 checkpoint; a row naming it without a precision
    # was priced as bf16 weights (the checkpoint's quantization_config was not read).
    row = pd.read_csv(SHARED / "silicon_qwen3_32b_tp2.csv", keep_default_na=False).head(1)
    predicted = {}
    for name in ("Qwen/Qwen3-32B", "Qwen/Qwen3-32B-FP8"):
        csv, out = tmp_path / f"{name[-3:]}.csv", tmp_path / name[-3:]
        row.assign(model_path=name).to_csv(csv, index=False)
        assert main(["validate", str(csv), "--out", str(out), "--quiet"]) == 0
        predicted[name] = pd.read_csv(out / "validate.csv")["predicted_tpot_ms"].iloc[0]
    assert predicted["Qwen/Qwen3-32B-FP8"] < 0.8 * predicted["Qwen/Qwen3-32B"]  # half the weight bytes to read


def test_a_hardware_file_states_its_pcie_link_and_summary_json_says_so(tmp_path):
    spec = {"peak_bf16_flops": 362e12, "peak_fp8_flops": 733e12, "memory_bandwidth": 864e9,
            "memory_bytes": 46068 * 2**20, "nvlink_bandwidth": None, "pcie_bandwidth": 32e9}
    path = tmp_path / "pcie_gpu.json"
    path.write_text(json.dumps(spec))
    summary = replay(tmp_path, "--hardware", str(path), "--tp", "2")
    assert summary["hardware"]["pcie_bandwidth"] == 32e9 and summary["hardware"]["nvlink_bandwidth"] is None
    # The roofline's all-reduce: a ring over the PCIe link, 2 (T - 1) / T of the bytes, plus its
    # launch and two hops (3.5 + 2 x 1.5 us).
    from backends.costmodel.tensor_parallel import tp_allreduce_seconds
    from backends.hardware import Hardware
    from backends.model_config import ModelConfig

    hw = Hardware.from_json(path)
    model = ModelConfig.from_preset("Llama-3.1-8B")
    one = 1000 * model.hidden_size * 2 / 32e9 + 6.5e-6
    assert tp_allreduce_seconds(model, 1000, 2, hw) == pytest.approx(2 * model.num_hidden_layers * one, rel=1e-12)
    path.write_text(json.dumps(dict(spec, pcie_bandwidth=None)))
    assert main(["replay", str(SAMPLE), "--out", str(tmp_path / "r2"), "--hardware", str(path), "--tp", "2"]) == 2


def test_a_pcie_rings_fixed_time_grows_with_its_hops_as_the_packages_nccl_tables_measure(package):
    """Over PCIe each step of a ring waits on a hop: the roofline's fixed time of an all-reduce and of
    an all-gather among 2, 4 and 8 GPUs against NCCL's smallest messages on both PCIe systems the
    package measures (within 15%); over NVLink one 5 us whatever the number of GPUs."""
    import dataclasses
    import importlib.util

    import pandas as pd

    from backends.costmodel.roofline import ring_seconds
    from backends.costmodel.tensor_parallel import ALLREDUCE_LATENCY_S, allreduce_latency_s, collective_latency_s
    from backends.hardware import HARDWARE

    root = Path(importlib.util.find_spec("aiconfigurator_core").submodule_search_locations[0])
    for system in ("l40s", "rtx_pro_6000_server"):
        (path,) = (root / "systems" / "data" / system / "comm" / "nccl").glob("*/nccl_perf.parquet")
        nccl = pd.read_parquet(path)
        nccl = nccl[nccl["nccl_dtype"] == "half"]
        for n in (2, 4, 8):
            floor = nccl[nccl["num_gpus"] == n].groupby("op_name")["latency"].min() / 1e3  # ms -> s
            assert allreduce_latency_s("pcie", n) == pytest.approx(floor["all_reduce"], rel=0.15), (system, n)
            assert collective_latency_s("pcie", n, n - 1) == pytest.approx(floor["all_gather"], rel=0.15), (system, n)
    assert [allreduce_latency_s("pcie", n) for n in (1, 2, 4, 8)] == pytest.approx([0.0, 6.5e-6, 12.5e-6, 24.5e-6])
    assert [allreduce_latency_s("nvlink", n) for n in (2, 4, 8)] == [ALLREDUCE_LATENCY_S] * 3
    # The MoE roofline's all-gather over a PCIe group: (n - 1) / n of the bytes, a launch and n - 1 hops.
    pcie = dataclasses.replace(HARDWARE["H100-SXM"], nvlink_bandwidth=None, pcie_bandwidth=64e9)
    assert ring_seconds(pcie, 1e6, 4) == pytest.approx(3 / 4 * 1e6 / 64e9 + 3.5e-6 + 3 * 1.5e-6, rel=1e-12)
    assert ring_seconds(HARDWARE["H100-SXM"], 1e6, 4) == pytest.approx(3 / 4 * 1e6 / 450e9 + 5e-6, rel=1e-12)


def test_the_moe_models_all_reduces_follow_vllms_rules_past_the_tables(package):
    """Found by a review: a table-priced MoE model's all-reduce past its tables was priced as an
    all-gather, (T - 1) / T of the bytes, not a ring all-reduce's 2 (T - 1) / T; and it took vLLM's
    custom all-reduce rows among 4 and 8 PCIe GPUs, where vLLM runs NCCL (custom_all_reduce.py: "not
    supported on more than two PCIe-only GPUs"), as the dense model's `derive_allreduce` does not."""
    import importlib.util

    from backends.costmodel.optables.moe import moe_table_model
    from backends.costmodel.tensor_parallel import ring_allreduce_seconds
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    data = Path(importlib.util.find_spec("aiconfigurator_core").submodule_search_locations[0]) / "systems" / "data"
    model = resolve_model("Qwen3-30B-A3B")
    # TP 16 on h200_sxm spans two nodes: no table for 16 GPUs, a ring over the 50 GB/s network.
    h200 = resolve_hardware("h200_sxm")
    wide = moe_table_model(model, h200, "h200_sxm", data, tp=16)
    size = 1000 * model.hidden_size * 2
    assert wide._hidden_allreduce(size) == pytest.approx(ring_allreduce_seconds(size, 16, 50e9, 5e-6), rel=1e-12)
    # L40S (PCIe): the custom kernel's rows at TP 2 only; NCCL's among 4.
    l40s = resolve_hardware("l40s")
    two = moe_table_model(model, l40s, "l40s", data, tp=2)
    four = moe_table_model(model, l40s, "l40s", data, tp=4)
    assert two.sources["allreduce"].startswith("custom all-reduce table")
    assert four.sources["allreduce"].startswith("no custom all-reduce table, NCCL table")


def test_dtype_fp8_experts_are_priced_with_the_triton_kernel_vllm_serves_them_with(package, tmp_path):
    """Found by a new-user run: `--dtype fp8` (vLLM's --quantization fp8) made an MoE model's decode 3x
    slower than bf16: its experts were priced from the only per-tensor fp8 rows of vLLM 0.24's tables,
    ModelOpt's FlashInfer CUTLASS kernel, which takes static activation scales (a ModelOpt
    checkpoint's). vLLM's online fp8 method asks for dynamic ones, and select_fp8_moe_backend serves it
    with Triton: from 0.19's per-tensor Triton rows on H200, from the same kernel's block-fp8 rows on
    H100 (its tables time Triton fp8 with block scales only)."""
    from backends.costmodel.optables.moe import dispatched_moe_kernel, names_kernel

    assert dispatched_moe_kernel("fp8", 90, online=True)[0] == "triton"
    assert dispatched_moe_kernel("fp8", 80, online=True)[0] == "marlin"
    assert dispatched_moe_kernel("fp8", 90) is None  # a checkpoint's: its scales decide, the tables' rows say
    assert names_kernel("vllm_fused_moe", "triton") and not names_kernel("vllm_fused_moe", "marlin")

    def run(*args):
        summary = replay(tmp_path, "--limit", "100", *args)
        return summary["tpot"]["mean"], summary["options"]["cost_model"]["operators"]["moe"]

    bf16, _ = run("--model", "Qwen3-30B-A3B", "--hardware", "h100_sxm")
    fp8, how = run("--model", "Qwen3-30B-A3B", "--hardware", "h100_sxm", "--dtype", "fp8")
    block, _ = run("--model", "Qwen/Qwen3-30B-A3B-FP8", "--hardware", "h100_sxm")
    assert "vllm_fp8moe_triton_tritonexperts, fp8_block" in how and "priced from the same kernel's block-fp8" in how
    assert fp8 == block < 0.8 * bf16  # half the expert bytes to read, as the block-fp8 checkpoint
    # Found by a review with odd options: naming the kernel `auto` serves (--moe-kernel triton) was
    # refused on H100, "leave --moe-kernel auto", which picks that very kernel. It is the same answer.
    named, how = run("--model", "Qwen3-30B-A3B", "--hardware", "h100_sxm", "--dtype", "fp8", "--moe-kernel", "triton")
    assert named == fp8 and "the kernel the server was told to run" in how and "same kernel's block-fp8" in how
    fp8, how = run("--model", "Qwen3-235B-A22B", "--hardware", "h200_sxm", "--tp", "4", "--dtype", "fp8")
    bf16, _ = run("--model", "Qwen3-235B-A22B", "--hardware", "h200_sxm", "--tp", "4")
    assert "moe_perf vLLM 0.19.0" in how and "vllm_fused_moe, fp8," in how and fp8 < bf16


def test_a_mixture_of_experts_dtype_is_its_checkpoints_and_fp4_is_an_nvfp4_checkpoints(package, tmp_path, capsys):
    """Found by a new-user run: summary.json's options.dtype said bf16 for a block-fp8 MoE checkpoint
    the terminal (rightly) called fp8-block; and --dtype fp4 on an MoE model failed with "unknown weight
    dtype 'fp4'" listing values --dtype refuses (an unquantized checkpoint), or was silently dropped
    while options.dtype kept fp4 (a quantized one)."""
    from backends.model_config import resolve_model
    from sim.errors import ServesimError

    options = replay(tmp_path, "--model", "Qwen/Qwen3-30B-A3B-FP8", "--limit", "20")["options"]
    assert options["dtype"] == "fp8-block" and "experts_dtype" not in options
    options = replay(tmp_path, "--model", "gpt-oss-120b", "--max-model-len", "16384", "--limit", "20")["options"]
    assert (options["dtype"], options["experts_dtype"]) == ("bf16", "mxfp4")
    assert replay(tmp_path, "--model", "Qwen3-30B-A3B", "--limit", "20")["options"]["dtype"] == "bf16"
    with pytest.raises(ServesimError, match=r"--dtype fp4: vLLM quantizes no model to fp4 \(nvfp4\) itself"):
        resolve_model("Qwen3-30B-A3B").linear_dtypes("fp4")
    with pytest.raises(ServesimError, match=r"--dtype fp4: gpt-oss-120b's checkpoint is quantized \(mxfp4"):
        resolve_model("gpt-oss-120b").linear_dtypes("fp4")
    assert resolve_model("nvidia/Kimi-K2.5-NVFP4").linear_dtypes("fp4")[1] == "nvfp4"
    assert main(["replay", str(SAMPLE), "--model", "DeepSeek-V3", "--hardware", "b200_sxm", "--tp", "8", "--dtype",
                 "fp4", "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert "--dtype fp4: DeepSeek-V3's checkpoint is quantized (fp8-block" in capsys.readouterr().err


def test_the_marlin_note_is_an_nvfp4_checkpoints_only(package, tmp_path):
    """Found by a new-user run: a block-fp8 checkpoint on a100_sxm (no fp8 GEMM rows there) was told
    that vLLM runs NVFP4 weight-only with Marlin, which has nothing to do with it."""
    ops = replay(tmp_path, "--model", "Qwen/Qwen3-30B-A3B-FP8", "--hardware", "a100_sxm",
                 "--limit", "20")["options"]["cost_model"]["operators"]
    assert ops["linear"] == "roofline: no fp8 GEMM rows on a100_sxm" and "NVFP4" not in json.dumps(ops)


def test_a_ring_past_a_pcie_node_pays_at_least_its_hops_and_a_spread_group_is_named(package, tmp_path):
    """Found by a review: a PCIe system whose network is slower than its PCIe (a100_pcie: 32 against
    25 GB/s) priced TP 16's all-reduces with NVLink's flat 5 us, so a decode token's all-reduces cost 4 ms
    at TP 8 and 1 ms at TP 16; the ring's hops are the node's link's, across nodes too. And a DP group
    refused for spanning nodes named 16 GPUs, though it has 2."""
    import dataclasses

    from backends.costmodel.roofline import MoERooflineCostModel
    from backends.costmodel.tensor_parallel import tp_allreduce_seconds
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model
    from sim.errors import ServesimError

    llama, a100 = resolve_model("Llama-3.1-70B"), resolve_hardware("a100_pcie")
    eight, sixteen = (tp_allreduce_seconds(llama, 1, tp, a100) for tp in (8, 16))
    assert sixteen > eight
    assert sixteen == pytest.approx(llama.num_sublayers * (2 * 15 / 16 * 8192 * 2 / 25e9 + 3.5e-6 + 30 * 1.5e-6))
    bare = dataclasses.replace(resolve_hardware("h200_sxm"), inter_node_bandwidth=None)
    with pytest.raises(ServesimError, match=r"a group of 2 GPUs spread over 16 \(a DP group's stand --tp apart\) "
                                            r"span nodes of 8"):
        MoERooflineCostModel(resolve_model("Qwen3-30B-A3B"), bare, tp=8, dp=2).dispatch_seconds(1e6)


def test_an_explicit_distribution_no_moe_perf_row_prices_is_refused_balanced_too(package, capsys):
    """Found by a review with odd options: --moe-distribution balanced on A100, whose tables measure this
    layer with skewed rows only, ran on the roofline (which spreads no tokens over experts) while
    summary.json recorded `balanced`; docs/moe.md says a distribution the table lacks is refused."""
    from sim.app.cli import main

    code = main(["replay", "traces/samples/azure_conv_2023_first5min.csv", "--model", "Qwen3-30B-A3B", "--hardware",
                 "A100-80GB", "--moe-distribution", "balanced", "--limit", "5", "--out", "/nonexistent/never-written"])
    err = capsys.readouterr().err
    assert code == 2 and "--moe-distribution balanced is priced from the moe_perf rows measured with it, and none " \
        "price this layer (roofline: no moe_perf rows with the balanced token distribution" in err
    assert err.rstrip().endswith("give auto (the roofline then prices the layer)") and "Traceback" not in err


def test_a_ring_no_nccl_table_measures_is_never_faster_than_the_measured_ring_it_contains(package, tmp_path):
    """Found by a review with odd layouts: L40S's NCCL table measures 8 GPUs at 1-2 GB/s (its PCIe node),
    and TP 16, past the node, was priced as a ring at the PCIe link's 32 GB/s: a 2k-token step of
    Qwen3-30B-A3B took 52 ms against TP 8's 971 ms, and Llama-3.1-70B's TTFT fell from 45 s to 0.27 s.
    A 16-GPU ring crosses every hop of the 8-GPU one: each message takes at least the 8-GPU table's
    time, its bytes scaled by the ring's (15/16) / (7/8). The same for a DP group's all-gather and
    reduce-scatter past the node."""
    from backends.costmodel.optables.derive import ring_scaled
    from backends.costmodel.optables.moe import moe_table_model
    from backends.costmodel.optables.systems import package_systems_dir
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    assert ring_scaled([7.0, 14.0], 8, 16) == [7.0 * (15 / 16) / (7 / 8), 14.0 * (15 / 16) / (7 / 8)]
    assert ring_scaled([1.0], 2, 4) == [1.5]
    data, l40s = package_systems_dir() / "data", resolve_hardware("l40s")
    eight = moe_table_model(resolve_model("Qwen3-30B-A3B"), l40s, "l40s", data, tp=8)
    sixteen = moe_table_model(resolve_model("Qwen3-30B-A3B"), l40s, "l40s", data, tp=16)
    table = eight._ar_nccl  # the 8-GPU rows
    for size in (2048 * 2048 * 2, 256 * 2048 * 2, 64 * 1024):  # a 2k-token step's hidden states, and smaller
        measured = float(table.many(size)[0])
        assert sixteen._hidden_allreduce(size) >= measured * (15 / 16) / (7 / 8) * (1 - 1e-12)
    assert "never faster than NCCL's table among 8 GPUs, its bytes scaled to 16" in sixteen.sources["allreduce"]
    tpot = {tp: replay(tmp_path, "--model", "Qwen3-30B-A3B", "--hardware", "l40s", "--tp", str(tp), "--limit", "30")
            ["tpot"]["mean"] for tp in (8, 16)}
    assert tpot[16] > tpot[8]
    dp = {n: replay(tmp_path, "--model", "Qwen3-30B-A3B", "--hardware", "l40s", "--tp", "2", "--dp", str(n),
                    "--limit", "30") for n in (4, 8)}
    assert dp[8]["tpot"]["mean"] > dp[4]["tpot"]["mean"]
    assert "never faster than NCCL's all_gather table among 4 GPUs, its bytes scaled to 8" in \
        dp[8]["options"]["cost_model"]["operators"]["dispatch"]
    # the dense operator model's all-reduces (Llama-3.1-70B: 45 s of TTFT at TP 8, 0.27 s at TP 16 before)
    ttft = {tp: replay(tmp_path, "--model", "Llama-3.1-70B", "--hardware", "l40s", "--tp", str(tp), "--limit", "20")
            ["ttft"]["mean"] for tp in (8, 16)}
    assert ttft[16] > ttft[8]
