"""The mixture-of-experts, MLA and sliding-window families: each config.json as aiconfigurator-core
ships it, parsed; its KV bytes per token and weights per GPU worked by hand; vLLM's KV cache groups
and capacity for MLA and sliding windows (worked examples); the refusals; the roofline's MoE step."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.costmodel.roofline import MoERooflineCostModel, window_pairs
from backends.hardware import HARDWARE
from backends.kv_capacity import KVCacheGroup, kv_cache_groups, kv_capacity, vllm_kv_cache
from backends.model_config import ModelConfig, linear_bytes, resolve_model
from backends.presets import MODELS
from sim.batch import Batch
from sim.errors import ServesimError
from tests.moe_configs import GEMMA2_9B, GEMMA3_1B, MISTRAL_7B_V01

aic = pytest.importorskip("aiconfigurator_core")
CONFIGS = Path(aic.__file__).parent / "model_configs"


def package(name: str) -> ModelConfig:
    return ModelConfig.from_hf(CONFIGS / f"{name}_config.json")


def blocks(k: int, n: int) -> int:
    """fp32 scales of a block-fp8 [k, n] weight: one per 128 x 128 block."""
    return 4 * -(-k // 128) * -(-n // 128)


# Each family parsed from the package's file.


def test_qwen3_moe_fields_kv_and_weights_by_hand():
    m = package("Qwen--Qwen3-30B-A3B")
    assert (m.model_type, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == ("qwen3_moe", 128, 8, 768)
    assert (m.shared_expert_intermediate_size, m.first_k_dense_replace, m.norm_topk_prob, m.qk_norm) == (0, 0, True,
                                                                                                          True)
    assert m.kv_bytes_per_token() == 2 * 48 * 4 * 128 * 2  # K and V, 48 layers, 4 KV heads of 128, bf16
    parts = m.weight_bytes_by_part(tp=1)
    assert parts["attention"] == 48 * (2048 * (32 + 2 * 4) * 128 * 2 + 32 * 128 * 2048 * 2 + 2 * 128 * 2)
    assert parts["router"] == 48 * 2048 * 128 * 2
    assert parts["experts"] == 48 * 128 * (2048 * 2 * 768 * 2 + 768 * 2048 * 2)
    assert parts["embeddings"] == 151936 * 2048 * 2 * 2  # untied; 151936 is a multiple of 64
    assert parts["norms"] == 2 * (48 * 2 * 2048 + 2048) and parts["rope_cache"] == 40960 * 128 * 2
    assert m.weight_bytes_per_gpu() == 61_074_731_008  # 56.88 GiB, the sum of the parts
    assert round(m.layout_parameters() / 1e9, 1) == 30.5 and round(m.active_parameters() / 1e9, 1) == 3.4
    # TP 4: a quarter of the heads (one KV head each) and of every expert's intermediate size; EP 4:
    # a quarter of the experts, whole. The same expert bytes in bf16.
    tp4 = m.weight_bytes_by_part(tp=4)
    assert tp4["attention"] == 48 * (2048 * (8 + 2) * 128 * 2 + 8 * 128 * 2048 * 2 + 2 * 128 * 2)
    assert tp4["experts"] == 48 * 128 * (2048 * 2 * 192 * 2 + 192 * 2048 * 2)
    ep4 = m.weight_bytes_by_part(tp=4, enable_expert_parallel=True)
    assert ep4["experts"] == 48 * 32 * (2048 * 2 * 768 * 2 + 768 * 2048 * 2) == tp4["experts"]
    assert m.kv_bytes_per_token(tp=4) == 2 * 48 * 1 * 128 * 2


def test_qwen3_moe_fp8_checkpoint_and_its_tp_limit():
    m = package("Qwen--Qwen3-30B-A3B-FP8")
    assert (m.weight_dtype, m.expert_dtype) == ("fp8-block", "fp8-block")
    parts = m.weight_bytes_by_part(tp=2)
    i = 768 // 2
    assert parts["experts"] == 48 * 128 * (2048 * 2 * i + blocks(2048, 2 * i) + i * 2048 + blocks(i, 2048))
    # 768 / 4 = 192 is not whole 128-wide blocks: vLLM refines the scales to blocks of gcd(128, 192, 2048) = 64
    # (refine_fp8_moe_block_shape); 768 / 16 = 48 leaves gcd 16, under its 32: refused without expert parallelism.
    assert m.weight_bytes_by_part(tp=4)["experts"] > 0
    with pytest.raises(ServesimError, match=r"moe_intermediate_size \(768, in fp8 blocks of 128\)"):
        m.weight_bytes_per_gpu(tp=16)
    assert m.weight_bytes_by_part(tp=4, enable_expert_parallel=True)["experts"] == 48 * 32 * (
        2048 * 1536 + blocks(2048, 1536) + 768 * 2048 + blocks(768, 2048))


def test_mixtral_fields_kv_and_weights_by_hand():
    m = package("mistralai--Mixtral-8x7B-v0.1")
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.layer_types) == (8, 2, 14336, ())
    assert m.kv_bytes_per_token(tp=2) == 2 * 32 * 4 * 128 * 2
    parts = m.weight_bytes_by_part(tp=2)
    assert parts["experts"] == 32 * 8 * (4096 * 2 * 7168 * 2 + 7168 * 4096 * 2)
    assert parts["router"] == 32 * 4096 * 8 * 2
    assert parts["attention"] == 32 * (4096 * (16 + 2 * 4) * 128 * 2 + 16 * 128 * 4096 * 2)
    assert parts["embeddings"] == 32000 // 2 * 4096 * 2 * 2
    assert round(m.layout_parameters() / 1e9, 1) == 46.7 and round(m.active_parameters() / 1e9, 1) == 12.9


@pytest.mark.parametrize("name,experts,dense_layers,vocab", [("deepseek-ai--DeepSeek-V3", 256, 3, 129280),
                                                             ("deepseek-ai--DeepSeek-R1", 256, 3, 129280),
                                                             ("moonshotai--Kimi-K2-Instruct", 384, 1, 163840)])
def test_deepseek_mla_block_fp8_by_hand(name, experts, dense_layers, vocab):
    m = package(name)
    assert (m.num_experts, m.first_k_dense_replace, m.shared_expert_intermediate_size) == (experts, dense_layers, 2048)
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim) == (512, 1536, 64,
                                                                                                     128, 128)
    # One latent of 512 + 64 per token and layer, bf16, the same on every GPU.
    assert m.kv_bytes_per_token(tp=1) == m.kv_bytes_per_token(tp=8) == 61 * (512 + 64) * 2 == 70272
    heads = m.num_attention_heads // 8
    parts = m.weight_bytes_by_part(tp=8)
    attention = ((7168 * 2112 + blocks(7168, 2112))  # fused q_a and kv_a, replicated: 1536 + 512 + 64
                 + (1536 * heads * 192 + blocks(1536, heads * 192)) + 1536 * 2  # q_b, q_a_layernorm
                 + (512 * heads * 256 + blocks(512, heads * 256)) + 512 * 2  # kv_b, kv_a_layernorm
                 + (heads * 128 * 7168 + blocks(heads * 128, 7168))  # o
                 + 2 * 512 * heads * 256)  # W_UK and W_UV in bf16
    assert parts["attention"] == 61 * attention
    expert = 7168 * 512 + blocks(7168, 512) + 256 * 7168 + blocks(256, 7168)  # 2048 / 8 wide
    assert parts["experts"] == (61 - dense_layers) * experts * expert
    assert parts["shared_experts"] == (61 - dense_layers) * (7168 * 512 + blocks(7168, 512) + 256 * 7168
                                                             + blocks(256, 7168))
    assert parts["dense_mlp"] == dense_layers * (7168 * 2 * 2304 + blocks(7168, 4608) + 2304 * 7168
                                                 + blocks(2304, 7168))
    assert parts["router"] == (61 - dense_layers) * (7168 * experts * 2 + experts * 4)  # + fp32 score bias
    assert parts["embeddings"] == vocab // 8 * 7168 * 2 * 2 and parts["rope_cache"] == m.max_position_embeddings * 64 * 2
    ep = m.weight_bytes_by_part(tp=8, enable_expert_parallel=True)["experts"]
    assert ep == (61 - dense_layers) * (experts // 8) * (7168 * 4096 + blocks(7168, 4096) + 2048 * 7168
                                                         + blocks(2048, 7168))


def test_deepseek_v3_parameters_and_preset():
    m = package("deepseek-ai--DeepSeek-V3")
    assert round(m.layout_parameters() / 1e9) == 671 and round(m.active_parameters() / 1e9, 1) == 37.6
    preset = ModelConfig.from_preset("DeepSeek-V3")
    assert preset.weight_bytes_per_gpu(tp=8) == m.weight_bytes_per_gpu(tp=8)
    assert preset.kv_bytes_per_token() == m.kv_bytes_per_token()


def test_kimi_k25_int4_experts_from_its_text_config():
    m = package("moonshotai--Kimi-K2.5")
    assert (m.model_type, m.num_experts, m.weight_dtype, m.expert_dtype) == ("kimi_k2", 384, "bf16", "int4")
    parts = m.weight_bytes_by_part(tp=8)
    # int4, two to a byte, one bf16 scale per 32 inputs.
    expert = (7168 * 512 // 2 + 2 * (7168 // 32) * 512) + (256 * 7168 // 2 + 2 * (256 // 32) * 7168)
    assert parts["experts"] == 60 * 384 * expert
    assert parts["shared_experts"] == 60 * (7168 * 512 * 2 + 256 * 7168 * 2)  # bf16: ignored by the quantization


@pytest.mark.parametrize("name,form", [("nvidia--Kimi-K2.5-NVFP4", "compressed-tensors"),
                                       ("nvidia--MiniMax-M2.5-NVFP4", "ModelOpt")])
def test_nvfp4_checkpoints_price_their_experts_in_nvfp4(name, form):
    # NVIDIA's NVFP4 checkpoints (ModelOpt), written as compressed-tensors (Kimi) or ModelOpt's own
    # quantization_config (MiniMax): e2m1 weights, one e4m3 scale per 16 inputs; attention excluded.
    m = package(name)
    assert (m.weight_dtype, m.expert_dtype) == ("bf16", "nvfp4")
    assert m.name == name.replace("--", "/")  # (the package's ORG--NAME_config.json, not its folder)
    assert linear_bytes(7168, 512, "nvfp4") == 7168 * 512 // 2 + (7168 // 16) * 512
    h, i, layers = m.hidden_size, m.moe_intermediate_size, m.num_moe_layers
    expert = linear_bytes(h, 2 * i // 8, "nvfp4") + linear_bytes(i // 8, h, "nvfp4")  # TP 8: a slice of each
    assert m.weight_bytes_by_part(tp=8)["experts"] == layers * m.num_experts * expert


def test_nvfp4_is_w4a4_on_blackwell_and_weight_only_elsewhere():
    """A long prefill's NVFP4 expert GEMM is compute-bound: on a GPU with fp4 tensor cores (B200) at the
    fp8 rate the roofline takes for them; on an H100, which has none, vLLM runs Marlin's weight-only
    kernel on bf16 tensor cores, so at the bf16 rate (it was taken at fp8's, twice too fast)."""
    from backends.costmodel.roofline import fp4_native
    from backends.hardware import Hardware

    m = package("nvidia--MiniMax-M2.5-NVFP4")
    assert [fp4_native(n) for n in ("b200_sxm", "GB300", "rtx_pro_6000_server", "H100-SXM", "h200_sxm", "l40s")] \
        == [True, True, True, False, False, False]
    h100 = HARDWARE["H100-SXM"]
    t, k, n = 65536, 3072, 1536
    for hw, rate in ((h100, h100.peak_bf16_flops),
                     (Hardware(**{**h100.__dict__, "name": "B200-like"}), h100.peak_fp8_flops)):
        cm = MoERooflineCostModel(m, hw, tp=1)
        assert float(cm._gemm(t, k, n, "nvfp4")) == pytest.approx(2.0 * t * k * n / (rate * cm.eff.gemm), rel=1e-12)


def test_a_modelopt_checkpoint_states_its_quantization_beside_config_json(tmp_path):
    # nvidia/DeepSeek-V3.1-NVFP4's config.json has no quantization_config: vLLM reads hf_quant_config.json
    # beside it (the package ships it as ORG--NAME_hf_quant_config.json), and so does servesim.
    m = package("nvidia--DeepSeek-V3.1-NVFP4")
    assert (m.name, m.weight_dtype, m.expert_dtype) == ("nvidia/DeepSeek-V3.1-NVFP4", "bf16", "nvfp4")
    # A dense model's NVFP4 checkpoint (every linear but the LM head) is served in fp4 whatever --dtype.
    dense = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
             "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 512, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(dense))
    quant = {"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(quant))
    m = ModelConfig.from_hf(tmp_path)
    assert (m.weight_dtype, m.served_dtype("bf16"), m.served_dtype("fp8")) == ("nvfp4", "fp4", "fp4")
    quant["quantization"]["exclude_modules"] = ["lm_head", "model.layers.0.self_attn*"]
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(quant))
    with pytest.raises(ServesimError, match="every linear but the LM head quantized"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"producer": {}}))
    with pytest.raises(ServesimError, match="hf_quant_config.json: no \"quantization\" object in it"):
        ModelConfig.from_hf(tmp_path)


def test_a_checkpoints_fp8_kv_cache_is_what_auto_resolves_to(tmp_path):
    # vLLM resolves --kv-cache-dtype auto to the KV cache a checkpoint's quantization states
    # (resolve_kv_cache_dtype_string): ModelOpt's kv_cache_quant_algo, a kv_cache_scheme of 8-bit floats.
    from backends.model_config import checkpoint_kv_cache
    from sim.app.plan import resolve
    from sim.app.replay import ReplayOptions

    assert package("nvidia--Kimi-K2.5-NVFP4").kv_cache_dtype == "fp8"  # (its compressed-tensors kv_cache_scheme)
    assert package("nvidia--DeepSeek-V3.1-NVFP4").kv_cache_dtype == "fp8"  # (hf_quant_config.json's FP8)
    assert package("moonshotai--Kimi-K2.5").kv_cache_dtype == ""
    assert checkpoint_kv_cache({"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}) == "fp8"
    assert checkpoint_kv_cache({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}) == "fp8"
    assert checkpoint_kv_cache({"kv_cache_scheme": None, "quant_method": "fp8"}) == ""
    assert "kv_cache_dtype" not in resolve_model("Llama-3.1-8B").describe()
    config = str(CONFIGS / "nvidia--MiniMax-M2.5-NVFP4_config.json")
    plan = resolve(ReplayOptions(model=config, hardware="b200_sxm", tp=4), build_backend=False)
    assert plan.options.kv_cache_dtype == "fp8"
    plan = resolve(ReplayOptions(model=config, hardware="b200_sxm", tp=4, kv_cache_dtype="fp8"), build_backend=False)
    assert plan.options.kv_cache_dtype == "fp8"


def test_an_nvfp4_checkpoint_that_quantizes_attention(tmp_path):
    # nvidia/Qwen3-235B-A22B-NVFP4 quantizes its attention's linears too (hf_quant_config.json excludes only
    # the routers); an MLA model's projections in nvfp4 are refused (MLA is priced from its module tables).
    m = package("nvidia--Qwen3-235B-A22B-NVFP4")
    assert (m.weight_dtype, m.expert_dtype, m.kv_cache_dtype) == ("nvfp4", "nvfp4", "fp8")
    assert m.weight_bytes_by_part(tp=4)["attention"] == 94 * (linear_bytes(4096, (64 // 4 + 2 * 1) * 128, "nvfp4")
                                                               + linear_bytes(64 // 4 * 128, 4096, "nvfp4")
                                                               + 2 * 128 * 2)  # (q and k norms: bf16)
    raw = json.loads((CONFIGS / "nvidia--Kimi-K2.5-NVFP4_config.json").read_text())
    raw["quantization_config"]["ignore"] = ["language_model.lm_head"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ServesimError, match="an NVFP4 checkpoint that quantizes MLA's projections"):
        ModelConfig.from_hf(tmp_path)


def test_gpt_oss_sliding_sinks_mxfp4_by_hand():
    m = package("openai--gpt-oss-120b")
    assert m.layer_types == ("sliding_attention", "full_attention") * 18 and m.sliding_window == 128
    assert (m.attention_sinks, m.attention_bias, m.weight_dtype, m.expert_dtype) == (True, True, "bf16", "mxfp4")
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (128, 4, 2880)
    assert m.kv_bytes_per_token() == 2 * 36 * 8 * 64 * 2
    parts = m.weight_bytes_by_part(tp=1)
    # MXFP4: half a byte a weight and one scale byte per 32 inputs; biases bf16.
    expert = (2880 * 5760 // 2 + 90 * 5760) + (2880 * 2880 // 2 + 90 * 2880) + (5760 + 2880) * 2
    assert parts["experts"] == 36 * 128 * expert
    qkv = (64 + 16) * 64
    assert parts["attention"] == 36 * (2880 * qkv * 2 + 64 * 64 * 2880 * 2 + qkv * 2 + 2880 * 2 + 64 * 2)
    assert parts["router"] == 36 * (2880 * 128 * 2 + 128 * 2)
    assert ModelConfig.from_preset("gpt-oss-120b").weight_bytes_per_gpu() == m.weight_bytes_per_gpu()


def test_minimax_m2_reads_its_experts_from_intermediate_size():
    m = package("MiniMaxAI--MiniMax-M2.5")
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size) == (
        256, 8, 1536, 0)
    assert m.expert_dtype == "fp8-block" and m.kv_bytes_per_token() == 2 * 62 * 8 * 128 * 2
    assert m.weight_bytes_by_part(tp=4)["experts"] == 62 * 256 * (3072 * 768 + blocks(3072, 768) + 384 * 3072
                                                                  + blocks(384, 3072))


def write(tmp_path, config, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_dense_sliding_window_models(tmp_path):
    mistral = ModelConfig.from_hf(write(tmp_path, MISTRAL_7B_V01, "mistral"))
    assert mistral.layer_types == ("sliding_attention",) * 32 and mistral.sliding_window == 4096
    assert mistral.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    dense = ModelConfig.from_preset("Mistral-7B")  # v0.3: the same layers, no window, a larger vocabulary
    assert (mistral.weight_bytes_per_gpu() - dense.weight_bytes_per_gpu()
            == (32000 - 32768) * 4096 * 2 * 2 + (32768 - 32768) * 128 * 2)
    gemma3 = ModelConfig.from_hf(write(tmp_path, GEMMA3_1B, "gemma3"))
    full = [i for i, t in enumerate(gemma3.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23] and gemma3.tie_word_embeddings and gemma3.qk_norm and gemma3.sandwich_norms
    assert gemma3.kv_bytes_per_token() == 2 * 26 * 1 * 256 * 2
    assert gemma3.weight_bytes_by_part()["norms"] == 2 * (26 * 4 * 1152 + 1152)
    gemma2 = ModelConfig.from_hf(write(tmp_path, GEMMA2_9B, "gemma2"))
    assert gemma2.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma2.num_sliding_layers == 21


# vLLM's KV cache groups and capacity (worked examples).


def test_kv_cache_groups_as_vllm_makes_them(tmp_path):
    # gpt-oss: 18 sliding + 18 full: two groups of 18.
    assert kv_cache_groups(resolve_model("gpt-oss-120b")) == [KVCacheGroup("sliding_attention", 18, 128),
                                                              KVCacheGroup("full_attention", 18)]
    # Gemma 3 1B: 22 sliding + 4 full; the group size is 4 (22 >= 1.5 x 4): one full group, six
    # sliding ones of layers[i::6] (4, 4, 4, 4, 3, 3 layers).
    gemma3 = ModelConfig.from_hf(write(tmp_path, GEMMA3_1B, "gemma3"))
    assert [(g.kind[:4], g.num_layers) for g in kv_cache_groups(gemma3)] == [("slid", 4)] * 4 + [("slid", 3)] * 2 + [
        ("full", 4)]
    # Every layer alike (all full, all MLA, all sliding): one group of all of them.
    assert kv_cache_groups(resolve_model("DeepSeek-V3")) == [KVCacheGroup("full_attention", 61)]
    mistral = ModelConfig.from_hf(write(tmp_path, MISTRAL_7B_V01, "mistral"))
    assert kv_cache_groups(mistral) == [KVCacheGroup("sliding_attention", 32, 4096)]


def test_sliding_window_capacity_worked_example():
    m = resolve_model("gpt-oss-120b")
    available = 10 * 2**30
    v = vllm_kv_cache(m, available, block_size=16, max_model_len=131072, max_in_flight_tokens=2 * 2048)
    page = 16 * 2 * 8 * 64 * 2  # one layer's block: K and V of 8 heads of 64, bf16
    assert v["page_bytes_per_layer"] == page and v["bytes_per_block"] == 18 * page
    assert v["num_blocks"] == available // (18 * page) == 18204
    # A request of 131072 tokens: every block of the full group, and of the sliding group
    # cdiv(min(128 - 1 + 4096, 131072), 16) + 1 = 265.
    assert [g["max_blocks_per_request"] for g in v["groups"]] == [265, 8192]
    assert v["tokens"] == int(18204 / (265 + 8192) * 131072) == 282137


def test_mla_capacity_worked_example():
    m = resolve_model("DeepSeek-V3")
    available = 40 * 2**30
    v = vllm_kv_cache(m, available, block_size=64, max_model_len=163840, max_in_flight_tokens=4096, tp=8)
    assert v["page_bytes_per_layer"] == 64 * 576 * 2  # MLAAttentionSpec: one head of 512 + 64
    assert v["num_blocks"] == available // (61 * 64 * 576 * 2) == 9549
    assert v["tokens"] == int(9549 / (163840 // 64) * 163840) == 9549 * 64


def test_blocks_a_request_holds_per_group():
    window = KVCacheGroup("sliding_attention", 18, 128)
    full = KVCacheGroup("full_attention", 18)
    assert full.blocks_held(1000, 1001, 16) == 63
    # 1000 computed: tokens before 1000 - 128 + 1 = 873 are skipped: 873 // 16 = 54 blocks freed.
    assert window.blocks_held(1000, 1001, 16) == 63 - 54
    assert window.blocks_held(100, 101, 16) == 7  # all inside the window
    assert window.blocks_held(0, 2048, 16) == 128  # a first prefill chunk holds all its blocks


@given(st.integers(1, 4096), st.integers(0, 4096), st.sampled_from([None, 1, 7, 128, 4096]))
def test_window_pairs_counts_each_tokens_keys(q, before, window):
    c = before + q
    assert window_pairs(q, c, window) == sum(min(n, window or n) for n in range(c - q + 1, c + 1))


def test_hybrid_model_blocks_are_vllms_pool_and_start_check():
    m = resolve_model("gpt-oss-120b")
    kv = kv_capacity(m, HARDWARE["H200"], block_size=16, gpu_memory_utilization=0.9, max_num_batched_tokens=2048,
                     max_num_seqs=256, max_model_len=131072)
    assert kv.num_gpu_blocks == kv.vllm["num_blocks"] == kv.terms["available"] // (18 * 16 * 2048)
    assert kv.as_dict()["vllm"]["tokens"] > 131072
    with pytest.raises(ServesimError, match="shared by 2 KV cache groups"):
        kv_capacity(m, HARDWARE["H100-SXM"], block_size=16, gpu_memory_utilization=0.85, max_num_batched_tokens=2048,
                    max_num_seqs=256, max_model_len=131072)


def test_dense_models_carry_no_vllm_section():
    kv = kv_capacity(resolve_model("Llama-3.1-8B"), HARDWARE["H100-SXM"], block_size=16, gpu_memory_utilization=0.9,
                     max_num_batched_tokens=2048, max_num_seqs=256)
    assert kv.vllm is None and "vllm" not in kv.as_dict()
    assert "model_type" not in resolve_model("Llama-3.1-8B").describe()


# Refusals naming the field.


@pytest.mark.parametrize("name,field", [("deepseek-ai--DeepSeek-V4-Flash", "model_type 'deepseek_v4'"),
                                        ("google--gemma-4-26B-A4B", "model_type 'gemma4_text'"),
                                        ("Qwen--Qwen3.5-35B-A3B", "model_type 'qwen3_5_moe_text'")])
def test_unpriceable_package_configs_are_refused(name, field):
    with pytest.raises(ServesimError) as e:
        package(name)
    assert field in str(e.value) and name in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("change,field", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block_size"),
    ({"quantization_config": {"quant_method": "modelopt"}}, "quant_method = 'modelopt'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"q_lora_rank": 1536, "kv_lora_rank": None}, "q_lora_rank"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
])
def test_unpriceable_fields_are_refused(tmp_path, change, field):
    raw = json.loads((CONFIGS / "deepseek-ai--DeepSeek-V3_config.json").read_text())
    folder = write(tmp_path, {**raw, **change}, "m")
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(folder)
    assert field in str(e.value) and str(folder / "config.json") in str(e.value)


def test_expert_parallel_needs_experts():
    with pytest.raises(ServesimError, match="--enable-expert-parallel"):
        kv_capacity(resolve_model("Llama-3.1-8B"), HARDWARE["H100-SXM"], block_size=16, gpu_memory_utilization=0.9,
                    max_num_batched_tokens=2048, max_num_seqs=256, enable_expert_parallel=True)


# The roofline's MoE step.


def decode_batch(contexts):
    b = Batch()
    for i, c in enumerate(contexts):
        b.add(str(i), int(c) - 1, 1, [], needs_logits=True, is_decode=True)
    return b


def test_one_token_reads_its_top_k_experts():
    hw = HARDWARE["H100-SXM"]
    be = MoERooflineCostModel(resolve_model("Qwen3-30B-A3B"), hw)
    bw = hw.memory_bandwidth * 0.85
    moe = be.execute(decode_batch([100])).breakdown["moe"]
    gate_up = 8 * linear_bytes(2048, 1536, "bf16") + 8 * (2048 + 1536) * 2
    down = 8 * linear_bytes(768, 2048, "bf16") + 8 * (768 + 2048) * 2
    assert moe == pytest.approx(48 * (gate_up + down) / bw, rel=1e-12)
    # 16 tokens route 128 assignments: every expert, evenly; more tokens read no more weights.
    all_experts = be.execute(decode_batch([100] * 16)).breakdown["moe"]
    assert all_experts == pytest.approx(48 * (128 * (linear_bytes(2048, 1536, "bf16") + linear_bytes(768, 2048, "bf16"))
                                              + 128 * (2048 + 1536 + 768 + 2048) * 2) / bw, rel=1e-12)


def test_expert_parallel_splits_the_assignments():
    m, hw = resolve_model("Qwen3-30B-A3B"), HARDWARE["H100-SXM"]
    tp = MoERooflineCostModel(m, hw, tp=4).execute(decode_batch([100] * 64)).breakdown
    ep = MoERooflineCostModel(m, hw, tp=4, enable_expert_parallel=True).execute(decode_batch([100] * 64)).breakdown
    assert ep["moe"] == pytest.approx(tp["moe"], rel=0.02)  # the same weights and FLOPs per GPU, all experts busy
    one = MoERooflineCostModel(m, hw, tp=4, enable_expert_parallel=True).execute(decode_batch([100])).breakdown
    one_tp = MoERooflineCostModel(m, hw, tp=4).execute(decode_batch([100])).breakdown
    assert one["moe"] < one_tp["moe"]  # one token: 8 whole experts over 4 GPUs, 2 each, vs 8 slices on every GPU


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "DeepSeek-V3"])
def test_decode_run_equals_step_by_step(name):
    tp = 8 if name == "DeepSeek-V3" else 1
    be = MoERooflineCostModel(resolve_model(name), HARDWARE["H200"], tp=tp)
    assert be.supports_fast_forward
    contexts = [17, 300, 4096, 2]
    run = be.decode_run(contexts, 5)[0]
    for j in range(5):
        assert be.execute(decode_batch([c + j for c in contexts])).seconds == run[j]


def test_sliding_layers_attend_over_their_window():
    m, hw = resolve_model("gpt-oss-120b"), HARDWARE["H100-SXM"]
    be = MoERooflineCostModel(m, hw)
    assert not be.supports_fast_forward
    short, long = (be.execute(decode_batch([c])).breakdown["attention"] for c in (128, 128 * 65))
    # 18 full layers read 65x the keys; 18 sliding layers read the same 128.
    one_full = be._attention_one_layer(1, 128, None)
    assert long == pytest.approx(short + 18 * (be._attention_one_layer(1, 128 * 65, None) - one_full), rel=1e-12)
    assert be._attention_one_layer(1, 128 * 65, 128) == be._attention_one_layer(1, 128, 128)


def test_presets_are_the_package_files():
    for preset, name in [("Qwen3-30B-A3B", "Qwen--Qwen3-30B-A3B"), ("Qwen3-235B-A22B", "Qwen--Qwen3-235B-A22B"),
                         ("DeepSeek-V3", "deepseek-ai--DeepSeek-V3"), ("gpt-oss-120b", "openai--gpt-oss-120b"),
                         ("Mixtral-8x7B", "mistralai--Mixtral-8x7B-v0.1")]:
        a, b = ModelConfig.from_preset(preset).describe(), package(name).describe()
        a.pop("name"), b.pop("name")
        assert a == b and preset in MODELS


def test_replay_a_moe_model_end_to_end(tmp_path):
    from sim.app.cli import main

    out = tmp_path / "run"
    assert main(["replay", "traces/samples/azure_conv_2023_first5min.csv", "--model", "Qwen3-30B-A3B", "--hardware",
                 "H100-SXM", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["num_experts"] == 128
    assert summary["kv_cache"]["vllm"]["tokens"] >= summary["kv_cache"]["num_gpu_blocks"] * 16 * 0.99
    assert np.isfinite(summary["tpot"]["mean"]) and summary["tpot"]["mean"] > 0


def test_expert_parallel_flag_reaches_the_run(tmp_path):
    from sim.app.cli import main

    runs = {}
    for name, extra in (("tp", []), ("ep", ["--enable-expert-parallel"])):
        out = tmp_path / name
        assert main(["replay", "traces/samples/azure_conv_2023_first5min.csv", "--model", "Qwen3-30B-A3B", "--tp", "2",
                     "--out", str(out), "--quiet", *extra]) == 0
        runs[name] = json.loads((out / "summary.json").read_text())
    assert runs["ep"]["options"]["enable_expert_parallel"] is True
    assert "enable_expert_parallel" not in runs["tp"]["options"]  # runs without it keep their files
    assert runs["ep"]["kv_cache"]["bytes_per_gpu"]["weights"] == runs["tp"]["kv_cache"]["bytes_per_gpu"]["weights"]


@pytest.mark.slow
def test_replay_gpt_oss_end_to_end(tmp_path):
    from sim.app.cli import main

    out = tmp_path / "run"
    assert main(["replay", "traces/samples/azure_conv_2023_first5min.csv", "--model", "gpt-oss-120b", "--hardware",
                 "H200", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    vllm = summary["kv_cache"]["vllm"]
    assert [g["kind"] for g in vllm["groups"]] == ["sliding_attention", "full_attention"]
    assert summary["kv_cache"]["num_gpu_blocks"] == vllm["num_blocks"]


def test_data_parallel_ranks_share_the_experts():
    """--dp 2 --tp 2: attention split by TP 2 on each rank; the experts over all 4 GPUs (MoE TP 4,
    or EP 4 with whole experts); each rank keeps its own KV cache of TP 2's heads."""
    m = resolve_model("Qwen3-235B-A22B")
    assert m.moe_parallel(tp=2, dp=2) == (4, 1) and m.moe_parallel(tp=2, dp=2, enable_expert_parallel=True) == (1, 4)
    dp = m.weight_bytes_by_part(tp=2, dp=2)
    tp2 = m.weight_bytes_by_part(tp=2)
    assert dp["attention"] == tp2["attention"] == 94 * (4096 * (32 + 2 * 2) * 128 * 2 + 32 * 128 * 4096 * 2
                                                        + 2 * 128 * 2)
    assert dp["experts"] == 94 * 128 * (4096 * 2 * 384 * 2 + 384 * 4096 * 2) == tp2["experts"] // 2
    ep = m.weight_bytes_by_part(tp=2, dp=2, enable_expert_parallel=True)
    assert ep["experts"] == 94 * 32 * (4096 * 2 * 1536 * 2 + 1536 * 4096 * 2)
    assert m.local_experts(tp=3, dp=1, enable_expert_parallel=True) == 43  # 128 = 43 + 43 + 42: the largest
    with pytest.raises(ServesimError, match=r"--tp 1 --dp 3 does not split model Mixtral-8x7B: its "
                                            r"moe_intermediate_size \(14336\) cannot be divided among 3 GPUs"):
        resolve_model("Mixtral-8x7B").weight_bytes_per_gpu(tp=1, dp=3)
    assert resolve_model("Mixtral-8x7B").weight_bytes_per_gpu(tp=1, dp=3, enable_expert_parallel=True) > 0
