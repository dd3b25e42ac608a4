"""Hardware presets and files; the KV blocks vLLM allocates, by hand."""

import json

import pytest

from backends.hardware import HARDWARE, Hardware, resolve_hardware
from backends.kv_capacity import activation_peak_bytes, kv_capacity
from backends.model_config import ModelConfig
from sim.errors import ServesimError

GIB = 2**30
LLAMA = ModelConfig.from_preset("Llama-3.1-8B")
H100 = HARDWARE["H100-SXM"]


def blocks(model=LLAMA, hardware=H100, **kw):
    args = {"block_size": 16, "gpu_memory_utilization": 0.9, "max_num_batched_tokens": 2048, "max_num_seqs": 256}
    return kv_capacity(model, hardware, **{**args, **kw})


def test_llama_8b_on_an_h100_by_hand():
    requested = 81082 * 2**20 * 0.9  # memory as CUDA reports it x utilisation: 71.26 GiB, as vLLM logs
    weights = 2 * 8_030_261_248 + 2 * 131072 * 128  # 14.9888 GiB
    activation = 9.56 * 256 * 128256 * 4 + 1.28 * 2048 * 4096 * 2  # sampler peak + hidden states
    non_torch, cuda_graphs = 0.13 * GIB, 0.6 * GIB
    available = int(requested - weights - activation - non_torch - cuda_graphs)
    block = 16 * 2 * 32 * 8 * 128 * 2  # 16 tokens of K and V, 32 layers, 8 heads of 128, bf16: 2 MiB
    assert available // block == 27829  # 445,264 tokens
    cap = blocks()
    assert cap.num_gpu_blocks == 27829 and cap.block_bytes == block == 2 * 2**20 and cap.source == "derived"
    assert cap.terms["weights"] == weights and cap.terms["available"] == available
    summary = cap.as_dict()
    assert summary["num_gpu_blocks"] == 27829 and summary["bytes_per_gpu"]["weights"] == weights


def test_activation_constants_reproduce_the_vllm_profiles():
    # vLLM 0.11 on an H100 (max_num_batched_tokens 8192, max_num_seqs 1024), DEBUG logs in GiB.
    qwen3_32b = ModelConfig("Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, 40960, 1e6, 1e-6, False, True)
    llama_70b = ModelConfig.from_preset("Llama-3.1-70B")
    for model, tp, measured in ((LLAMA, 1, 4.76), (ModelConfig.from_preset("Qwen3-0.6B"), 1, 5.56),
                                (qwen3_32b, 1, 5.64), (llama_70b, 2, 4.84)):
        assert abs(activation_peak_bytes(model, 8192, 1024, tp) / GIB - measured) < 0.006, model.name
    # And the weights those logs print: Qwen3-32B 61.03 GiB at TP 1, Llama-3.1-8B 14.99.
    assert round(qwen3_32b.weight_bytes_per_gpu() / GIB, 2) == 61.03


def test_tp_dtype_and_override():
    assert blocks(tp=2).block_bytes * 2 == blocks().block_bytes  # half the KV heads per GPU
    assert blocks(tp=2).num_gpu_blocks > 2 * blocks().num_gpu_blocks  # and half the weights
    assert blocks(kv_cache_dtype="fp8").block_bytes * 2 == blocks().block_bytes
    fp8 = blocks(dtype="fp8")
    linear = 32 * sum(g.k * g.n for g in LLAMA.gemms(1))
    assert blocks().terms["weights"] - fp8.terms["weights"] == linear
    assert blocks(num_gpu_blocks_override=7000).num_gpu_blocks == 7000
    assert blocks(num_gpu_blocks_override=7000).source == "--num-gpu-blocks"


def test_models_too_big_are_refused_as_vllm_refuses_them():
    llama_70b = ModelConfig.from_preset("Llama-3.1-70B")
    with pytest.raises(ServesimError, match="do not fit in 90% of 79.18 GiB, leaving nothing for the KV cache"):
        blocks(llama_70b)
    with pytest.raises(ServesimError, match="cannot hold one request of --max-model-len 131072"):
        blocks(llama_70b, tp=2, max_model_len=131072)
    assert blocks(llama_70b, tp=4, max_model_len=131072).num_gpu_blocks > 8192
    assert blocks(llama_70b, num_gpu_blocks_override=100).num_gpu_blocks == 100  # taken as given
    with pytest.raises(ServesimError, match="neither nvlink_bandwidth nor pcie_bandwidth"):
        blocks(hardware=Hardware("pcie", 1e14, None, 1e12, 80 * GIB, None), tp=2)


def test_hardware_presets_and_files(tmp_path):
    assert H100.peak_flops("fp8") == 1978.9e12 and H100.peak_flops("bf16") == 989.4e12
    assert HARDWARE["A100-80GB"].peak_flops("fp8") == 312e12  # no fp8 tensor cores: weight-only fp8
    spec = {"peak_bf16_flops": 2.25e15, "peak_fp8_flops": 4.5e15, "memory_bandwidth": 8e12,
            "memory_bytes": 192e9, "nvlink_bandwidth": 900e9, "description": "a B200-like GPU"}
    path = tmp_path / "b200.json"
    path.write_text(json.dumps(spec))
    hw = resolve_hardware(str(path))
    assert hw.name == "b200" and hw.memory_bytes == 192_000_000_000 and hw.peak_flops("fp8") == 4.5e15
    assert resolve_hardware("H200") is HARDWARE["H200"]


@pytest.mark.parametrize("change,message", [
    ({"memory_bytes": None}, "memory_bytes must be a whole number from 134,217,728 to"),
    ({"peak_bf16_flops": "fast"}, "peak_bf16_flops must be a number from 1e+09 to 1e+18 FLOP/s, got 'fast'"),
    ({"hbm": 1}, "unknown field 'hbm'"),
    # summary.json's hardware object copied whole: said what to leave out (it read "unknown field 'name'")
    ({"name": "h100_sxm", "system": "h100_sxm"}, "field 'name': a hardware file is named by its file's name"),
    ({"nvlink_bandwidth": -1}, "nvlink_bandwidth must be a number from 1e+08 to 1e+14 bytes/s, got -1"),
])
def test_bad_hardware_files_name_the_file_and_field(tmp_path, change, message):
    spec = {"peak_bf16_flops": 1e15, "peak_fp8_flops": None, "memory_bandwidth": 2e12, "memory_bytes": 8e10,
            "nvlink_bandwidth": None, **change}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(ServesimError) as e:
        resolve_hardware(str(path))
    assert message in str(e.value) and str(path) in str(e.value)
    path.write_text(json.dumps({k: v for k, v in spec.items() if k not in ("memory_bandwidth", "hbm", "name", "system")}))
    with pytest.raises(ServesimError, match="no memory_bandwidth in it"):
        resolve_hardware(str(path))
    with pytest.raises(ServesimError, match="not a preset"):
        resolve_hardware("TPU-v5")


def test_gpt_oss_without_the_hybrid_manager_by_hand():
    # gpt-oss-120b: 36 layers (18 sliding, window 128; 18 full), 8 KV heads of 64, bf16: one layer's
    # page of 16 tokens is 16 x 2 x 8 x 64 x 2 = 32,768 bytes. 10 GiB for the cache, max_model_len 131,072,
    # two batches of 2,048 tokens in flight.
    from backends.kv_capacity import kv_cache_groups, vllm_kv_cache
    from backends.model_config import resolve_model

    model = resolve_model("gpt-oss-120b")
    page, available = 16 * 2 * 8 * 64 * 2, 10 * GIB
    args = dict(block_size=16, max_model_len=131072, max_in_flight_tokens=4096)
    # The hybrid manager: two groups of 18 layers, a block 18 pages; a request of 131,072 tokens takes
    # 8,192 full blocks and cdiv(127 + 4096, 16) + 1 = 265 sliding ones.
    hybrid = vllm_kv_cache(model, available, **args)
    assert hybrid["bytes_per_block"] == 18 * page and hybrid["num_blocks"] == available // (18 * page) == 18204
    assert hybrid["tokens"] == int(18204 / (8192 + 265) * 131072) == 282137
    # --disable-hybrid-kv-cache-manager: one full-attention group of all 36 layers, a block 36 pages,
    # every token's KV kept: as a model of full-attention layers only, 9,102 blocks, 145,632 tokens.
    assert [(g.kind, g.num_layers) for g in kv_cache_groups(model, True)] == [("full_attention", 36)]
    flat = vllm_kv_cache(model, available, **args, disable_hybrid_kv_cache_manager=True)
    assert flat["bytes_per_block"] == 36 * page == 16 * model.kv_bytes_per_token()
    assert flat["num_blocks"] == available // (36 * page) == 9102 and flat["tokens"] == 9102 * 16
    # A model whose every layer slides, or none does, is unchanged by the flag (vLLM promotes a sliding
    # layer only beside full-attention ones: _promote_local_kv_cache_specs).
    for other in (ModelConfig.from_preset("Llama-3.1-8B"),):
        assert kv_cache_groups(other, True) == kv_cache_groups(other)


def test_gpt_oss_on_an_h100_without_the_hybrid_manager_needs_a_shorter_context():
    # On an H100 the flag halves gpt-oss-120b's blocks (each holds all 36 layers): 7,193 blocks, 115,088
    # tokens, fewer than one request of its 131,072: vLLM would not start.
    from backends.model_config import resolve_model

    model = resolve_model("gpt-oss-120b")
    hybrid = blocks(model, max_model_len=131072)
    assert hybrid.num_gpu_blocks == 14386
    with pytest.raises(ServesimError, match=r"\(7193 blocks of 16 tokens\) cannot hold one request of --max-model-len "
                                            r"131072 tokens.*at most 115088"):
        blocks(model, max_model_len=131072, disable_hybrid_kv_cache_manager=True)
    flat = blocks(model, max_model_len=65536, disable_hybrid_kv_cache_manager=True)
    assert flat.num_gpu_blocks == 7193 and flat.block_bytes == 2 * hybrid.block_bytes
    assert flat.vllm["groups"] == [{"kind": "full_attention", "num_layers": 36, "sliding_window": None,
                                    "max_blocks_per_request": 4096}]
