"""MoE, MLA and sliding-window models priced from the tables package's measured tables
(backends/costmodel/optables/moe.py): moe_perf lookups exact on grid points, vLLM's Hopper kernel
choice, EP dispatch and combine sizes worked by hand, the per-operator fallback to the roofline said
in summary.json, --moe-distribution, and a 5-row MoE cut of `sim validate`."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from backends.costmodel.optables.moe import (
    NAMED_KERNELS,
    MoEShape,
    check_moe_distribution,
    dispatched_moe_kernel,
    family_distribution,
    moe_curve,
    moe_layer_roofline,
    nccl_curve,
    pick_moe_curve,
    table_distribution,
    transferred_moe_curve,
)
from backends.costmodel.optables.systems import LayoutTable, versions_by_nearness
from backends.costmodel.roofline import combine_bytes, dispatch_bytes, dp_gathered_tokens
from sim.app.cli import main
from sim.errors import ServesimError
from tests.helpers import shared_dir


def moe_frame() -> pd.DataFrame:
    """A small moe_perf table: two kernels of block fp8 at one shape, bf16 at another."""
    rows = []
    for kernel, scale in (("vllm_fp8moe_triton_tritonexperts", 1.0), ("vllm_fp8moe_flashinfer_cutlass_flashinferexperts", 2.0)):
        for ep in (1, 2):
            for t, ms in ((1, 0.05), (8, 0.07), (64, 0.2)):
                rows.append({"kernel_source": kernel, "moe_dtype": "fp8_block", "num_tokens": t, "hidden_size": 4096,
                             "inter_size": 1536, "topk": 8, "num_experts": 128, "moe_tp_size": 1, "moe_ep_size": ep,
                             "distribution": "balanced", "seconds": scale * ms * 1e-3})
    frame = pd.DataFrame(rows)
    bf16 = frame[frame["kernel_source"].str.contains("triton")].assign(
        moe_dtype="bfloat16", kernel_source="vllm_unquantizedfusedmoe_triton_tritonexperts", distribution="power_law_1.2")
    return pd.concat([frame, bf16], ignore_index=True)


def shape(**kw) -> MoEShape:
    base = dict(hidden_size=4096, inter_size=1536, topk=8, num_experts=128, moe_tp_size=1, moe_ep_size=1,
                moe_dtype="fp8_block", distribution="balanced")
    return MoEShape(**{**base, **kw})


def test_moe_curve_is_the_table_on_grid_points_and_picks_vllms_hopper_kernel():
    kernel, xs, ys = moe_curve(moe_frame(), shape())
    # Block fp8 on Hopper: Triton under TP (EP 1), FlashInfer CUTLASS under EP (vLLM's _get_priority_backends).
    assert kernel == "vllm_fp8moe_triton_tritonexperts"
    assert xs.tolist() == [1.0, 8.0, 64.0] and ys.tolist() == [1.0 * ms * 1e-3 for ms in (0.05, 0.07, 0.2)]
    kernel, _, ys = moe_curve(moe_frame(), shape(moe_ep_size=2))
    assert kernel == "vllm_fp8moe_flashinfer_cutlass_flashinferexperts"
    assert ys.tolist() == [2.0 * ms * 1e-3 for ms in (0.05, 0.07, 0.2)]
    kernel, _, _ = moe_curve(moe_frame(), shape(moe_dtype="bfloat16", distribution="power_law_1.2"))
    assert kernel == "vllm_unquantizedfusedmoe_triton_tritonexperts"


@pytest.mark.parametrize("change, says", [
    (dict(hidden_size=2048), "no moe_perf rows for hidden 2048"),
    (dict(moe_dtype="int4_wo"), "no moe_perf rows in int4_wo"),
    (dict(moe_tp_size=2), "MoE TP 2, EP 1"),
    (dict(distribution="power_law_1.01"), "power_law_1.01"),
])
def test_a_shape_the_table_lacks_is_a_reason_never_a_guess(change, says):
    reason = moe_curve(moe_frame(), shape(**change))
    assert isinstance(reason, str) and says in reason


def mxfp4_rows(kernel: str, scale: float, tokens=(1, 8, 64), tp: int = 1) -> list[dict]:
    return [{"kernel_source": kernel, "moe_dtype": "w4a16_mxfp4", "num_tokens": t, "hidden_size": 2880,
             "inter_size": 2880, "topk": 4, "num_experts": 128, "moe_tp_size": tp, "moe_ep_size": 1,
             "distribution": "power_law_1.2", "seconds": scale * t * 1e-6} for t in tokens]


def layout(version: str, how: str, rows: list[dict]) -> LayoutTable:
    return LayoutTable("moe_perf", version, how, (f"/x/{version}/moe_perf.parquet",), pd.DataFrame(rows))


def test_versions_by_nearness_start_with_choose_versions_pick():
    assert versions_by_nearness(["0.19.0", "0.22.0", "0.24.0"], "0.15.1") == [
        ("0.19.0", "the nearest to 0.15.1 (available: 0.19.0, 0.22.0, 0.24.0)"),
        ("0.22.0", "the next nearest to 0.15.1"), ("0.24.0", "the next nearest to 0.15.1")]
    assert [v for v, _ in versions_by_nearness(["0.19.0", "0.22.0", "0.24.0"], "0.23.0")] == \
        ["0.24.0", "0.22.0", "0.19.0"]  # a tie goes to the newer
    assert [v for v, _ in versions_by_nearness(["0.19.0", "0.24.0"], None)] == ["0.24.0", "0.19.0"]


def test_the_kernel_vllm_serves_the_experts_with_by_dtype_and_gpu():
    assert dispatched_moe_kernel("int4_wo", None)[0] == "marlin"  # compressed-tensors WNA16: Marlin anywhere
    assert dispatched_moe_kernel("w4a16_mxfp4", 100)[0] == "flashinfer_trtllm_mxfp4_bf16"  # B200
    assert dispatched_moe_kernel("w4a16_mxfp4", 103)[0] == "flashinfer_trtllm_mxfp4_bf16"  # B300
    assert dispatched_moe_kernel("w4a16_mxfp4", 90)[0] == "oaitriton"  # H100, H200
    assert dispatched_moe_kernel("w4a16_mxfp4", 89)[0] == "marlin"  # L40S
    assert dispatched_moe_kernel("w4a16_mxfp4", None) is None  # a GPU the package does not describe
    assert dispatched_moe_kernel("fp8_block", 90) is None


def test_a_shape_the_nearest_version_lacks_comes_from_the_next_nearest_never_the_roofline():
    """vLLM 0.19's B200 table measures gpt-oss's experts at MoE TP 1 and 8 only: a TP 2 row of vLLM
    0.15.1 was priced by the roofline though 0.24's table measures TP 2."""
    near = layout("0.19.0", "the nearest to 0.15.1", mxfp4_rows("vllm_mxfp4_moe", 10.0))
    far = layout("0.24.0", "the next nearest to 0.15.1", mxfp4_rows("vllm_x_marlin_y", 2.0, tp=2))
    table, priced, (kernel, xs, ys), why = pick_moe_curve([near, far], mxfp4_shape(moe_tp_size=2), False, None)
    assert table is far and kernel == "vllm_x_marlin_y" and ys.tolist() == [2.0 * t * 1e-6 for t in (1, 8, 64)]
    assert why == "; vLLM 0.19.0's table does not measure it at this shape"
    reason = pick_moe_curve([near, far], mxfp4_shape(moe_tp_size=4), False, None)
    assert reason == ("no moe_perf rows at MoE TP 4, EP 1 (moe_perf.parquet vLLM 0.19.0; no other version "
                      "measures it)")


def test_the_served_kernel_comes_before_the_nearer_versions_helper_timing():
    """vLLM 0.19's table times gpt-oss's experts through a helper (vllm_mxfp4_moe, 3 to 4x the FlashInfer
    kernel vLLM serves them with on B200); 0.24's names the served kernel."""
    served = dispatched_moe_kernel("w4a16_mxfp4", 100)
    near = layout("0.19.0", "the nearest", mxfp4_rows("vllm_mxfp4_moe", 10.0))
    far = layout("0.24.0", "the next nearest", mxfp4_rows(
        "vllm_gptossmxfp4moe_flashinfer_trtllm_mxfp4_bf16_trtllmmxfp4expertsmonolithic", 3.0))
    table, _, (kernel, _, ys), why = pick_moe_curve([near, far], mxfp4_shape(), False, served)
    assert table is far and "flashinfer_trtllm_mxfp4_bf16" in kernel and ys[0] == pytest.approx(3e-6)
    assert why.startswith("; FlashInfer TRT-LLM MXFP4 x BF16") and "0.19.0's table does not measure it" in why
    # Where no version measures the served kernel, the nearest version's helper timing prices it.
    table, _, (kernel, _, _), why = pick_moe_curve([near], mxfp4_shape(), False, served)
    assert table is near and kernel == "vllm_mxfp4_moe" and why == ""
    # The helper labels never count as the served kernel, even where their names contain it.
    int4 = layout("0.19.0", "the nearest", [dict(r, moe_dtype="int4_wo") for r in mxfp4_rows("vllm_marlin_int4_moe", 9.0)])
    marlin = layout("0.24.0", "the next nearest", [dict(r, moe_dtype="int4_wo") for r in mxfp4_rows(
        "vllm_compressedtensorswna16marlinmoe_marlin_marlinexperts", 4.0)])
    table, _, (kernel, _, _), _ = pick_moe_curve([int4, marlin], mxfp4_shape(moe_dtype="int4_wo"), False,
                                                 dispatched_moe_kernel("int4_wo", 100))
    assert table is marlin


def test_a_curve_from_one_token_comes_before_a_nearer_partial_one():
    """vLLM 0.19's B200 table measures gpt-oss at MoE TP 8 from 128 tokens only: every decode step of
    fewer tokens would be priced at 128 tokens' time."""
    near = layout("0.19.0", "the nearest", mxfp4_rows("vllm_mxfp4_moe", 10.0, tokens=(128, 256), tp=8))
    far = layout("0.24.0", "the next nearest", mxfp4_rows("vllm_other", 3.0, tp=8))
    table, _, (_, xs, _), _ = pick_moe_curve([near, far], mxfp4_shape(moe_tp_size=8), False, None)
    assert table is far and xs[0] == 1
    table, _, (_, xs, _), _ = pick_moe_curve([near], mxfp4_shape(moe_tp_size=8), False, None)
    assert table is near and xs.tolist() == [128, 256]  # the only measurement there is


def mxfp4_shape(**kw) -> MoEShape:
    base = dict(hidden_size=2880, inter_size=2880, topk=4, num_experts=128, moe_tp_size=1, moe_ep_size=1,
                moe_dtype="w4a16_mxfp4", distribution="power_law_1.2")
    return MoEShape(**{**base, **kw})


def test_dispatch_and_combine_sizes_worked_by_hand():
    # vLLM's allgather_reducescatter: dispatch gathers each DP rank's hidden states (bf16), top-k weights
    # (fp32) and ids (int32); combine reduce-scatters the MoE output (bf16) of every rank's tokens.
    # DP 2, 3 tokens a rank, hidden 4096, top-8: 2 x 3 x (4096 x 2 + 8 x 8) = 6 x 8256 = 49,536 bytes.
    assert dp_gathered_tokens([3, 3]) == 6
    assert dispatch_bytes(6, 4096, 8) == 49_536
    assert combine_bytes(6, 4096) == 2 * 3 * 4096 * 2 == 49_152
    # DP 4, one token each: 4 x (2880 x 2 + 4 x 8) = 23,168 bytes.
    assert dispatch_bytes(dp_gathered_tokens([1, 1, 1, 1]), 2880, 4) == 23_168
    # Sequence-parallel MoE (EP, TP 2, DP 2): each GPU sends ceil(t / 2) of its rank's tokens, so a
    # rank of 5 tokens sends 3 + 3 and one of 1 token 1 + 1: 8 tokens gathered on every GPU.
    assert dp_gathered_tokens([5, 1], 2) == 8


def test_nccl_table_counts_2_byte_elements():
    frame = pd.DataFrame({"op_name": ["all_gather"] * 2 + ["reduce_scatter"], "num_gpus": [2, 2, 2],
                          "nccl_dtype": ["half"] * 3, "message_size": [1024, 2048, 1024], "seconds": [1e-5, 2e-5, 3e-5]})
    xs, ys = nccl_curve(frame, "all_gather", 2)
    assert xs.tolist() == [2048.0, 4096.0] and ys.tolist() == [1e-5, 2e-5]
    assert nccl_curve(frame, "all_gather", 4) is None and nccl_curve(None, "all_gather", 2) is None


def test_moe_distribution_values():
    assert table_distribution("balanced") == "balanced"
    assert table_distribution("power-law:1.2") == "power_law_1.2"
    for bad in ("power-law", "power_law_1.2", "zipf:1.1", "power-law:-1"):
        with pytest.raises(ServesimError, match="balanced or power-law:ALPHA"):
            check_moe_distribution("--moe-distribution", bad)


def test_auto_distribution_is_the_familys_as_aiconfigurator_prices_it():
    from backends.model_config import resolve_model

    check_moe_distribution("--moe-distribution", "auto")
    assert family_distribution(resolve_model("DeepSeek-V3")) == "power-law:1.01"  # MLA: the DeepSeek family
    for name in ("Qwen3-30B-A3B", "Qwen3-235B-A22B", "gpt-oss-120b", "Mixtral-8x7B"):
        assert family_distribution(resolve_model(name)) == "power-law:1.2"


def test_a_bad_moe_distribution_is_a_one_line_error(capsys):
    assert main(["replay", "x.csv", "--moe-distribution", "zipf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--moe-distribution 'zipf'" in err and len(err.splitlines()) == 1


# ---- against the tables package (skipped without it)


@pytest.fixture(scope="module")
def package():
    pytest.importorskip("aiconfigurator_core")
    from backends.costmodel.optables.systems import require_package

    return require_package()


def qwen30b(package, **kw):
    from backends.model_config import resolve_model

    return qwen30b_of(package, resolve_model("Qwen3-30B-A3B"), **kw)


def qwen30b_of(package, model, **kw):
    from backends.costmodel.optables.moe import moe_table_model
    from backends.hardware import resolve_hardware

    return moe_table_model(model, resolve_hardware("H200"), "h200_sxm", package / "data", **kw)


def test_moe_layer_is_the_measured_row_on_grid_points(package):
    from backends.costmodel.optables.systems import read_layout_table

    model = qwen30b(package, distribution="balanced")
    table = read_layout_table(package / "data", "h200_sxm", "moe", "vllm", "moe_perf", None).frame
    rows = table[(table.hidden_size == 2048) & (table.inter_size == 768) & (table.topk == 8) & (table.num_experts == 128)
                 & (table.moe_dtype == "bfloat16") & (table.moe_tp_size == 1) & (table.moe_ep_size == 1)
                 & (table.distribution == "balanced")]
    for t in (1, 64, 1024, 16384):
        measured = rows[rows.num_tokens == t]["seconds"].mean()
        assert model.dense(t, 0)[2] == 48 * measured  # 48 MoE layers x the table's time, exactly
    assert "moe" not in model.extrapolated
    model.dense(20000, 0)  # past the grid's 16384 tokens: scaled, and counted
    assert model.extrapolated["moe"] == 1
    skewed = qwen30b(package, distribution="power-law:1.2")
    assert "power_law_1.2" in skewed.sources["moe"] and skewed.dense(64, 0)[2] != model.dense(64, 0)[2]


def test_by_default_a_moe_layer_is_the_familys_skewed_rows(package):
    auto, skewed = qwen30b(package), qwen30b(package, distribution="power-law:1.2")
    assert "power_law_1.2" in auto.sources["moe"]
    for t in (1, 64, 1024):
        assert auto.dense(t, 0)[2] == skewed.dense(t, 0)[2]
    # Skewed routing: a decode step reads fewer experts (faster than balanced), a long prefill waits on
    # the busiest ones (slower).
    balanced = qwen30b(package, distribution="balanced")
    assert auto.dense(16, 0)[2] < balanced.dense(16, 0)[2] and auto.dense(8192, 0)[2] > balanced.dense(8192, 0)[2]


def test_auto_takes_the_balanced_rows_where_the_familys_are_not_measured_and_says_so(package):
    from dataclasses import replace

    from backends.costmodel.optables.moe import MoETableCostModel
    from backends.costmodel.optables.systems import read_layout_table
    from backends.costmodel.optables.tables import load_layout
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    full = read_layout_table(package / "data", "h200_sxm", "moe", "vllm", "moe_perf", None)
    only_balanced = replace(full, frame=full.frame[full.frame.distribution == "balanced"])
    model, hw, tables = resolve_model("Qwen3-30B-A3B"), resolve_hardware("H200"), load_layout(package / "data", "h200_sxm")
    priced = MoETableCostModel(model, hw, tables, moe_table=only_balanced)
    assert "balanced" in priced.sources["moe"] and priced.notes[0] == "moe: no power_law_1.2 rows at this shape; priced balanced"
    assert all(note.startswith("GEMM lm_head") for note in priced.notes[1:])  # the vocabulary is past the grid's n
    assert priced.dense(64, 0)[2] == qwen30b(package, distribution="balanced").dense(64, 0)[2]
    with pytest.raises(ServesimError, match="power-law:1.2 is priced from the moe_perf rows measured with it, and none price this layer"):
        MoETableCostModel(model, hw, tables, moe_table=only_balanced, distribution="power-law:1.2")  # asked: refused


def test_block_fp8_weights_are_priced_from_the_per_tensor_fp8_rows_measured_in_a_cuda_graph(package):
    # AIConfigurator's collector times every GEMM in a CUDA graph but block fp8 (collect_gemm.py: use_cuda_graph=
    # gemm_type != "fp8_block"): those rows carry the host's launch time, which vLLM's CUDA-graph decode does not pay.
    from dataclasses import replace

    from backends.model_config import resolve_model

    base = resolve_model("Qwen3-30B-A3B")
    block = qwen30b_of(package, replace(base, weight_dtype="fp8-block", expert_dtype="fp8-block"))
    per_tensor = qwen30b_of(package, replace(base, weight_dtype="fp8", expert_dtype="fp8-block"))
    assert block.sources["linear"].startswith("gemm_perf 0.24.0: CutlassFP8ScaledMMLinearKernel (per-tensor fp8 rows")
    for t in (1, 16, 512, 8192):
        assert block.dense(t, 0)[0] == per_tensor.dense(t, 0)[0] > 0  # linear: the same curves, exactly


@pytest.mark.parametrize("kernel", ["FlashInferFp8BlockScaledMMKernel", "DeepGemmFp8BlockScaledMMKernel",
                                    "CutlassFp8BlockScaledMMKernel"])
def test_the_block_fp8_rows_small_m_floor_is_the_hosts_not_the_gpus(package, kernel):
    # Why they are not read: at small m and small weights each block-fp8 kernel takes the same time on H100 and
    # H200 (a GPU-bound time would differ by their bandwidths, 3.35 and 4.8 TB/s), 5x or more what the per-tensor
    # fp8 kernel, timed in a CUDA graph, takes at the same shapes.
    from backends.costmodel.optables.systems import read_layout_table

    def rows(system):
        t = read_layout_table(package / "data", system, "gemm", "vllm", "gemm_perf", "0.24.0").frame
        return t[(t.m <= 64) & (t.n * t.k <= 4096 * 4096)]

    h100, h200 = rows("h100_sxm"), rows("h200_sxm")
    keys = ["m", "n", "k"]
    block = h100[h100.kernel_source == kernel].merge(h200[h200.kernel_source == kernel], on=keys)
    assert len(block) > 100
    ratio = (block.seconds_x / block.seconds_y).median()
    assert 0.95 < ratio < 1.08
    tensor = h200[h200.gemm_dtype == "fp8"].merge(h200[h200.kernel_source == kernel], on=keys)
    assert (tensor.seconds_y / tensor.seconds_x).median() > 5


def test_no_moe_table_falls_back_to_the_roofline_and_says_so(package):
    from backends.costmodel.optables.moe import MoETableCostModel
    from backends.costmodel.optables.tables import load_layout
    from backends.costmodel.roofline import MoERooflineCostModel
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    model, hw = resolve_model("Qwen3-30B-A3B"), resolve_hardware("H200")
    tables = load_layout(package / "data", "h200_sxm")
    priced = MoETableCostModel(model, hw, tables, moe_table=None)
    assert priced.cost_model_summary()["operators"]["moe"].startswith("roofline: h200_sxm has no moe_perf table")
    assert priced.dense(64, 0)[2] == MoERooflineCostModel(model, hw).dense(64, 0)[2]


def test_summary_json_says_each_operators_source(package, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,300,20\n0.01,200,10\n0.02,900,5\n")
    assert main(["replay", str(trace), "--model", "DeepSeek-V3", "--hardware", "H200", "--tp", "8",
                 "--block-size", "64", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    ops = summary["options"]["cost_model"]["operators"]
    assert ops["moe"].startswith("moe_perf") and "fp8_block" in ops["moe"] and "MoE TP 8 EP 1" in ops["moe"]
    # MLA from its module tables (tests/test_mla_tables.py); the dense MLPs and shared experts stay the roofline's.
    assert ops["attention"].startswith("MLA module tables mla_context_module_perf.parquet, "
                                       "mla_generation_module_perf.parquet vLLM 0.24.0")
    assert ops["linear"].startswith("roofline: the dense MLPs and shared experts") and ops["kv_write"].startswith("in attention")
    assert ops["allreduce"].startswith("custom all-reduce table")
    # the small kernels as the dense operator model prices them, and no fixed step overhead (host time is the CPU's)
    assert ops["router"].startswith("gemm_perf") and ops["lm_head"].startswith("gemm_perf")
    assert ops["elementwise"].startswith("each kernel the GEMM table's floor") and ops["overhead"].startswith("none")


def test_dense_runs_keep_their_summary(package, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,300,20\n")
    assert main(["replay", str(trace), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    options = json.loads((tmp_path / "run" / "summary.json").read_text())["options"]
    assert "cost_model" not in options and "moe_distribution" not in options


def test_validate_a_5_row_moe_cut(package, tmp_path):
    measured = pd.read_csv(shared_dir() / "gpu-data" / "aiconfigurator" / "silicon_moe.csv")
    # TP 2; TP 1 x DP 2; TP 2 with EP; a long prompt; gpt-oss (MXFP4 experts, sliding layers).
    cut = measured[measured["id"].isin(measured["id"].iloc[[0, 1, 15, 34, 62]])]
    path = tmp_path / "cut.csv"
    cut.to_csv(path, index=False)
    assert main(["validate", str(path), "--out", str(tmp_path / "v"), "--quiet"]) == 0
    rows = pd.read_csv(tmp_path / "v" / "validate.csv")
    summary = json.loads((tmp_path / "v" / "validate.json").read_text())
    assert len(rows) == 5 and not summary["skipped"]
    assert rows["notes"].str.contains("2 DP ranks in lockstep behind vLLM's DP load balancer").sum() == 1
    assert rows["tables"].str.contains("moe: moe_perf").all()
    assert np.isfinite(rows[["predicted_ttft_ms", "predicted_tpot_ms"]].to_numpy()).all()
    assert (rows["predicted_tpot_ms"] > 0).all()


@pytest.mark.parametrize("row, layout", [
    ({"tp_size": 2, "attention_dp_size": "", "moe_tp_size": 2, "moe_ep_size": 1}, (2, 1, False)),
    ({"tp_size": 1, "attention_dp_size": "", "moe_tp_size": 2, "moe_ep_size": 1}, (1, 2, False)),
    ({"tp_size": 2, "attention_dp_size": "", "moe_tp_size": 1, "moe_ep_size": 2}, (2, 1, True)),
    ({"tp_size": 1, "attention_dp_size": 4, "moe_tp_size": 1, "moe_ep_size": 4}, (1, 4, True)),
    ({"tp_size": 2, "attention_dp_size": 2, "moe_tp_size": 1, "moe_ep_size": 4}, (2, 2, True)),
])
def test_a_moe_rows_layout(row, layout):
    from backends.model_config import resolve_model
    from sim.app.validate import moe_layout

    assert moe_layout(row, resolve_model("Qwen3-235B-A22B")) == layout


EXPORT = "source_file=2026-04-06.csv; model=MiniMax-M2.5; silicon_concurrency=4"


@pytest.mark.parametrize("change, layout", [
    ({}, (4, 1, True)),  # the export's TP 4 x DP 4, EP 16 for a `tp4_ep4` run: the id's TP 4 with EP 4
    ({"id": "x_c4_tp2_ep2_1", "tp_size": 2, "attention_dp_size": 2, "moe_ep_size": 4}, (2, 1, True)),
    ({"attention_dp_size": 1, "moe_ep_size": 4}, (4, 1, True)),  # the columns agree: taken
    ({"backend": "sglang"}, (4, 4, True)),  # another backend's rows: the columns stand
    ({"silicon_data_source": "source_file=/a/gap-analysis.csv"}, (4, 4, True)),  # another source
    ({"id": "x_c4_tp4_ep2_1"}, (4, 4, True)),  # an EP that is not the TP group: not the convention
    ({"id": "x_c4_cfg733"}, (4, 4, True)),  # an id that names no layout (InferenceX's database dumps)
])
def test_an_inferencex_row_whose_columns_add_data_parallelism_its_id_does_not_name_is_the_ids_layout(change, layout):
    """InferenceX's 2026-04-06 export writes attention_dp_size = TP and moe_ep_size = TP x EP for its vLLM
    runs with expert parallelism; its id and the launch scripts say TP x 1 (sim/app/validate.py, id_layout)."""
    from backends.model_config import resolve_model
    from sim.app.validate import moe_layout

    row = {"id": "2026_04_06_minimax_m2_5_h100_sxm_vllm_fp8_agg_1024x1024_c4_tp4_ep4_1357", "backend": "vllm",
           "silicon_data_source": EXPORT, "tp_size": 4, "attention_dp_size": 4, "moe_tp_size": 1, "moe_ep_size": 16,
           **change}
    assert moe_layout(row, resolve_model("Qwen3-235B-A22B")) == layout


def test_a_layout_vllm_would_not_make_is_refused_naming_it():
    from backends.model_config import resolve_model
    from sim.app.validate import moe_layout

    with pytest.raises(ServesimError, match="moe_tp_size 4 x moe_ep_size 1 is not vLLM's layout of TP 2 x DP 1"):
        moe_layout({"tp_size": 2, "attention_dp_size": 1, "moe_tp_size": 4, "moe_ep_size": 1},
                   resolve_model("Qwen3-235B-A22B"))


def test_nvfp4_experts_are_the_tables_nvfp4_rows_on_grid_points(package):
    # NVIDIA's NVFP4 Kimi K2.5 on B200 (vLLM 0.19.0's tables: FlashInfer's TRT-LLM fp4 MoE kernel).
    from backends.costmodel.optables.moe import moe_table_model
    from backends.costmodel.optables.systems import read_layout_table
    from backends.hardware import resolve_hardware
    from backends.model_config import ModelConfig

    model = ModelConfig.from_hf(package.parent / "model_configs" / "nvidia--Kimi-K2.5-NVFP4_config.json")
    ops = moe_table_model(model, resolve_hardware("b200_sxm"), "b200_sxm", package / "data", tp=4,
                          vllm_version="0.19.0", distribution="balanced")
    assert "nvfp4" in ops.sources["moe"] and "vllm_flashinfer_trtllm_moe_fp4" in ops.sources["moe"]
    table = read_layout_table(package / "data", "b200_sxm", "moe", "vllm", "moe_perf", "0.19.0").frame
    rows = table[(table.hidden_size == 7168) & (table.inter_size == 2048) & (table.topk == 8)
                 & (table.num_experts == 384) & (table.moe_dtype == "nvfp4") & (table.moe_tp_size == 4)
                 & (table.moe_ep_size == 1) & (table.distribution == "balanced")]
    assert not rows.empty
    for t in sorted(set(rows.num_tokens))[::4]:
        assert ops.dense(t, 0)[2] == pytest.approx(60 * rows[rows.num_tokens == t]["seconds"].mean(), rel=1e-12)


def test_validate_prices_an_fp4_row_with_nvidias_nvfp4_checkpoint(package, tmp_path):
    # A row of moonshotai/Kimi-K2.5 (int4 experts) at precision fp4 served nvidia/Kimi-K2.5-NVFP4; a row
    # of a model NVIDIA publishes no NVFP4 config of is refused, as an int4 row of a model without int4 experts.
    base = {"silicon_data_source": "", "backend": "vllm", "backend_version": "0.19.0", "system": "b200_sxm",
            "mode": "agg", "isl": 256, "osl": 8, "batch_size": 2, "tp_size": 4, "pp_size": 1,
            "attention_dp_size": "", "moe_tp_size": 4, "moe_ep_size": 1, "silicon_ttft_ms": 50.0,
            "silicon_tpot_ms": 10.0}
    rows = [dict(base, id="kimi-fp4", model_path="moonshotai/Kimi-K2.5", precision="fp4"),
            dict(base, id="qwen-fp4", model_path="Qwen/Qwen3-30B-A3B", precision="fp4"),
            dict(base, id="qwen-int4", model_path="Qwen/Qwen3-30B-A3B", precision="int4")]
    path = tmp_path / "rows.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    assert main(["validate", str(path), "--out", str(tmp_path / "v"), "--quiet"]) == 0
    out = pd.read_csv(tmp_path / "v" / "validate.csv", keep_default_na=False)
    assert out["id"].tolist() == ["kimi-fp4"]
    assert out["notes"][0].startswith("precision fp4: NVIDIA's NVFP4 checkpoint nvidia/Kimi-K2.5-NVFP4")
    assert "nvfp4" in out["tables"][0]
    skipped = {s["id"]: s["reason"] for s in json.loads((tmp_path / "v" / "validate.json").read_text())["skipped"]}
    assert "no config of NVIDIA's NVFP4 one, nvidia/Qwen3-30B-A3B-NVFP4" in skipped["qwen-fp4"]
    assert skipped["qwen-int4"] == "precision int4: Qwen/Qwen3-30B-A3B's config has no int4 experts"


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_oss_on_b200_of_an_older_vllm_is_priced_with_the_kernel_vllm_serves_it_with(package, tp):
    """vLLM 0.15.1's nearest tables on B200 are 0.19's, whose gpt-oss rows time a helper at 3 to 4x
    FlashInfer's TRT-LLM MXFP4 kernel (the one vLLM serves them with) and hold no MoE TP 2 at all (it
    was the roofline). Now both come from the rows naming that kernel, exact on grid points."""
    from backends.costmodel.optables.moe import moe_table_model
    from backends.costmodel.optables.systems import read_layout_table
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    ops = moe_table_model(resolve_model("gpt-oss-120b"), resolve_hardware("b200_sxm"), "b200_sxm", package / "data",
                          tp=tp, vllm_version="0.15.1")
    assert "vllm_gptossmxfp4moe_flashinfer_trtllm_mxfp4_bf16" in ops.sources["moe"]
    assert "the kernel vLLM serves these experts with" in ops.sources["moe"]
    table = read_layout_table(package / "data", "b200_sxm", "moe", "vllm", "moe_perf", "0.24.0").frame
    rows = table[(table.hidden_size == 2880) & (table.num_experts == 128) & (table.moe_tp_size == tp)
                 & (table.moe_ep_size == 1) & (table.distribution == "power_law_1.2")
                 & table.kernel_source.str.contains("flashinfer_trtllm_mxfp4_bf16")]
    assert not rows.empty
    for t in (1, 8, 256, 4096):
        assert ops.dense(t, 0)[2] == pytest.approx(36 * rows[rows.num_tokens == t]["seconds"].mean(), rel=1e-12)


def test_kimis_int4_experts_are_priced_with_marlin_not_the_helper_the_older_table_times(package):
    from backends.costmodel.optables.moe import moe_table_model
    from backends.hardware import resolve_hardware
    from backends.model_config import ModelConfig

    model = ModelConfig.from_hf(package.parent / "model_configs" / "moonshotai--Kimi-K2.5_config.json")
    ops = moe_table_model(model, resolve_hardware("H200"), "h200_sxm", package / "data", tp=8, vllm_version="0.16.0")
    assert "int4_wo" in ops.sources["moe"] and "compressedtensorswna16marlinmoe_marlin" in ops.sources["moe"]
    assert "vllm_marlin_int4_moe" not in ops.sources["moe"]


# ---- --moe-kernel: the kernel a launch script names, carried from another shape where needed


def marlin_rows(hidden: int, inter: int, topk: int, experts: int, ms: dict, tp: int = 1) -> list[dict]:
    return [{"kernel_source": "vllm_w4a16mxfp4moe_marlin_marlinexperts", "moe_dtype": "w4a16_mxfp4",
             "num_tokens": t, "hidden_size": hidden, "inter_size": inter, "topk": topk, "num_experts": experts,
             "moe_tp_size": tp, "moe_ep_size": 1, "distribution": "power_law_1.2", "seconds": v * 1e-3}
            for t, v in ms.items()]


def test_the_moe_layer_roofline_worked_by_hand():
    from backends.hardware import resolve_hardware

    h100 = resolve_hardware("H100-SXM")
    # gpt-oss at MoE TP 2, one token: 4 experts reached, each a [2880, 2 x 1440] and a [1440, 2880]
    # MXFP4 weight (half a byte a weight, one byte of scale per 32), read at the HBM bandwidth.
    per_expert = (2880 * 2880 // 2 + 2880 // 32 * 2880) + (1440 * 2880 // 2 + 1440 // 32 * 2880)
    num_bytes = 4 * per_expert + 4 * (3 * 2880 + 3 * 1440) * 2
    assert moe_layer_roofline(h100, mxfp4_shape(moe_tp_size=2), [1])[0] == pytest.approx(
        num_bytes / h100.memory_bandwidth, rel=1e-12)
    # 8192 tokens: 32,768 assignments through every expert, at the bf16 peak (W4A16)
    flops = 6.0 * 8192 * 4 * 2880 * 1440
    assert moe_layer_roofline(h100, mxfp4_shape(moe_tp_size=2), [8192])[0] == pytest.approx(
        flops / h100.peak_flops("bf16"), rel=1e-12)


def test_a_named_kernel_measured_only_at_another_shape_is_carried_by_its_work_over_the_roofline():
    """Marlin measured at a source shape with 4x gpt-oss's experts per token (experts / top-k = 128
    against 32): gpt-oss at t tokens is the source at 4t tokens (the same tokens per expert). Its
    time is the kernel's floor (the least any row measures) plus the source's work (time less the
    floor) scaled by the two rooflines."""
    from backends.hardware import resolve_hardware

    h100 = resolve_hardware("H100-SXM")
    source_rows = marlin_rows(2048, 1024, 4, 512, {1: 0.03, 4: 0.05, 16: 0.2, 64: 0.6, 256: 2.0})
    floor_rows = marlin_rows(1024, 512, 2, 8, {1: 0.02}, tp=8)  # another shape: only its floor counts
    table = layout("0.24.0", "the newest", source_rows + floor_rows)
    target = mxfp4_shape()
    table_out, source, (kernel, xs, ys) = transferred_moe_curve([table], target, "marlin", h100)
    assert table_out is table and kernel == "vllm_w4a16mxfp4moe_marlin_marlinexperts"
    assert (source.hidden_size, source.inter_size, source.topk, source.num_experts) == (2048, 1024, 4, 512)
    assert xs.tolist() == [1, 4, 16, 64, 256]
    floor = 0.02e-3
    measured = {1: 0.03e-3, 4: 0.05e-3, 16: 0.2e-3, 64: 0.6e-3, 256: 2.0e-3}
    for t, y in zip((1, 4, 16, 64), ys):
        work = (measured[4 * t] - floor) / moe_layer_roofline(h100, source, [4 * t])[0]
        assert y == pytest.approx(floor + work * moe_layer_roofline(h100, target, [t])[0], rel=1e-12)
    # Past the source curve's end, its last point's work per roofline second is held (never extrapolated).
    work = (measured[256] - floor) / moe_layer_roofline(h100, source, [256])[0]
    assert ys[-1] == pytest.approx(floor + work * moe_layer_roofline(h100, target, [256])[0], rel=1e-12)
    # floor_s 0 (scripts/moe_carry_loo.py's other carry): the whole time scales by the rooflines.
    _, _, (_, _, proportional) = transferred_moe_curve([table], target, "marlin", h100, floor_s=0.0)
    assert proportional[0] == pytest.approx(measured[4] * moe_layer_roofline(h100, target, [1])[0]
                                            / moe_layer_roofline(h100, source, [4])[0], rel=1e-12)
    # No row of the kernel at this TP, or none of it at all: nothing to carry.
    assert transferred_moe_curve([table], mxfp4_shape(moe_tp_size=2), "marlin", h100) is None
    assert transferred_moe_curve([table], target, "flashinfer", h100) is None


def test_a_named_kernel_is_never_priced_with_a_kernel_the_server_did_not_run():
    """gpt-oss on H100 under VLLM_MXFP4_USE_MARLIN=1: the tables measure gpt-oss's shape with OpenAI's
    Triton kernel only and Marlin at another model's shape. vLLM's default takes the Triton rows;
    the named Marlin takes Marlin's rows, carried; where Marlin is measured at the shape itself,
    those rows, exact."""
    from backends.hardware import resolve_hardware

    h100 = resolve_hardware("H100-SXM")
    triton = mxfp4_rows("vllm_gptossmxfp4moe_triton_oaitritonmxfp4expertsmonolithic", 5.0)
    source = marlin_rows(2048, 1024, 4, 512, {1: 0.03, 8: 0.1, 64: 0.6})
    table = layout("0.24.0", "the newest", triton + source)
    _, _, (kernel, _, _), _ = pick_moe_curve([table], mxfp4_shape(), False, dispatched_moe_kernel("w4a16_mxfp4", 90))
    assert "oaitriton" in kernel
    _, _, (kernel, _, _), why = pick_moe_curve([table], mxfp4_shape(), False, NAMED_KERNELS["marlin"], h100, True)
    assert "marlin" in kernel and "measured at no version at this shape" in why and "hidden 2048" in why
    exact = layout("0.24.0", "the newest", triton + source + mxfp4_rows("vllm_x_marlin_y", 7.0))
    _, _, (kernel, _, ys), why = pick_moe_curve([exact], mxfp4_shape(), False, NAMED_KERNELS["marlin"], h100,
                                                True)
    assert kernel == "vllm_x_marlin_y" and ys.tolist() == [7.0 * t * 1e-6 for t in (1, 8, 64)]
    assert "the kernel the server was told to run" in why
    # Named, and measured nowhere: the passes after it (the model refuses that: the next test).
    _, _, (kernel, _, _), _ = pick_moe_curve([layout("0.24.0", "the newest", triton)], mxfp4_shape(), False,
                                             NAMED_KERNELS["flashinfer"], h100, True)
    assert "oaitriton" in kernel


def test_vllms_own_kernel_measured_only_at_another_shape_is_carried_before_another_kernel_at_this_one():
    """int4 experts: vLLM serves them with Marlin. Where the tables measure Marlin only at another
    model's shape and the WNA16 helper (2.4-2.8x Marlin where both are measured) at this one, the
    carried Marlin prices the layer; with no hardware to carry on, the helper, as before."""
    from backends.hardware import resolve_hardware

    h100 = resolve_hardware("H100-SXM")
    helper = [dict(r, moe_dtype="int4_wo") for r in mxfp4_rows("vllm_marlin_int4_moe", 9.0)]
    marlin = [dict(r, moe_dtype="int4_wo") for r in marlin_rows(2048, 1024, 4, 512, {1: 0.03, 8: 0.1, 64: 0.6})]
    table = layout("0.24.0", "the newest", helper + marlin)
    served = dispatched_moe_kernel("int4_wo", 90)
    _, _, (kernel, _, _), why = pick_moe_curve([table], mxfp4_shape(moe_dtype="int4_wo"), False, served, h100)
    assert kernel == "vllm_w4a16mxfp4moe_marlin_marlinexperts" and "measured at no version at this shape" in why
    _, _, (kernel, _, _), _ = pick_moe_curve([table], mxfp4_shape(moe_dtype="int4_wo"), False, served)
    assert kernel == "vllm_marlin_int4_moe"


def test_the_clis_moe_kernel_choices_are_the_cost_models():
    from backends.costmodel.optables.moe import MOE_KERNELS
    from sim.app.options import MOE_KERNEL_CHOICES

    assert MOE_KERNEL_CHOICES == MOE_KERNELS


def test_moe_kernel_applies_only_to_a_table_priced_moe_layer(capsys):
    code = main(["replay", "traces/samples/azure_conv_2023_first5min.csv", "--moe-kernel", "marlin",
                 "--out", "/nonexistent/never-written"])
    err = capsys.readouterr().err
    assert code == 2 and "--moe-kernel marlin prices a mixture of experts' fused-MoE layer" in err
    assert "Llama-3.1-8B" in err and "Traceback" not in err


def test_gpt_oss_on_h100_with_marlin_is_marlins_rows_carried_and_says_so(package, tmp_path):
    from backends.costmodel.optables.moe import moe_table_model
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    args = (resolve_model("gpt-oss-120b"), resolve_hardware("H100-SXM"), "h100_sxm", package / "data")
    triton = moe_table_model(*args, tp=2)
    marlin = moe_table_model(*args, tp=2, moe_kernel="marlin")
    assert "oaitriton" in triton.sources["moe"]
    assert "_marlin_" in marlin.sources["moe"] and "at the same tokens per expert" in marlin.sources["moe"]
    # Marlin's floor (its least measured layer, 39 us on H100) and its prefill, slower than Triton's
    assert marlin.dense(1, 0)[2] >= 36 * 39e-6
    assert marlin.dense(8192, 0)[2] > 1.3 * triton.dense(8192, 0)[2]
    with pytest.raises(ServesimError, match="--moe-kernel 'cutlass'"):
        moe_table_model(*args, tp=2, moe_kernel="cutlass")
    # A kernel the tables measure nowhere for these experts is refused, never priced with another's rows.
    with pytest.raises(ServesimError, match="--moe-kernel flashinfer: no version of h100_sxm's moe_perf tables "
                                            "measures flashinfer for w4a16_mxfp4 experts at MoE TP 2, EP 1"):
        moe_table_model(*args, tp=2, moe_kernel="flashinfer")
    # summary.json says the kernel named, and a run of vLLM's default keeps its summary
    for kernel in ("marlin", "auto"):
        out = tmp_path / kernel
        assert main(["replay", "traces/samples/azure_conv_2023_first5min.csv", "--model", "gpt-oss-120b",
                     "--hardware", "H100-SXM", "--tp", "2", "--moe-kernel", kernel, "--out", str(out)]) == 0
        options = json.loads((out / "summary.json").read_text())["options"]
        assert options.get("moe_kernel") == (None if kernel == "auto" else "marlin")
        assert ("_marlin_" in options["cost_model"]["operators"]["moe"]) == (kernel == "marlin")


def test_mxfp4_weights_with_mxfp8_activations_are_read_as_mxfp4_and_computed_at_the_fp8_peak():
    from backends.hardware import resolve_hardware

    b200 = resolve_hardware("b200_sxm")
    w4a16, w4a8 = mxfp4_shape(moe_tp_size=2), mxfp4_shape(moe_tp_size=2, moe_dtype="w4a8_mxfp4_mxfp8")
    # One token: bound by the weights' bytes, the same MXFP4 bytes either way.
    assert moe_layer_roofline(b200, w4a8, [1])[0] == moe_layer_roofline(b200, w4a16, [1])[0]
    # 65,536 tokens: bound by the FLOPs, at the fp8 peak with MXFP8 activations (960 FLOPs a byte of
    # activations, past B200's 584 at the fp8 peak).
    flops = 6.0 * 65536 * 4 * 2880 * 1440
    assert moe_layer_roofline(b200, w4a8, [65536])[0] == pytest.approx(flops / b200.peak_flops("fp8"), rel=1e-12)
    assert moe_layer_roofline(b200, w4a16, [65536])[0] == pytest.approx(flops / b200.peak_flops("bf16"), rel=1e-12)


def test_gpt_oss_on_b200_with_flashinfers_mxfp8_kernel_is_its_rows_carried_and_other_experts_are_refused(package):
    """InferenceX's gpt-oss B200 script sets VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1: the MXFP4 experts
    run with MXFP8 activations, a kernel the tables measure (moe_dtype w4a8_mxfp4_mxfp8) at other
    models' shapes only."""
    from backends.costmodel.optables.moe import moe_table_model
    from backends.hardware import resolve_hardware
    from backends.model_config import resolve_model

    hardware = resolve_hardware("b200_sxm")
    ops = moe_table_model(resolve_model("gpt-oss-120b"), hardware, "b200_sxm", package / "data", tp=2,
                          moe_kernel="flashinfer-mxfp8")
    assert "mxfp4_mxfp8" in ops.sources["moe"] and "w4a8_mxfp4_mxfp8" in ops.sources["moe"]
    assert "measured at no version at this shape" in ops.sources["moe"]
    with pytest.raises(ServesimError, match="--moe-kernel flashinfer-mxfp8: no version of b200_sxm's moe_perf "
                                            "tables measures mxfp4_mxfp8 for bfloat16 experts"):
        moe_table_model(resolve_model("Qwen3-30B-A3B"), hardware, "b200_sxm", package / "data", tp=1,
                        moe_kernel="flashinfer-mxfp8")


def test_a_layout_no_version_measures_is_carried_from_the_nearest_measured_one_not_the_roofline():
    """Block fp8 at MoE TP 4 of this shape, measured at MoE TP 1 only (two kernels, Triton the one vLLM
    runs under TP) and at TP 2 of a far smaller shape: the layer is Triton's TP 1 curve carried by the
    two layouts' rooflines (the nearest layout in per-GPU expert size: inter / 4 against inter / 1 is
    nearer than the small shape), as an unmeasured shape is. Without hardware to carry on, the roofline's
    reason, as before."""
    from backends.hardware import resolve_hardware

    h100 = resolve_hardware("H100-SXM")
    rows = moe_frame()
    far = rows[rows["kernel_source"].str.contains("fp8moe_triton") & (rows["moe_ep_size"] == 1)].assign(
        hidden_size=512, inter_size=128, moe_tp_size=2, seconds=lambda f: f["seconds"] * 0.1)
    table = layout("0.24.0", "the newest", pd.concat([rows, far]).to_dict("records"))
    target = shape(moe_tp_size=4)
    t, priced, (kernel, xs, ys), why = pick_moe_curve([table], target, False, None, h100)
    assert priced == target and kernel == "vllm_fp8moe_triton_tritonexperts"
    assert "no moe_perf rows at MoE TP 4, EP 1" in why and "MoE TP 1 EP 1" in why and "inter 1536" in why
    source = shape()
    floor = 0.1 * 0.05e-3  # the least any row of the kernel measures: the small shape's one token
    measured = {1: 0.05e-3, 8: 0.07e-3, 64: 0.2e-3}
    assert xs.tolist() == [1, 8, 64]
    for x, y in zip(xs, ys):
        work = (measured[int(x)] - floor) / moe_layer_roofline(h100, source, [x])[0]
        assert y == pytest.approx(floor + work * moe_layer_roofline(h100, target, [x])[0], rel=1e-12)
    # Not carried across dtypes: bf16 at TP 4 has no bf16 source at a layout of its own dtype but TP 1's.
    assert "MoE TP 1 EP 1" in pick_moe_curve([table], shape(moe_tp_size=4, moe_dtype="bfloat16",
                                                            distribution="power_law_1.2"), False, None, h100)[3]
    assert isinstance(pick_moe_curve([table], shape(moe_dtype="int4_wo"), False, None, h100), str)
    assert isinstance(pick_moe_curve([table], target, False, None), str)
