"""Llama 4 (Scout, Maverick) served for text prompts: its layers, weights, KV cache and chunked
local attention as vLLM builds and runs them (backends/model_config.py `_llama4_fields`,
backends/kv_capacity.py `kv_cache_groups`, backends/costmodel/roofline.py `chunk_pieces`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.costmodel.roofline import MoERooflineCostModel, chunk_pieces, window_pairs
from backends.hardware import HARDWARE
from backends.kv_capacity import KVCacheGroup, kv_cache_groups, vllm_kv_cache
from backends.model_config import ModelConfig
from sim.errors import ServesimError
from tests.helpers import one_error_line, sim
from tests.package_configs import CONFIGS, package, raw, write

ROOT = Path(__file__).resolve().parents[1]
SCOUT, MAVERICK = "meta-llama--Llama-4-Scout-17B-16E-Instruct", "meta-llama--Llama-4-Maverick-17B-128E-Instruct"








# The layers, weights and KV cache, worked by hand.

H, HEADS, KV_HEADS, HD, LAYERS, VOCAB = 5120, 40, 8, 128, 48, 202048


def test_scout_layers_as_vllm_builds_them():
    m = package(SCOUT)
    assert (m.model_type, m.num_experts, m.num_experts_per_tok, m.norm_topk_prob) == ("llama4_text", 16, 1, False)
    assert (m.moe_intermediate_size, m.shared_expert_intermediate_size, m.intermediate_size) == (8192, 8192, 16384)
    # No NoPE list in the file: transformers' default, every fourth layer NoPE (global attention),
    # the others RoPE with chunked local attention of 8192 positions (vLLM's Llama4Attention).
    assert m.layer_types == tuple("full_attention" if (i + 1) % 4 == 0 else "chunked_attention" for i in range(48))
    assert (m.num_chunked_layers, m.attention_chunk_size) == (36, 8192)
    assert (m.num_moe_layers, m.num_dense_mlp_layers, m.interleave_moe_layer_step) == (48, 0, 1)
    assert m.rope_scaling["rope_type"] == "llama3" and m.max_position_embeddings == 10485760


def test_maverick_interleaves_dense_and_moe_layers():
    m = package(MAVERICK)
    assert (m.num_experts, m.interleave_moe_layer_step, m.num_moe_layers, m.num_dense_mlp_layers) == (128, 2, 24, 24)
    parts = m.weight_bytes_by_part(tp=8)
    # Dense layers: a SwiGLU of intermediate_size_mlp (16384); MoE layers: 128 routed experts and one
    # shared expert of 8192, a bf16 router; TP 8 splits the intermediate sizes.
    assert parts["dense_mlp"] == 24 * 3 * H * (16384 // 8) * 2
    assert parts["experts"] == 24 * 128 * 3 * H * (8192 // 8) * 2
    assert parts["shared_experts"] == 24 * 3 * H * (8192 // 8) * 2
    assert parts["router"] == 24 * H * 128 * 2


def test_scout_weights_and_kv_by_hand():
    m = package(SCOUT)
    parts = m.weight_bytes_by_part(tp=8)
    q, kv = HEADS // 8 * HD, KV_HEADS // 8 * HD
    assert parts["attention"] == LAYERS * (H * (q + 2 * kv) * 2 + q * H * 2)  # QKV and O, no biases or norms
    assert parts["experts"] == LAYERS * 16 * 3 * H * 1024 * 2
    assert parts["shared_experts"] == LAYERS * 3 * H * 1024 * 2 and parts["router"] == LAYERS * H * 16 * 2
    assert parts["embeddings"] == 2 * (VOCAB // 8) * H * 2  # untied, the vocabulary split over 8 GPUs
    assert "dense_mlp" not in parts
    # The KV cache holds every layer's K and V (vLLM allocates chunked layers as full ones, below).
    assert m.kv_bytes_per_token() == LAYERS * 2 * KV_HEADS * HD * 2 == 196608
    assert m.kv_bytes_per_token(tp=8) == 196608 // 8


def test_chunked_layers_are_one_full_attention_group():
    m = package(SCOUT)
    assert kv_cache_groups(m) == [KVCacheGroup("full_attention", 48)]
    assert kv_cache_groups(m, disable_hybrid_kv_cache_manager=True) == [KVCacheGroup("full_attention", 48)]
    available = 40 * 2**30
    v = vllm_kv_cache(m, available, block_size=16, max_model_len=131072, max_in_flight_tokens=8192, tp=8)
    assert v["num_blocks"] == available // (48 * 16 * 2 * 1 * 128 * 2)  # one KV head per GPU
    assert [g["max_blocks_per_request"] for g in v["groups"]] == [131072 // 16]


# Chunked local attention, as vLLM splits it into virtual requests.


def test_chunk_pieces_worked_examples():
    assert chunk_pieces(1, 100, 8192) == [(1, 100)]
    assert chunk_pieces(1, 8192, 8192) == [(1, 8192)]  # the chunk's last position sees all of it
    assert chunk_pieces(1, 8193, 8192) == [(1, 1)]  # the next chunk's first sees itself alone
    assert chunk_pieces(10, 8195, 8192) == [(7, 8192), (3, 3)]
    assert chunk_pieces(20000, 20000, 8192) == [(8192, 8192), (8192, 8192), (3616, 3616)]


@given(st.integers(1, 3000), st.integers(0, 3000), st.sampled_from([1, 7, 16, 512, 8192]))
def test_chunk_pieces_attend_each_token_to_its_own_chunk(q, before, chunk):
    c = before + q
    pieces = chunk_pieces(q, c, chunk)
    assert sum(qi for qi, _ in pieces) == q and all(qi <= ci <= chunk for qi, ci in pieces)
    # Query-key pairs: token p (0-based) sees the tokens of its chunk up to itself, p % chunk + 1.
    assert sum(window_pairs(qi, ci, None) for qi, ci in pieces) == sum(p % chunk + 1 for p in range(c - q, c))


def roofline(model: ModelConfig) -> MoERooflineCostModel:
    return MoERooflineCostModel(model, HARDWARE["H200"], tp=8)


def test_chunked_layers_cost_full_attention_within_the_first_chunk_and_less_past_it():
    scout = package(SCOUT)
    full = replace(scout, layer_types=(), attention_chunk_size=None)  # every layer global
    chunked, everywhere = roofline(scout), roofline(full)
    assert not chunked.decodes_from_sums and everywhere.decodes_from_sums
    for q, c in ((1, 1), (1, 8192), (512, 512), (8192, 8192), (100, 5000)):
        assert chunked.request_seconds(q, c) == pytest.approx(everywhere.request_seconds(q, c), rel=1e-12)
    # Past the first chunk the 36 chunked layers attend within theirs: a decode at 8193 sees 1 key
    # there, and a 16384-token prompt costs two 8192-token ones in those layers.
    one_layer = everywhere.request_seconds(1, 8193) / 48
    assert chunked.request_seconds(1, 8193) == pytest.approx(12 * one_layer + 36 * everywhere.request_seconds(1, 1) / 48)
    assert chunked.request_seconds(16384, 16384) == pytest.approx(
        12 * everywhere.request_seconds(16384, 16384) / 48 + 36 * 2 * everywhere.request_seconds(8192, 8192) / 48)


# Refusals, each naming the file and field.


@pytest.mark.parametrize("change,says", [
    ({"moe_layers": [0, 2, 4]}, "moe_layers = [0, 2, 4]: vLLM places the MoE layers by interleave_moe_layer_step (1)"),
    ({"no_rope_layers": [1, 0]}, "no_rope_layers = [1, 0], expected 48 entries of 0 or 1"),
    ({"no_rope_layers": [True] * 48}, "expected 48 entries of 0 or 1"),
    ({"interleave_moe_layer_step": 0}, "interleave_moe_layer_step = 0"),
    ({"attention_chunk_size": 0}, "attention_chunk_size = 0"),
    ({"layer_types": ["full_attention"] * 48}, "layer_types = ['full_attention'"),
])
def test_what_vllm_would_read_otherwise_is_refused(tmp_path, change, says):
    config = raw(SCOUT)
    config["text_config"].update(change)
    folder = write(tmp_path, config)
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(folder)
    assert says in str(e.value) and str(folder / "config.json") in str(e.value)


def test_moe_layers_as_vllm_places_them_are_accepted(tmp_path):
    config = raw(MAVERICK)
    config["text_config"]["moe_layers"] = list(range(1, 48, 2))
    assert ModelConfig.from_hf(write(tmp_path, config)).num_moe_layers == 24


def test_no_chunk_size_makes_every_layer_global(tmp_path):
    config = raw(SCOUT)
    config["text_config"]["attention_chunk_size"] = None
    m = ModelConfig.from_hf(write(tmp_path, config))
    assert m.layer_types == () and m.attention_chunk_size is None and roofline(m).decodes_from_sums


def test_chunked_layers_in_another_family_are_refused(tmp_path):
    config = json.loads((CONFIGS / "Qwen--Qwen3-30B-A3B_config.json").read_text())
    config["layer_types"] = ["chunked_attention"] * config["num_hidden_layers"]
    folder = write(tmp_path, config)
    with pytest.raises(ServesimError, match="chunked local attention is priced for Llama 4 only"):
        ModelConfig.from_hf(folder)
    dense = json.loads((CONFIGS / "Qwen--Qwen3-8B_config.json").read_text())
    dense["layer_types"] = ["chunked_attention"] * dense["num_hidden_layers"]
    with pytest.raises(ServesimError, match="chunked local attention is priced for Llama 4 only"):
        ModelConfig.from_hf(write(tmp_path, dense))


# The command line.


def test_sim_replay_runs_llama4_scout_from_measured_tables(tmp_path):
    out = tmp_path / "run"
    assert sim("replay", ROOT / "traces/samples/azure_conv_2023_first5min.csv", "--model",
               CONFIGS / f"{SCOUT}_config.json", "--hardware", "h100_sxm", "--tp", "8", "--max-model-len", "32768",
               "--limit", "40", "--out", out, "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 40
    operators = summary["options"]["cost_model"]["operators"]
    assert operators["moe"].startswith("moe_perf") and "power_law_1.01" in operators["moe"]
    assert "chunked-local layers as full attention over their 8192-token chunk" in operators["attention"]


def test_its_ten_million_token_context_is_vllms_start_check(tmp_path, capsys):
    assert sim("replay", ROOT / "traces/samples/azure_conv_2023_first5min.csv", "--model",
               CONFIGS / f"{SCOUT}_config.json", "--hardware", "h100_sxm", "--tp", "8", "--limit", "5",
               "--out", tmp_path / "run") == 2
    line = one_error_line(capsys)
    assert "cannot hold one request of --max-model-len 10485760 tokens; vLLM would not start" in line


@given(st.integers(1, 64), st.integers(0, 8), st.integers(1, 6))
def test_moe_layers_are_every_steps_layer_after_the_dense_ones(layers, first_dense, step):
    """vLLM's rule, layer i is MoE when (i + 1) % step == 0 (Llama4DecoderLayer), after DeepSeek's
    first_k_dense_replace dense layers: the count `num_moe_layers` gives, layer by layer."""
    m = package(MAVERICK)
    expected = sum(1 for i in range(first_dense, layers) if (i + 1) % step == 0)
    if first_dense >= layers or not expected:
        return
    shaped = replace(m, num_hidden_layers=layers, first_k_dense_replace=first_dense, interleave_moe_layer_step=step,
                     layer_types=())
    assert shaped.num_moe_layers == expected and shaped.num_dense_mlp_layers == layers - expected
