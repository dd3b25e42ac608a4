"""MLA attention (DeepSeek-V3, Kimi K2) priced from the MLA module tables (backends/costmodel/optables/mla.py).

The first tests run anywhere, on the tiny fixture in the package's layout (tests/data/aic_layout: tiny_gpu's
mla/vllm/0.20.0 tables with closed-form times from tests/optables_fixture.py, and the two checkpoints'
config.json in model_configs/): lookups exact on grid points, prefill chunks as one batch with the prefix
correction, the operators the module holds left out of the others, and every fallback to the roofline with
its reason. The last ones need the tables extra (aiconfigurator-core) and skip where it is absent.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest

from backends.costmodel.frame import batch_aggregates
from backends.costmodel.optables.mla import MLA_SHAPE, model_shape, read_mla_tables
from backends.costmodel.optables.moe import MoETableCostModel
from backends.costmodel.optables.tables import load_layout, read_frame
from backends.costmodel.roofline import MoERooflineCostModel
from backends.hardware import resolve_hardware
from backends.model_config import resolve_model
from sim.app.cli import main
from tests.optables_fixture import TINY_MLA, gemm_ms, mla_ctx_ms, mla_frames, mla_gen_ms

LAYOUT = Path(__file__).parent / "data" / "aic_layout"
DATA = LAYOUT / "systems" / "data"
CONFIG = LAYOUT / "model_configs" / "test-org--Tiny-MLA_config.json"
LAYERS = TINY_MLA["num_hidden_layers"]


@pytest.fixture(autouse=True)
def _yaml():
    pytest.importorskip("yaml")  # the layout's reader (pyyaml comes with the tables extra)


def tiny(tp=1, kv_cache_dtype="auto", mla=True, model=None, dtype="bf16"):
    model = model or resolve_model(str(CONFIG))
    tables = load_layout(DATA, "tiny_gpu")
    mla_tables = read_mla_tables(DATA, "tiny_gpu", None) if mla else None
    return MoETableCostModel(model, resolve_hardware("H200"), tables, tp=tp, dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype, mla_tables=mla_tables)


def step_parts(cm, scheduled, computed):
    agg, chunks = batch_aggregates(scheduled, computed, len(scheduled))
    return cm.parts(agg, chunks, cm._dense(agg.num_tokens, agg.num_logits))


def test_the_fixture_holds_the_closed_forms():
    for table, frame in mla_frames().items():
        read = read_frame(DATA / "tiny_gpu" / "mla" / "vllm" / "0.20.0" / f"{table}.csv", table)
        assert read["latency"].tolist() == frame["latency"].tolist()
        assert (read["seconds"] == read["latency"] * 1e-3).all()
    tables = read_mla_tables(DATA, "tiny_gpu", "0.24.0")
    assert tables.context.version == "0.20.0" and "the nearest to 0.24.0" in tables.context.how
    assert tables.shapes["test-org/Tiny-MLA"] == model_shape(TINY_MLA)
    assert dict(zip(MLA_SHAPE, tables.shapes["test-org/Other-MLA"]))["kv_lora_rank"] == 64


def test_decodes_are_the_generation_table_on_grid_points():
    cm = tiny()
    # Two decodes whose sequences are 16 tokens (the decoded one counted): the row batch 2, step 16, 4 heads.
    parts = step_parts(cm, [1, 1], [15, 15])
    assert parts["attention"] == LAYERS * mla_gen_ms(2, 16, 4) * 1e-3
    # A decode run: the same lookups, step by step (fast-forward's costs equal execute's).
    seconds, run = cm.decode_run([16, 16], 3)
    assert run["attention"][0] == parts["attention"]
    assert run["attention"][2] == pytest.approx(LAYERS * mla_gen_ms(2, 18, 4) * 1e-3, rel=0.02)  # between 16 and 256
    assert "attention" not in cm.extrapolated


def test_prefill_chunks_are_the_context_table_as_one_batch():
    cm = tiny()
    ctx = lambda b, s: mla_ctx_ms(b, s, 4) * 1e-3  # noqa: E731
    assert step_parts(cm, [64], [0])["attention"] == LAYERS * ctx(1, 64)  # a grid point: exactly the row
    assert step_parts(cm, [64, 64], [0, 0])["attention"] == LAYERS * ctx(2, 64)  # two equal chunks: the batch of 2
    # After a prefix of 192: the row of the full 256 tokens x (256^2 - 192^2) / 256^2 (AIConfigurator's correction).
    assert step_parts(cm, [64], [192])["attention"] == pytest.approx(LAYERS * ctx(1, 256) * (256**2 - 192**2) / 256**2,
                                                                     rel=1e-15)
    # Chunks of different lengths: each a 1/n share of the batch of n at its own length.
    assert step_parts(cm, [16, 64], [0, 0])["attention"] == pytest.approx(LAYERS * (ctx(2, 16) + ctx(2, 64)) / 2,
                                                                          rel=1e-15)
    # A mixed step: the decodes' lookup plus the chunks'.
    mixed = step_parts(cm, [1, 1, 64], [15, 15, 0])["attention"]
    assert mixed == pytest.approx(LAYERS * (mla_gen_ms(2, 16, 4) * 1e-3 + ctx(1, 64)), rel=1e-15)


def test_past_the_grid_is_scaled_and_counted():
    cm = tiny()
    # 1024 tokens past the context grid's 256: the square of the length (causal attention), counted.
    assert step_parts(cm, [1024], [0])["attention"] == pytest.approx(LAYERS * mla_ctx_ms(1, 256, 4) * 1e-3 * 16,
                                                                     rel=1e-12)
    assert cm.extrapolated["attention"] == 1
    assert cm.cost_model_summary()["scaled_past_grid"]["attention"] == 1


def test_kv_dtype_and_tp_pick_their_rows():
    fp8 = tiny(kv_cache_dtype="fp8")
    assert step_parts(fp8, [1], [15])["attention"] == LAYERS * mla_gen_ms(1, 16, 4, "fp8") * 1e-3
    assert "generation FLASHMLA" in fp8.sources["attention"] and "fp8 KV" in fp8.sources["attention"]
    tp2 = tiny(tp=2)  # 2 heads a GPU
    assert step_parts(tp2, [1, 1], [15, 15])["attention"] == LAYERS * mla_gen_ms(2, 16, 2) * 1e-3
    assert "2 heads a GPU" in tp2.sources["attention"]
    # The rows of another checkpoint (kv_lora_rank 64, three times the times) are never read.
    assert "test-org/Other-MLA" not in tiny().sources["attention"]


def test_what_the_module_holds_is_not_counted_again():
    model = resolve_model(str(CONFIG))
    cm, roof = tiny(), MoERooflineCostModel(model, resolve_hardware("H200"))
    t = 64
    linear, router, moe, kv_write, elementwise, lm_head, allreduce = cm.dense(t, 1)
    r_linear, r_router, r_moe, r_kv_write, r_elementwise, r_lm_head, _ = roof.dense(t, 1)
    # Its projections (and decode's W_UK / W_UV), KV-cache write and RoPE are in the module's time.
    assert linear == pytest.approx(r_linear - LAYERS * roof._attention_linear(t), rel=1e-12) and linear > 0
    assert kv_write == 0.0 and r_kv_write > 0
    rope = LAYERS * t * 2 * 2 * (4 + 1) * TINY_MLA["qk_rope_head_dim"] / roof._bytes_s
    # The small kernels as the dense operator model prices them: the roofline's bytes at the GEMM
    # table's bandwidth and each kernel's floor (the table's shortest GEMM), the sampler's three passes
    # over the fp32 logits; the router and the LM head from the bf16 GEMM rows.
    floor, bandwidth, routing_in_table = cm._small
    assert floor == gemm_ms(1, 64, 64, "fp8") * 1e-3 and not routing_in_table  # the shortest GEMM of the table
    # two add+RMSNorms a layer (RoPE is the module's), the dense layer's SiLU-and-mul, the MoE layer's
    # top-k and its shared expert's SiLU-and-mul, the embedding and the final norm
    kernels = LAYERS * 2 + 1 + 2 + 2
    sampler = 3 * (floor + 1 * TINY_MLA["vocab_size"] * 4 / bandwidth)
    assert elementwise == pytest.approx((r_elementwise - rope) * roof._bytes_s / bandwidth + kernels * floor + sampler,
                                        rel=1e-12)
    assert r_elementwise > 0 and r_router > 0 and r_lm_head > 0
    assert router == gemm_ms(t, 64, 128) * 1e-3  # one MoE layer; 4 experts clamped up to the grid's n = 64
    assert lm_head == gemm_ms(1, TINY_MLA["vocab_size"], 128) * 1e-3
    ops = cm.cost_model_summary()["operators"]
    assert ops["overhead"].startswith("none") and cm.parts(*batch_aggregates([1], [15], 1), cm._dense(1, 1))["overhead"] == 0
    assert ops["attention"].startswith("MLA module tables mla_context_module_perf.csv, mla_generation_module_perf.csv "
                                       "vLLM 0.20.0 (the newest)")
    assert ops["kv_write"].startswith("in attention") and ops["linear"].startswith("roofline: the dense MLPs")


@pytest.mark.parametrize("how, says", [
    (dict(mla=False), "roofline: MLA (tiny_gpu has no MLA module tables for vLLM)"),
    (dict(tp=4), "no MLA module rows at 1 heads a GPU (num_heads there: 2, 4)"),
    (dict(model="kv_lora_rank"), "the MLA module tables measured test-org/Other-MLA"),
])
def test_what_the_tables_lack_stays_the_roofline_and_says_why(how, says):
    if how.get("model"):
        how = dict(model=dataclasses.replace(resolve_model(str(CONFIG)), kv_lora_rank=48))
    cm = tiny(**how)
    ops = cm.cost_model_summary()["operators"]
    assert ops["attention"].startswith("roofline: MLA (") and says in ops["attention"]
    assert ops["linear"].startswith("roofline: MLA's projections") and ops["kv_write"].startswith("each kernel")
    roof = MoERooflineCostModel(cm.model, resolve_hardware("H200"), tp=cm.tp)
    for scheduled, computed in (([1, 1], [15, 15]), ([64], [192])):
        assert step_parts(cm, scheduled, computed)["attention"] == step_parts(roof, scheduled, computed)["attention"]
    # the KV-cache write is the roofline's bytes at the table's bandwidth, and a kernel a layer
    floor, bandwidth, _ = cm._small
    assert cm.dense(64, 1)[0] == roof.dense(64, 1)[0]
    assert cm.dense(64, 1)[3] == pytest.approx(roof.dense(64, 1)[3] * roof._bytes_s / bandwidth + LAYERS * floor,
                                               rel=1e-12)


def test_projections_in_a_dtype_the_tables_lack():
    model = dataclasses.replace(resolve_model(str(CONFIG)), weight_dtype="fp8-block")
    ops = tiny(model=model).cost_model_summary()["operators"]
    assert "no MLA module rows with fp8-block projections (gemm_type there: bfloat16)" in ops["attention"]


# ---- against the tables package (skipped without it)


@pytest.fixture(scope="module")
def package():
    pytest.importorskip("aiconfigurator_core")
    from backends.costmodel.optables.systems import require_package

    return require_package()


def rows(package, table, **where):
    from backends.costmodel.optables.systems import read_layout_table

    f = read_layout_table(package / "data", "h200_sxm", "mla", "vllm", table, None).frame
    keep = (f["mla_dtype"] == "bfloat16")
    for k, v in where.items():
        keep &= f[k] == v
    return f[keep]


def test_deepseek_v3_on_h200_is_the_measured_row_on_grid_points(package):
    from backends.costmodel.optables.moe import moe_table_model

    cm = moe_table_model(resolve_model("DeepSeek-V3"), resolve_hardware("H200"), "h200_sxm", package / "data", tp=8)
    gen = rows(package, "mla_generation_module_perf", gemm_type="fp8_block", kv_cache_dtype="bfloat16", num_heads=16,
               batch_size=64, step=2048)
    assert len(gen) == 1 and gen["kernel_source"].iloc[0] == "FLASH_ATTN_MLA"
    # 64 decodes of 2,048-token sequences: 61 layers x the row's latency in seconds.
    assert step_parts(cm, [1] * 64, [2047] * 64)["attention"] == 61 * gen["seconds"].iloc[0]
    ctx = rows(package, "mla_context_module_perf", gemm_type="fp8_block", kv_cache_dtype="bfloat16", num_heads=16,
               batch_size=1, isl=4096)
    assert len(ctx) == 1 and ctx["kernel_source"].iloc[0] == "FLASH_ATTN"
    assert step_parts(cm, [4096], [0])["attention"] == 61 * ctx["seconds"].iloc[0]
    assert not cm.extrapolated


def test_kimi_k2_reads_deepseek_v3s_rows_at_its_own_heads(package):
    from backends.costmodel.optables.moe import moe_table_model

    kimi = resolve_model(str(package.parent / "model_configs" / "moonshotai--Kimi-K2-Instruct_config.json"))
    cm = moe_table_model(kimi, resolve_hardware("H200"), "h200_sxm", package / "data", tp=8)
    gen = rows(package, "mla_generation_module_perf", gemm_type="fp8_block", kv_cache_dtype="bfloat16", num_heads=8,
               batch_size=16, step=1024)
    assert "8 heads a GPU" in cm.sources["attention"] and "deepseek-ai/DeepSeek-V3 rows" in cm.sources["attention"]
    assert step_parts(cm, [1] * 16, [1023] * 16)["attention"] == kimi.num_hidden_layers * gen["seconds"].iloc[0]


def test_a_replay_of_deepseek_v3_on_h200_sxm_names_the_mla_tables(package, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,3000,20\n0.01,200,10\n0.02,900,5\n")
    assert main(["replay", str(trace), "--model", "DeepSeek-V3", "--hardware", "h200_sxm", "--tp", "8",
                 "--out", str(tmp_path / "run"), "--quiet"]) == 0
    ops = json.loads((tmp_path / "run" / "summary.json").read_text())["options"]["cost_model"]["operators"]
    assert ops["attention"].startswith("MLA module tables mla_context_module_perf.parquet, "
                                       "mla_generation_module_perf.parquet vLLM 0.24.0 (the newest)")
    assert "16 heads a GPU, fp8_block GEMMs, bfloat16 KV" in ops["attention"]
    assert ops["kv_write"].startswith("in attention") and ops["moe"].startswith("moe_perf vLLM 0.24.0")


@pytest.mark.slow
def test_a_replay_of_another_mla_shape_falls_back_and_says_so(package, tmp_path):
    # The tiny MLA checkpoint on h200_sxm: the package measured DeepSeek-V3's shape only.
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,300,20\n")
    assert main(["replay", str(trace), "--model", str(CONFIG), "--hardware", "h200_sxm",
                 "--out", str(tmp_path / "run"), "--quiet"]) == 0
    ops = json.loads((tmp_path / "run" / "summary.json").read_text())["options"]["cost_model"]["operators"]
    assert ops["attention"].startswith("roofline: MLA (the MLA module tables measured deepseek-ai/DeepSeek-V3 ")
    assert "'kv_lora_rank': 32" in ops["attention"] and "mla_context_module_perf.parquet" in ops["attention"]
    # Its experts are not in moe_perf either: carried from the nearest shape measured in their dtype
    # (the package's h200_sxm bf16 rows), and said (pick_moe_curve's last pass), not a crash.
    assert ops["moe"].startswith("moe_perf vLLM ") and "no moe_perf rows for hidden 128, inter 64" in ops["moe"]
    assert "the kernel's floor plus its work at hidden" in ops["moe"] and "bfloat16" in ops["moe"]


# ---- fast-forward's costs equal execute's, step by step (the engine relies on it)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sim.batch import Batch  # noqa: E402


@functools.lru_cache(maxsize=1)
def shared_tiny():
    return tiny()  # read once for the examples: a lookup's value does not depend on the ones before it


def batch(decodes, chunk=None):
    """Decodes whose sequences are `decodes` tokens after the step; a prefill chunk (q, computed) last."""
    b = Batch()
    for i, c in enumerate(decodes):
        b.add(str(i), c - 1, 1, [], needs_logits=True, is_decode=True)
    if chunk is not None:
        b.add("chunk", chunk[1], chunk[0], [], needs_logits=False)
    return b


@settings(max_examples=40, deadline=None)
@given(contexts=st.lists(st.integers(2, 400), min_size=1, max_size=12), steps=st.integers(1, 6),
       leave=st.lists(st.integers(1, 6), min_size=12, max_size=12))
def test_a_decode_run_costs_each_step_as_execute_does(contexts, steps, leave):
    cm = shared_tiny()
    active = [min(a, steps) for a in leave[:len(contexts)]]
    active[0] = steps  # one request runs the whole run
    run, parts = cm.decode_run(contexts, steps, active)
    for j in range(steps):
        alive = [c + j for c, a in zip(contexts, active) if a > j]
        assert cm.execute(batch(alive)).seconds == float(np.asarray(run)[j] if np.ndim(run) else run)


@settings(max_examples=30, deadline=None)
@given(decodes=st.lists(st.integers(2, 300), max_size=6), chunk=st.integers(2, 300), before=st.integers(0, 500),
       steps=st.integers(1, 4))
def test_chunk_steps_cost_each_step_as_execute_does(decodes, chunk, before, steps):
    cm = shared_tiny()
    seconds, _ = cm.chunk_steps([c - 1 for c in decodes], chunk, before, steps)
    for j in range(steps):
        assert cm.execute(batch([c + j for c in decodes], (chunk, before + chunk * j))).seconds == seconds[j]


# ---- rows collected before the collector's fix (mla.COLLECTOR_FIX)


def _copy_version(src: Path, dst: Path, meta: str | None) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "collection_meta.yaml":
            (dst / f.name).write_bytes(f.read_bytes())
    if meta is not None:
        (dst / "collection_meta.yaml").write_text(meta)


LEGACY = "schema_version: 1\nprovenance: legacy\ntables:\n  mla_context_module_perf:\n    status: complete\n" \
         "  mla_generation_module_perf:\n    status: complete\n"
FIXED = "schema_version: 1\ntables:\n  mla_context_module_perf:\n    collected_at: '2026-08-18'\n" \
        "  mla_generation_module_perf:\n    norm_dispatch: vllm_c_eager_surrogate\n"


def test_rows_collected_before_the_collectors_fix_yield_to_the_systems_own_fixed_ones(tmp_path):
    """A version whose MLA rows predate AIConfigurator's fused-op fix (its collection_meta.yaml has
    neither the fix's norm_dispatch nor a collected_at from 2026-07-27 on) yields to another version
    of the system collected with it, even one further from the version asked; rows without any
    collection_meta.yaml (a user's own tables) are taken as they are."""
    src = DATA / "tiny_gpu" / "mla" / "vllm" / "0.20.0"
    root = tmp_path / "data" / "tiny_gpu" / "mla" / "vllm"
    _copy_version(src, root / "0.20.0", LEGACY)
    _copy_version(src, root / "0.27.0", FIXED)
    tables = read_mla_tables(tmp_path / "data", "tiny_gpu", "0.20.0")
    assert tables.generation.version == tables.context.version == "0.27.0"
    assert tables.after_collector_fix and "predate AIConfigurator's fused-op collector fix" in tables.describe
    assert "tiny_gpu's vLLM 0.20.0" not in tables.describe and "tiny_gpu's rows (vLLM 0.20.0)" in tables.describe
    # Only legacy rows: taken as they are, and said.
    (root / "0.27.0" / "collection_meta.yaml").write_text(LEGACY)
    tables = read_mla_tables(tmp_path / "data", "tiny_gpu", "0.27.0")
    assert tables.generation.version == "0.27.0" and "taken as they are" in tables.describe
    # No collection_meta.yaml: as they are, nothing said.
    tables = read_mla_tables(DATA, "tiny_gpu", None)
    assert tables.after_collector_fix and tables.note == ""


def test_a_gpu_with_only_legacy_rows_takes_the_same_gpus_fixed_ones(package):
    """B300's only MLA rows (vLLM 0.24) predate the fix; GB300 (the same GPU, SM 103) has rows of
    vLLM 0.27 collected with it, which price B300. GB200's legacy rows yield to B200's re-collected
    ones (SM 100). H100 and H200 have none collected with it: their own, said."""
    from backends.costmodel.optables.mla import same_gpu_systems

    data = package / "data"
    b300 = read_mla_tables(data, "b300_sxm", "0.19.0")
    assert Path(b300.generation.path).parts[-5] == "gb300" and b300.generation.version == "0.27.0"
    assert "gb300's, the same GPU as b300_sxm" in b300.describe and "same_gpu" not in b300.describe
    assert "gb300" in same_gpu_systems(data, "b300_sxm") and "b200_sxm" not in same_gpu_systems(data, "b300_sxm")
    gb200 = read_mla_tables(data, "gb200", "0.24.0")
    assert Path(gb200.generation.path).parts[-5] == "b200_sxm"
    b200 = read_mla_tables(data, "b200_sxm", "0.24.0")
    assert Path(b200.generation.path).parts[-5] == "b200_sxm" and b200.note == ""
    h200 = read_mla_tables(data, "h200_sxm", None)
    assert Path(h200.generation.path).parts[-5] == "h200_sxm" and "taken as they are" in h200.describe
    # The fixed rows' decode module at small batch is B200-like, the legacy ones about twice it.
    g = b300.generation.frame
    small = g[(g.num_heads == 16) & (g.batch_size == 1) & (g.step == 2) & (g.kv_cache_dtype.astype(str) == "fp8")
              & (g.gemm_type == "bfloat16")]
    assert len(small) and small.latency.median() < 0.05


def test_a_gemm_grid_with_holes_leaves_the_router_and_lm_head_to_the_roofline_and_says_why():
    model = resolve_model(str(CONFIG))
    tables = load_layout(DATA, "tiny_gpu")
    g = tables.gemm
    holed = dataclasses.replace(tables, gemm=g[~((g["gemm_dtype"] == "bfloat16") & (g["n"] == 64) & (g["k"] == 128))])
    cm = MoETableCostModel(model, resolve_hardware("H200"), holed, mla_tables=read_mla_tables(DATA, "tiny_gpu", None))
    roof = MoERooflineCostModel(model, resolve_hardware("H200"))
    ops = cm.cost_model_summary()["operators"]
    assert ops["router"] == "roofline: the GEMM table has no rows for n = 64, k = 128 (needed for router)"
    assert ops["lm_head"].startswith("gemm_perf")  # its n = 512 is on the grid
    assert cm.dense(64, 1)[1] == roof.dense(64, 1)[1]  # the router: the roofline's
