"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the configs, the KV cache and weights as vLLM
0.33 allocates them, the block size it takes, and the layer priced by the roofline and by the
tables' DSA module rows (backends/model_config.py, backends/costmodel/roofline.py
`_sparse_attention_one_layer`, backends/costmodel/optables/mla.py DSA_TABLES). Layers that share an
earlier layer's top-k (GLM-5.2): tests/test_index_cache.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from backends.costmodel.roofline import MoERooflineCostModel, window_pairs
from backends.hardware import HARDWARE
from backends.kv_capacity import vllm_kv_cache
from backends.model_config import ModelConfig, linear_bytes
from sim.errors import ServesimError
from tests.helpers import one_error_line, sim
from tests.package_configs import CONFIGS, package, write

ROOT = Path(__file__).resolve().parents[1]
V32, GLM5 = "deepseek-ai--DeepSeek-V3.2", "zai-org--GLM-5-FP8"






def test_the_configs_as_vllm_reads_them():
    v32, glm = package(V32), package(GLM5)
    assert (v32.model_type, v32.index_topk, v32.index_n_heads, v32.index_head_dim) == ("deepseek_v32", 2048, 64, 128)
    assert (glm.model_type, glm.index_topk, glm.index_n_heads, glm.index_head_dim) == ("glm_moe_dsa", 2048, 32, 128)
    # DeepSeek-V3's MoE and MLA around the indexer; GLM-5's wider heads (192 + 64 for q and k, 256 for v).
    assert (v32.num_experts, v32.first_k_dense_replace, v32.kv_lora_rank, v32.head_dim) == (256, 3, 512, 192)
    assert (glm.num_hidden_layers, glm.head_dim, glm.v_head_dim, glm.q_lora_rank) == (78, 256, 256, 2048)
    assert v32.weight_dtype == glm.weight_dtype == "fp8-block"


def test_kv_cache_per_token_and_block_as_vllm_allocates_it():
    """One token of a layer: the MLA latent (576 values: bf16 1152 bytes, or FlashMLA's 656-byte
    fp8_ds_mla row) and the indexer's key (132 bytes), in one KV cache group of every layer
    (UniformTypeKVCacheSpecs), the same on every TP GPU."""
    v32, glm = package(V32), package(GLM5)
    assert v32.kv_bytes_per_token() == v32.kv_bytes_per_token(tp=8) == 61 * (1152 + 132) == 78324
    assert v32.kv_bytes_per_token(kv_cache_dtype="fp8") == 61 * (656 + 132) == 48068
    assert glm.kv_bytes_per_token() == 78 * 1284 == 100152
    available = 40 * 2**30
    v = vllm_kv_cache(v32, available, block_size=64, max_model_len=163840, max_in_flight_tokens=8192, tp=8)
    assert v["bytes_per_block"] == 64 * 78324 == 5012736 and v["num_blocks"] == available // 5012736
    assert [g["num_layers"] for g in v["groups"]] == [61]


def test_the_indexer_weights_are_on_every_gpu():
    v32 = package(V32)
    dense = replace(v32, index_topk=0, index_n_heads=0, index_head_dim=0)
    for tp in (1, 8):
        extra = v32.weight_bytes_by_part(tp=tp)["attention"] - dense.weight_bytes_by_part(tp=tp)["attention"]
        # wq_b [1536 -> 64 x 128] in block fp8; wk and weights_proj fused [7168 -> 128 + 64] in bf16; k_norm fp32
        per_layer = linear_bytes(1536, 64 * 128, "fp8-block") + 7168 * (128 + 64) * 2 + 2 * 128 * 4
        assert extra == 61 * per_layer


def test_vllm_takes_64_token_blocks_only(tmp_path, capsys):
    trace = ROOT / "traces/samples/azure_conv_2023_first5min.csv"
    assert sim("replay", trace, "--model", "deepseek-ai/DeepSeek-V3.2", "--hardware", "h200_sxm", "--tp", "8",
               "--limit", "5", "--out", tmp_path / "a") == 2
    line = one_error_line(capsys)
    assert line.startswith("--block-size 16: vLLM serves deepseek-ai/DeepSeek-V3.2's DeepSeek sparse attention "
                           "with 64-token blocks only") and line.endswith("pass --block-size 64")
    out = tmp_path / "b"
    assert sim("replay", trace, "--model", "deepseek-ai/DeepSeek-V3.2", "--hardware", "h200_sxm", "--tp", "8",
               "--block-size", "64", "--limit", "40", "--out", out, "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 40 and summary["kv_cache"]["block_bytes"] == 5012736
    assert summary["options"]["cost_model"]["operators"]["attention"].startswith("DSA module tables")


# The roofline's sparse layer.


def roofline(model: ModelConfig) -> MoERooflineCostModel:
    return MoERooflineCostModel(model, HARDWARE["H200"], tp=8, dtype="fp8")


def test_sparse_layers_attend_index_topk_keys_and_score_every_one():
    v32 = package(V32)
    dense = replace(v32, index_topk=0, index_n_heads=0, index_head_dim=0)
    sparse, mla = roofline(v32), roofline(dense)
    assert not sparse.decodes_from_sums
    # A prefill within index_topk is vLLM's dense MHA prefill, without the indexer.
    for q, c in ((1000, 1000), (512, 2048)):
        assert sparse._attention_one_layer(q, c, None) == mla._attention_one_layer(q, c, None)
    # Past it, MLA attends index_topk keys a token and the indexer scores them all: a long decode
    # is cheaper than dense MLA's, and its attention part stops growing with the context.
    long = sparse._attention_one_layer(1, 131072, None)
    assert long < mla._attention_one_layer(1, 131072, None)
    assert window_pairs(1, 131072, v32.index_topk) == window_pairs(1, 4096, v32.index_topk) == 2048
    grows = sparse._attention_one_layer(1, 131072, None) - sparse._attention_one_layer(1, 65536, None)
    assert grows > 0  # the indexer's keys, 132 bytes each
    assert grows == pytest.approx(65536 * (132 + 8) / sparse._bytes_s, rel=0.01)


# The tables' DSA module rows.


@pytest.fixture(scope="module")
def data():
    from backends.costmodel.optables.systems import require_package

    return require_package() / "data"


def test_a_decode_is_the_dsa_row_on_grid_points(data):
    from backends.costmodel.optables.mla import mla_module, read_mla_tables
    from backends.costmodel.optables.systems import read_layout_table

    tables = read_mla_tables(data, "h200_sxm", None, sparse=True)
    module = mla_module(tables, package(V32), 16, "fp8-block", "auto")
    assert not isinstance(module, str) and module.source.startswith("DSA module tables")
    g = read_layout_table(data, "h200_sxm", "sparse_attention", "vllm", "dsa_generation_module_perf", None).frame
    row = g[(g.model == "deepseek-ai/DeepSeek-V3.2") & (g.num_heads == 16) & (g.gemm_type == "fp8_block")
            & (g.kv_cache_dtype.astype(str) == "bfloat16") & (g.batch_size == 8) & (g.step == 4096)]
    t, scaled = module.decodes(8, 4097)  # the row's step is the context before the decoded token
    assert not scaled and t == pytest.approx(row.latency.iloc[0] / 1e3, rel=1e-9)


def test_dense_and_sparse_mla_never_borrow_each_others_rows(data):
    from backends.costmodel.optables.mla import mla_module, read_mla_tables

    v32 = package(V32)
    dense = replace(v32, index_topk=0, index_n_heads=0, index_head_dim=0)
    said = mla_module(read_mla_tables(data, "h200_sxm", None), v32, 16, "fp8-block", "auto")
    assert said == "the MLA module tables price dense MLA layers, not this model's sparse ones"
    said = mla_module(read_mla_tables(data, "h200_sxm", None, sparse=True), dense, 16, "fp8-block", "auto")
    assert said == "the DSA module tables price sparse MLA layers, not this model's dense ones"


def test_sparse_attention_needs_mla(tmp_path):
    raw = json.loads((CONFIGS / f"{V32}_config.json").read_text())
    for drop in ("index_n_heads", "index_head_dim", "kv_lora_rank"):
        folder = write(tmp_path, {k: v for k, v in raw.items() if k != drop})
        with pytest.raises(ServesimError) as e:
            ModelConfig.from_hf(folder)
        assert drop in str(e.value) and str(folder / "config.json") in str(e.value)
    with pytest.raises(ServesimError, match="index_topk = 0"):
        ModelConfig.from_hf(write(tmp_path, {**raw, "index_topk": 0}))


def test_a_steps_prefills_are_dense_or_sparse_together_as_vllm_decides():
    """vLLM decides dense MHA prefill per step, on the longest prefill's sequence
    (`_use_dense_mha_prefill`), and its indexer scores a dense prefill's keys where the step has
    decodes: a short prefill beside a long one is sparse, beside a decode it is scored."""
    from backends.costmodel.frame import batch_aggregates

    v32 = package(V32)
    r = roofline(v32)
    layers = v32.num_hidden_layers

    def attention(scheduled, computed):
        agg, chunks = batch_aggregates(scheduled, computed, len(scheduled), every_request=True)
        return r.parts(agg, chunks, r._dense(agg.num_tokens, agg.num_logits))["attention"]

    sparse, dense = r._sparse_attention_one_layer, r._attention_one_layer
    assert attention([512], [512]) == pytest.approx(layers * dense(512, 1024, None))
    assert attention([512, 2000], [512, 2096]) == pytest.approx(layers * (sparse(512, 1024) + sparse(2000, 4096)))
    assert attention([512, 1], [512, 2999]) == pytest.approx(
        layers * (dense(512, 1024, None) + r._indexer_one_layer(512, 1024) + sparse(1, 3000)))


def test_index_head_dim_must_be_whole_blocks_of_128(tmp_path):
    """vLLM's indexer keeps fp8 keys with one fp32 scale a block of 128 values: any other width has
    no cache row vLLM's kernels write (132 bytes for 128)."""
    raw = json.loads((CONFIGS / f"{V32}_config.json").read_text())
    for width in (64, 192):
        folder = write(tmp_path, {**raw, "index_head_dim": width})
        with pytest.raises(ServesimError) as e:
            ModelConfig.from_hf(folder)
        assert f"index_head_dim = {width}: vLLM's indexer quantizes its keys in blocks of 128" in str(e.value)
    assert ModelConfig.from_hf(write(tmp_path, {**raw, "index_head_dim": 256})).indexer_key_bytes == 264


def test_sparse_models_take_no_sliding_window(tmp_path):
    """vLLM's DeepSeek layers (deepseek_v2.py, deepseek_v32/) have no window: a config's
    sliding_window or sliding layer_types would have priced windows vLLM never applies."""
    raw = json.loads((CONFIGS / f"{V32}_config.json").read_text())
    with pytest.raises(ServesimError, match="sliding_window = 4096: vLLM's deepseek_v32 layers attend the whole"):
        ModelConfig.from_hf(write(tmp_path, {**raw, "sliding_window": 4096}))
    glm = json.loads((CONFIGS / f"{GLM5}_config.json").read_text())
    with pytest.raises(ServesimError, match="sliding_window = 128: vLLM's glm_moe_dsa layers"):
        ModelConfig.from_hf(write(tmp_path, {**glm, "sliding_window": 128,
                                              "layer_types": ["sliding_attention"] * glm["num_hidden_layers"]}))
    assert ModelConfig.from_hf(write(tmp_path, {**glm, "layer_types": ["full_attention"] * 78})).index_topk == 2048


def test_sim_validate_simulates_a_glm5_row_with_64_token_blocks(tmp_path):
    """`sim validate` has no --block-size: a sparse model's rows were all skipped with the plan's
    "pass --block-size 64"; it now takes vLLM's 64-token blocks for them."""
    import csv

    sample = CONFIGS.parent / "systems" / "silicon_sample.csv"
    with sample.open() as f:
        reader = csv.DictReader(f)
        row = next(r for r in reader if r["model_path"] == "zhipuai/GLM-5" and r["system"] == "h200_sxm"
                   and r["mode"] == "agg")
    measured = tmp_path / "glm5.csv"
    with measured.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    models = tmp_path / "models" / "zhipuai" / "GLM-5"
    models.mkdir(parents=True)
    (models / "config.json").write_text((CONFIGS / f"{GLM5}_config.json").read_text())
    out = tmp_path / "v"
    assert sim("validate", measured, "--jobs", "1", "--models", tmp_path / "models", "--prompts-per-client", "1",
               "--out", out, "--quiet") == 0
    result = json.loads((out / "validate.json").read_text())
    assert result["skipped"] == [] and result["all"]["rows"] == 1


def test_glm5_on_blackwell_serves_an_fp8_cache_for_auto():
    """vLLM's GlmMoeDsaForCausalLM config (vllm/model_executor/models/config.py) sets fp8_e4m3 for
    auto on SM 10x; DeepSeek-V3.2 keeps bf16; an asked dtype stays."""
    from backends.model_config import served_kv_cache_dtype

    glm, v32 = package("zai-org--GLM-5"), package(V32)
    assert served_kv_cache_dtype(glm, "auto", "b200_sxm") == served_kv_cache_dtype(glm, "auto", "GB300") == "fp8"
    assert served_kv_cache_dtype(glm, "auto", "h200_sxm") == "auto"
    assert served_kv_cache_dtype(v32, "auto", "b200_sxm") == "auto"
    assert served_kv_cache_dtype(glm, "fp8", "h100_sxm") == "fp8"


def test_a_steps_prefills_are_one_batch_of_the_dsa_module(data):
    """As the MLA module prices a step's chunks (one batch of n, mla.MLAModule.chunks), so does the
    DSA module, though a sparse model's decodes are priced request by request."""
    from backends.costmodel.frame import batch_aggregates
    from backends.costmodel.optables.moe import moe_table_model

    cm = moe_table_model(package(V32), HARDWARE["H200"], "h200_sxm", data, tp=8, dtype="fp8")
    assert not cm.decodes_from_sums and cm._mla is not None
    chunks_in = [(1, 3000), (1, 5000), (512, 512), (1024, 4096)]
    agg, chunks = batch_aggregates([q for q, _ in chunks_in], [c - q for q, c in chunks_in], 4, every_request=True)
    parts = cm.parts(agg, chunks, cm._dense(agg.num_tokens, agg.num_logits))
    module, _ = cm._mla.chunks([(512, 512), (1024, 4096)])
    decodes, _ = cm._mla.decodes(2, 4000.0)
    assert parts["attention"] == pytest.approx(61 * (module + decodes), rel=1e-12)


def test_a_cell_missing_between_measured_batches_is_interpolated():
    """B200's DSA generation rows lack one cell (batch 4 at step 8): filled log-log between batches
    2 and 8 of its column, so the tables price the layer; cells past a column's last batch are
    left to fill_rows_by_scaling."""
    import numpy as np

    from backends.costmodel.optables.mla import fill_interior_cells

    grid = np.array([[1.0, 2.0], [np.nan, 3.0], [4.0, np.nan]])
    filled, count = fill_interior_cells(np.array([1.0, 2.0, 4.0]), grid)
    assert count == 1 and filled[1, 0] == pytest.approx(2.0) and np.isnan(filled[2, 1])


def test_b200s_dsa_rows_price_glm5(data):
    from backends.costmodel.optables.mla import mla_module, read_mla_tables

    module = mla_module(read_mla_tables(data, "b200_sxm", None, sparse=True), package(GLM5), 8, "fp8-block", "fp8")
    assert not isinstance(module, str) and module.source.startswith("DSA module tables")
