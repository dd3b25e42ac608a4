"""Qwen3-VL served for text prompts: its language model, read from the wrapper's text_config, is
the Qwen3 or Qwen3-MoE decoder servesim prices (backends/model_config.py, LANGUAGE_MODELS)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from backends.model_config import ModelConfig, resolve_model
from sim.errors import ServesimError
from tests.helpers import sim
from tests.package_configs import CONFIGS, package, write

ROOT = Path(__file__).resolve().parents[1]




# What a language model's own config and the wrapper's text_config may differ in: the name, the
# served architecture, the RoPE base and context (Qwen3-VL: 5,000,000 and 262,144 tokens).
OWN = ("name", "architecture", "rope_theta", "max_position_embeddings")


@pytest.mark.parametrize("vl,lm", [("Qwen--Qwen3-VL-8B-Instruct", "Qwen--Qwen3-8B"),
                                   ("Qwen--Qwen3-VL-30B-A3B-Instruct", "Qwen--Qwen3-30B-A3B"),
                                   ("Qwen--Qwen3-VL-235B-A22B-Instruct", "Qwen--Qwen3-235B-A22B")])
def test_qwen3_vl_language_model_is_its_qwen3_decoder(vl, lm):
    m, ref = package(vl), package(lm)
    assert {k: v for k, v in asdict(m).items() if k not in OWN} == {k: v for k, v in asdict(ref).items() if k not in OWN}
    assert m.architecture.startswith("Qwen3VL") and (m.rope_theta, m.max_position_embeddings) == (5e6, 262144)
    assert (m.name, ref.name) == (vl.replace("--", "/"), lm.replace("--", "/"))  # the file's, not "model_configs"
    assert m.rope_scaling is None  # interleaved multimodal RoPE rotates text tokens as plain RoPE
    # The same weights on every GPU layout but RoPE's cos/sin cache, which is as long as the context.
    for tp in (1, 2, 8):
        parts, ref_parts = m.weight_bytes_by_part(tp=tp), ref.weight_bytes_by_part(tp=tp)
        assert {k: v for k, v in parts.items() if k != "rope_cache"} == \
            {k: v for k, v in ref_parts.items() if k != "rope_cache"}
        assert parts["rope_cache"] == 262144 * 128 * 2
    assert m.kv_bytes_per_token(tp=2) == ref.kv_bytes_per_token(tp=2)


def test_qwen3_vl_30b_by_hand():
    m = package("Qwen--Qwen3-VL-30B-A3B-Instruct")
    assert (m.model_type, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.qk_norm) == \
        ("qwen3_moe", 128, 8, 768, True)
    assert m.kv_bytes_per_token() == 2 * 48 * 4 * 128 * 2  # K and V, 48 layers, 4 KV heads of 128, bf16
    assert m.weight_bytes_by_part()["experts"] == 48 * 128 * (2048 * 2 * 768 * 2 + 768 * 2048 * 2)
    assert not m.tie_word_embeddings  # the wrapper's, where text_config states none


def test_tied_embeddings_from_the_text_config():
    m = package("Qwen--Qwen3-VL-2B-Instruct")
    assert m.tie_word_embeddings and m.model_type == "" and m.num_hidden_layers == 28
    assert m.weight_bytes_by_part()["embeddings"] == 151936 * 2048 * 2  # one matrix


def test_the_wrappers_quantization_and_tying_carry_over(tmp_path):
    raw = json.loads((CONFIGS / "Qwen--Qwen3-VL-8B-Instruct_config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    raw["tie_word_embeddings"] = True
    m = ModelConfig.from_hf(write(tmp_path, raw))
    assert m.weight_dtype == "fp8-block" and m.tie_word_embeddings


@pytest.mark.parametrize("scaling,field", [
    ({"mrope_section": [24, 20, 20], "rope_type": "yarn", "factor": 4.0}, "rope_type': 'yarn'"),
    ({"mrope_section": [24, 20, 20], "factor": 2.0}, "'factor': 2.0"),
])
def test_multimodal_rope_with_scaling_is_refused(tmp_path, scaling, field):
    raw = json.loads((CONFIGS / "Qwen--Qwen3-VL-32B-Instruct_config.json").read_text())
    raw["text_config"]["rope_scaling"] = scaling
    folder = write(tmp_path, raw)
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(folder)
    msg = str(e.value)
    assert "multimodal RoPE with scaling" in msg and field in msg and str(folder / "config.json") in msg


def test_other_vision_wrappers_are_still_refused(tmp_path):
    raw = json.loads((CONFIGS / "Qwen--Qwen3-VL-8B-Instruct_config.json").read_text())
    raw["text_config"]["model_type"] = "qwen3_omni_text"
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(write(tmp_path, raw))
    assert "qwen3_omni_text" in str(e.value) and "not supported" in str(e.value)


def test_sim_replay_runs_qwen3_vl(tmp_path):
    out = tmp_path / "run"
    assert sim("replay", ROOT / "traces/samples/azure_conv_2023_first5min.csv", "--model",
               CONFIGS / "Qwen--Qwen3-VL-30B-A3B-Instruct_config.json", "--hardware", "h100_sxm", "--tp", "2",
               "--limit", "60", "--out", out, "--quiet") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 60 and summary["model"]["architecture"] == "Qwen3VLMoeForConditionalGeneration"


def test_a_hugging_face_name_reads_the_config_the_tables_package_ships(capsys):
    m = resolve_model("Qwen/Qwen3-VL-30B-A3B-Instruct")
    assert m.name == "Qwen/Qwen3-VL-30B-A3B-Instruct" and m == package("Qwen--Qwen3-VL-30B-A3B-Instruct")
    assert resolve_model("meta-llama/Llama-4-Scout-17B-16E-Instruct").num_experts == 16
    for name in ("foo/bar", "Qwen3-VL-8B-Instruct", "a/b/c"):
        with pytest.raises(ServesimError) as e:
            resolve_model(name)
        assert f"unknown model {name!r}" in str(e.value) and "pip install -e '.[tables]'" in str(e.value)


def test_the_wrappers_quantization_comes_before_the_text_configs(tmp_path):
    """vLLM reads the top level's quantization_config first, then the text config's
    (vllm/model_executor/model_loader/weight_utils.py, get_quant_config)."""
    raw = json.loads((CONFIGS / "Qwen--Qwen3-VL-8B-Instruct_config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    raw["text_config"]["quantization_config"] = {"quant_method": "fp8"}
    assert ModelConfig.from_hf(write(tmp_path, raw)).weight_dtype == "fp8-block"
    del raw["quantization_config"]
    assert ModelConfig.from_hf(write(tmp_path, raw)).weight_dtype == "fp8"
