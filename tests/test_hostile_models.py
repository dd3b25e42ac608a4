"""Odd input to the Qwen3-VL, Llama 4 and --model ORG/NAME readers, each refused in one line naming
the file, field or value (backends/model_config.py), and chunked local attention never priced above
the full attention it narrows (backends/costmodel/roofline.py, optables/moe.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from backends.costmodel.roofline import MoERooflineCostModel, chunk_pieces
from backends.hardware import HARDWARE
from backends.model_config import ModelConfig, package_model_config, resolve_model
from sim.errors import ServesimError
from tests.helpers import one_error_line, sim
from tests.package_configs import CONFIGS, raw, write

ROOT = Path(__file__).resolve().parents[1]
SCOUT = "meta-llama--Llama-4-Scout-17B-16E-Instruct"






# --model


@pytest.mark.parametrize("name", ["a" * 300, "org/" + "x" * 300])
def test_a_name_too_long_for_the_file_system_is_an_unknown_model(name, tmp_path, capsys):
    # (it was an internal error: OSError File name too long, from looking the name up as a path)
    with pytest.raises(ServesimError, match="unknown model"):
        resolve_model(name)
    assert sim("replay", ROOT / "traces/samples/azure_conv_2023_first5min.csv", "--model", name, "--limit", "3",
               "--out", tmp_path / "run", "--quiet") == 2
    assert one_error_line(capsys).startswith("unknown model")


def test_the_quantization_file_beside_a_packaged_config_is_no_model():
    # nvidia--DeepSeek-V3.1-NVFP4_hf_quant_config.json was read as a model config ("model_type None")
    assert (CONFIGS / "nvidia--DeepSeek-V3.1-NVFP4_hf_quant_config.json").is_file()
    assert package_model_config("nvidia/DeepSeek-V3.1-NVFP4_hf_quant") is None
    with pytest.raises(ServesimError, match="unknown model 'nvidia/DeepSeek-V3.1-NVFP4_hf_quant'"):
        resolve_model("nvidia/DeepSeek-V3.1-NVFP4_hf_quant")
    assert package_model_config("nvidia/DeepSeek-V3.1-NVFP4") is not None


# Llama 4


@pytest.mark.parametrize("chunk", [8192, None])
def test_llama4_with_a_sliding_window_is_refused(tmp_path, chunk):
    # Without a chunk size every layer was priced as a 4096-token sliding window (the global NoPE
    # layers too) and the KV cache sized as sliding groups; vLLM's Llama 4 has no sliding layers.
    config = raw(SCOUT)
    config["text_config"].update(sliding_window=4096, attention_chunk_size=chunk)
    folder = write(tmp_path, config)
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(folder)
    assert "sliding_window = 4096: Llama 4's layers are chunked-local or global" in str(e.value)
    assert str(folder / "config.json") in str(e.value)


# Qwen3-VL's multimodal RoPE


def qwen3_vl(tmp_path: Path, section) -> Path:
    config = raw("Qwen--Qwen3-VL-8B-Instruct")  # head_dim 128: 64 frequency pairs
    config["text_config"]["rope_scaling"] = {"mrope_interleaved": True, "mrope_section": section,
                                             "rope_type": "default"}
    return write(tmp_path, config)


@pytest.mark.parametrize("section", [[24, 20, 21], [64], [], None, "abc", [24, 20, 20.0], [True, 31, 32],
                                     [-1, 33, 32], {"t": 24}])
def test_mrope_sections_vllm_would_not_build_are_refused(tmp_path, section):
    folder = qwen3_vl(tmp_path, section)
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(folder)
    assert f"rope_scaling mrope_section = {section!r}, expected three whole numbers summing to head_dim // 2 (64)" \
        in str(e.value) and str(folder / "config.json") in str(e.value)


def test_qwen3_vl_mrope_section_read_as_plain_rope(tmp_path):
    m = ModelConfig.from_hf(qwen3_vl(tmp_path, [24, 20, 20]))
    assert m.rope_scaling is None and m.head_dim == 128


# Chunked local attention's price


def scout() -> ModelConfig:
    return ModelConfig.from_hf(CONFIGS / f"{SCOUT}_config.json")


QC = [(q, q + extra) for q in (1, 2, 3, 16, 100, 512, 4096, 8191, 8192, 8193, 20000)
      for extra in (0, 1, 5, 100, 8190, 8191, 8192, 8193, 16383, 30000)]


def test_roofline_chunked_layers_never_cost_more_than_global_ones():
    chunked = MoERooflineCostModel(scout(), HARDWARE["H200"], tp=8)
    full = MoERooflineCostModel(replace(scout(), layer_types=(), attention_chunk_size=None), HARDWARE["H200"], tp=8)
    for q, c in QC:
        assert chunked.request_seconds(q, c) <= full.request_seconds(q, c) * (1 + 1e-12), (q, c)


def test_table_chunked_layers_never_cost_more_than_global_ones(tmp_path):
    # A prefill of 3 tokens at 8194 splits into (1, 8192) and (2, 2): two table lookups, each with
    # its kernel's floor, came to 1.55 x the one full attention over all 8194 keys.
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.config import SchedulerConfig

    config = raw(SCOUT)
    config["text_config"]["attention_chunk_size"] = None
    folders = {"chunked": CONFIGS / f"{SCOUT}_config.json", "full": write(tmp_path, config)}
    backends = {k: resolve(ReplayOptions(model=str(v), hardware="h100_sxm", tp=8,
                                         scheduler=SchedulerConfig(max_model_len=131072))).backend
                for k, v in folders.items()}
    assert "chunked-local layers" in backends["chunked"].cost_model_summary()["operators"]["attention"]
    assert chunk_pieces(3, 8194, 8192) == [(1, 8192), (2, 2)]
    for q, c in QC:
        chunked, full = (backends[k].request_seconds(q, c) for k in ("chunked", "full"))
        assert chunked <= full * (1 + 1e-12), (q, c, chunked, full)
