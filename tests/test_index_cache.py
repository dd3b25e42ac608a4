"""Layers that share an earlier layer's top-k (IndexCache; GLM-5.2 and 5.3's index_topk_freq 4): which
layers run their own lightning indexer as vLLM 0.33 decides it, their KV cache and weights, and their
price on the roofline and from the tables' DSA module rows (backends/model_config.py `_indexer_types`,
backends/costmodel/roofline.py `_sparse_module_layers`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from backends.costmodel.roofline import MoERooflineCostModel
from backends.hardware import HARDWARE
from backends.kv_capacity import vllm_kv_cache
from backends.model_config import ModelConfig
from sim.errors import ServesimError
from tests.helpers import sim
from tests.package_configs import package, raw, write

ROOT = Path(__file__).resolve().parents[1]
GLM52, GLM5 = "zai-org--GLM-5.2-FP8", "zai-org--GLM-5-FP8"
# GLM-5.2's layers with an indexer of their own (vLLM: max(i - 3 + 1, 0) % 4 == 0), as its indexer_types says
OWN = (0, 1, 2, *range(6, 78, 4))


def all_own(model: ModelConfig) -> ModelConfig:
    return replace(model, indexer_types=())


def test_vllms_rule_picks_21_of_78_layers_as_the_config_says():
    glm = package(GLM52)
    assert glm.num_indexer_layers == len(OWN) == 21
    assert [i for i, t in enumerate(glm.indexer_types) if t == "full"] == list(OWN)
    assert list(glm.indexer_types) == raw(GLM52)["indexer_types"]
    assert package(GLM5).indexer_types == () and package(GLM5).num_indexer_layers == 78
    for name in ("zai-org--GLM-5.2", "zai-org--GLM-5.3", "zai-org--GLM-5.3-FP8", "nvidia--GLM-5.2-NVFP4"):
        assert package(name).num_indexer_layers == 21, name


def test_kv_cache_holds_an_indexer_key_only_where_a_layer_has_an_indexer():
    """Each layer's latent (1,152 bytes bf16, FlashMLA's 656-byte fp8_ds_mla row) and, in the 21 layers
    that build a DeepseekV32IndexerCache, its 132-byte key: one UniformTypeKVCacheSpecs group whose
    page is the sum of its layers' pages."""
    glm = package(GLM52)
    assert glm.kv_bytes_per_token() == glm.kv_bytes_per_token(tp=8) == 78 * 1152 + 21 * 132 == 92628
    assert glm.kv_bytes_per_token(kv_cache_dtype="fp8") == 78 * 656 + 21 * 132 == 53940
    v = vllm_kv_cache(glm, 40 * 2**30, block_size=64, max_model_len=200000, max_in_flight_tokens=8192, tp=8)
    assert v["bytes_per_block"] == 64 * 92628 and v["num_blocks"] == 40 * 2**30 // (64 * 92628)


def test_vllm_builds_no_indexer_weights_for_a_layer_that_shares():
    """The checkpoint ships every layer's indexer weights; vLLM loads only the 21 built ones
    (DeepseekV2ForCausalLM.load_weights, indexer_present_prefixes)."""
    glm = package(GLM52)
    per_layer = all_own(glm).weight_bytes_by_part(tp=8)["attention"] - glm.weight_bytes_by_part(tp=8)["attention"]
    # wq_b [2048 -> 32 x 128] block fp8 (128 x 128 fp32 scales); wk + weights_proj [6144 -> 128 + 32] bf16; k_norm
    indexer = 2048 * 4096 + 4 * 16 * 32 + 6144 * 160 * 2 + 2 * 128 * 4
    assert per_layer == 57 * indexer


@pytest.mark.parametrize("pattern,own", [
    ("FFS", [0, 1] + list(range(3, 10))),  # past the pattern's end a layer has its own
    (["F", "S", "S", "F", "S"], [0, 3] + list(range(5, 10))),
    ("FxSs", [0, 1, 3] + list(range(4, 10))),  # only "S" shares, as vLLM reads it (DeepSeek-V3.2's config)
])
def test_index_topk_pattern_as_vllm_reads_it(tmp_path, pattern, own):
    base = "deepseek-ai--DeepSeek-V3.2" if "x" in pattern else GLM5
    config = {**raw(base), "num_hidden_layers": 10, "index_topk_pattern": pattern}
    model = ModelConfig.from_hf(write(tmp_path, config))
    assert [i for i, t in enumerate(model.indexer_types) if t == "full"] == own


@pytest.mark.parametrize("freq,offset,own", [
    (2, None, [0, 1, 3, 5, 7, 9]),  # vLLM's default offset, 2
    (3, 1, [0, 3, 6, 9]),
    (1, 5, list(range(10))),
])
def test_index_topk_freq_and_offset_as_vllm_reads_them(tmp_path, freq, offset, own):
    config = {**raw(GLM5), "num_hidden_layers": 10, "index_topk_freq": freq}
    if offset is not None:
        config["index_skip_topk_offset"] = offset
    model = ModelConfig.from_hf(write(tmp_path, config))
    assert [i for i in range(10) if not model.indexer_types or model.indexer_types[i] == "full"] == own
    assert model.num_indexer_layers == len(own)


@pytest.mark.parametrize("change,said", [
    ({"index_topk_freq": 0}, "index_topk_freq = 0, expected a whole number >= 1"),
    ({"index_topk_freq": "4"}, "index_topk_freq = '4', expected a whole number >= 1"),
    ({"index_skip_topk_offset": -1}, "index_skip_topk_offset = -1, expected a whole number >= 0"),
    ({"index_topk_pattern": 7}, "index_topk_pattern = 7, expected a string"),
    ({"index_topk_pattern": "FxSs"}, "GlmMoeDsaConfig, which vLLM loads it with, reads each letter as F or S and "
                                     "fails on ['s', 'x']"),
    ({"index_topk_freq": None}, "index_topk_freq = null: vLLM computes which layers share the top-k with it"),
    ({"index_topk_freq": 4, "index_skip_topk_offset": None}, "index_skip_topk_offset = null: vLLM computes"),
    ({"index_topk_pattern": "SFF"}, "make layer 0 share the top-k, but no earlier layer's indexer picks it"),
    ({"index_topk_freq": 3, "index_skip_topk_offset": 0},
     "index_topk_freq 3 and index_skip_topk_offset 0 make layer 0 share the top-k, but no earlier layer's indexer picks it"),
    ({"index_topk_freq": 4, "index_skip_topk_offset": 3, "indexer_types": ["full"] * 78},
     "indexer_types differs from what index_topk_freq 4 and index_skip_topk_offset 3 give vLLM (layer 3 'full', vLLM's 'shared')"),
    ({"indexer_types": ["full"] * 77},
     "indexer_types differs from what index_topk_freq 1 and index_skip_topk_offset 2 give vLLM (77 entries for 78"),
    ({"indexer_types": ["full", "partial"] + ["full"] * 76}, "indexer_types = ['full', 'partial'"),
])
def test_a_config_that_vllm_would_read_otherwise_is_refused(tmp_path, change, said):
    folder = write(tmp_path, {**raw(GLM5), **change})
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(folder)
    assert said in str(e.value) and str(folder / "config.json") in str(e.value)


def test_a_model_config_checks_its_indexer_types():
    glm = package(GLM52)
    for types, said in ((("shared",) + glm.indexer_types[1:], "indexer_types[0] is 'shared'"),
                        (glm.indexer_types[:-1], "indexer_types has 77 entries for 78 layers"),
                        (("full", "own") + glm.indexer_types[2:], "indexer_types holds ['own']")):
        with pytest.raises(ServesimError, match=said.replace("[", r"\[").replace("]", r"\]")):
            replace(glm, indexer_types=types)
    with pytest.raises(ServesimError, match="indexer_types without DeepSeek sparse attention"):
        replace(glm, index_topk=0, index_n_heads=0, index_head_dim=0)


def test_the_sparse_layer_types_spellings_are_full_attention(tmp_path):
    """NVIDIA's GLM-5.2 checkpoint writes layer_types "deepseek_sparse_attention" (vLLM's
    _ATTENTION_LAYER_TYPES: a full attention KV cache); for other families it is refused."""
    assert package("nvidia--GLM-5.2-NVFP4").layer_types == ()
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "mistral", "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "vocab_size": 100, "max_position_embeddings": 128, "sliding_window": 64,
             "layer_types": ["deepseek_sparse_attention"] * 2}
    with pytest.raises(ServesimError, match=r"layer_types\[0\] = 'deepseek_sparse_attention'"):
        ModelConfig.from_hf(write(tmp_path, llama))


def roofline(model: ModelConfig) -> MoERooflineCostModel:
    return MoERooflineCostModel(model, HARDWARE["H200"], tp=8, dtype="fp8")


def test_the_roofline_runs_the_indexer_in_21_layers_only():
    """A step's attention: every layer's sparse attention, the indexer's scoring in the 21 layers that
    run it; and its projections: the indexer's wq_b, wk and weights_proj in those layers only."""
    from backends.costmodel.frame import batch_aggregates

    glm = package(GLM52)
    shared, own = roofline(glm), roofline(all_own(glm))
    agg, chunks = batch_aggregates([1, 1, 3000], [4999, 99999, 0], 3, every_request=True)

    def attention(r):
        return r.parts(agg, chunks, r._dense(agg.num_tokens, agg.num_logits))["attention"]

    indexer = sum(own._indexer_one_layer(q, c) for q, c in chunks)
    assert attention(own) - attention(shared) == pytest.approx(57 * indexer, rel=1e-9)
    assert own._attention_linear_all(3002) - shared._attention_linear_all(3002) == pytest.approx(
        57 * float(own._indexer_linear(3002)), rel=1e-9)
    # a dense MHA prefill alone runs no indexer at all: the two models' attention is the same
    agg, chunks = batch_aggregates([1000], [0], 1, every_request=True)
    assert attention(own) == pytest.approx(attention(shared), rel=1e-12)


def test_a_measured_dsa_layer_counts_for_fewer_layers_where_layers_share():
    """_sparse_module_layers: 78 layers where every layer runs its indexer; for GLM-5.2, the 21 that
    run one and the 57 others each carried by the roofline's ratio of the layer without the indexer to
    the layer with it, which falls as the indexer's scoring of every key grows with the context."""
    glm = package(GLM52)
    r = roofline(glm)
    assert roofline(all_own(glm))._sparse_module_layers([(1, 50000)]) == 78.0
    short, long = r._sparse_module_layers([(1, 4096)] * 8), r._sparse_module_layers([(1, 131072)] * 8)
    assert 21 < long < short < 78
    # by hand, one decode: the projections and the sparse attention, without and with the indexer's
    p, pi = float(r._attention_linear(1)), float(r._indexer_linear(1))
    a, i = r._sparse_attend_one_layer(1, 9000), r._indexer_one_layer(1, 9000)
    assert r._sparse_module_layers([(1, 9000)]) == pytest.approx(21 + 57 * (p + a) / (p + pi + a + i), rel=1e-12)
    # a batch of prefills within index_topk is vLLM's dense MHA prefill: only the indexer's projections differ
    p, pi = float(r._attention_linear(1500)), float(r._indexer_linear(1500))
    a = r._attention_one_layer(1000, 1000, None) + r._attention_one_layer(500, 2000, None)
    assert r._sparse_module_layers([(1000, 1000), (500, 2000)]) == pytest.approx(21 + 57 * (p + a) / (p + pi + a))


@pytest.fixture(scope="module")
def data():
    from backends.costmodel.optables.systems import require_package

    return require_package() / "data"


def test_the_tables_price_the_shared_layers_from_the_measured_one(data):
    """H200's DSA module rows (GLM-5's shape, which GLM-5.2 keeps) price a step of GLM-5.2: the
    prefills' batch and the decodes' batch each counted for `_sparse_module_layers` layers."""
    from backends.costmodel.frame import batch_aggregates
    from backends.costmodel.optables.moe import moe_table_model

    glm = package(GLM52)
    cm = moe_table_model(glm, HARDWARE["H200"], "h200_sxm", data, tp=8, dtype="fp8")
    assert cm._mla is not None and "the 57 layers of 78 that reuse an earlier layer's top-k" in cm.sources["attention"]
    steps = [(1, 3000), (1, 70000), (4096, 8192)]
    agg, chunks = batch_aggregates([q for q, _ in steps], [c - q for q, c in steps], 3, every_request=True)
    attention = cm.parts(agg, chunks, cm._dense(agg.num_tokens, agg.num_logits))["attention"]
    module, _ = cm._mla.chunks([(4096, 8192)])
    decodes, _ = cm._mla.decodes(2, 36500.0)
    expected = (cm._sparse_module_layers([(4096, 8192)]) * module
                + cm._sparse_module_layers([(1, 3000), (1, 70000)]) * decodes)
    assert attention == pytest.approx(expected, rel=1e-12)
    own = moe_table_model(all_own(glm), HARDWARE["H200"], "h200_sxm", data, tp=8, dtype="fp8")
    assert own.parts(agg, chunks, own._dense(agg.num_tokens, agg.num_logits))["attention"] == pytest.approx(
        78 * (module + decodes), rel=1e-12)
    assert attention < 78 * (module + decodes)


def test_sim_replays_glm_5_2(tmp_path):
    trace = ROOT / "traces/samples/azure_conv_2023_first5min.csv"
    out = tmp_path / "r"
    assert sim("replay", trace, "--model", "zai-org/GLM-5.2-FP8", "--hardware", "h200_sxm", "--tp", "8",
               "--block-size", "64", "--max-model-len", "200000", "--limit", "40", "--out", out, "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 40 and summary["kv_cache"]["block_bytes"] == 64 * 92628
    assert summary["model"]["indexer_types"][:7] == ["full", "full", "full", "shared", "shared", "shared", "full"]
    assert "the 57 layers of 78" in summary["options"]["cost_model"]["operators"]["attention"]


def test_sim_models_prices_glm_5_2_and_5_3(capsys):
    assert sim("models") == 0
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if "GLM-5.2" in line or "GLM-5.3" in line]
    assert len(lines) == 6 and all("glm_moe_dsa" in line and "not priced" not in line for line in lines)
    # and Kimi K2.7, whose null top-level rope_scaling beside rope_parameters was read as a disagreement
    kimi = [line for line in out if "Kimi-K2.7" in line]
    assert len(kimi) == 1 and "deepseek_v3" in kimi[0] and "not priced" not in kimi[0]
    m = package("nvidia--Kimi-K2.7-Code-NVFP4")
    assert (m.rope_theta, m.rope_scaling["rope_type"], m.rope_scaling["factor"]) == (50000.0, "yarn", 64.0)
