"""Model shapes from presets and Hugging Face config files; the per-GPU arithmetic under TP and fp8."""

import json

import pytest

from backends.model_config import Gemm, ModelConfig, resolve_model
from backends.presets import MODELS
from sim.errors import ServesimError

# config.json files as the hub serves them (the fields that matter, and a few that do not).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "vocab_size": 32768}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_size": 4096,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "vocab_size": 151936}
QWEN3_06B = {**QWEN3_8B, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "tie_word_embeddings": True}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064}


def write(tmp_path, config, name="model"):
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def transformers5(config):
    """The same config as transformers 5 saves it: RoPE settings in one rope_parameters object."""
    out = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
    out["rope_parameters"] = {"rope_theta": config["rope_theta"], **(config.get("rope_scaling") or {"rope_type": "default"})}
    return out


SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps",
                "tie_word_embeddings", "qk_norm")


@pytest.mark.parametrize("preset,config", [("Llama-3.1-8B", LLAMA_31_8B), ("Mistral-7B", MISTRAL_7B_V03),
                                           ("Qwen3-8B", QWEN3_8B), ("Qwen3-0.6B", QWEN3_06B)])
@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_a_config_of_each_family_is_its_preset(tmp_path, preset, config, layout):
    folder = write(tmp_path, config if layout == "hub" else transformers5(config), preset)
    read, ours = ModelConfig.from_hf(folder), ModelConfig.from_preset(preset)
    assert {f: getattr(read, f) for f in SHAPE_FIELDS} == {f: getattr(ours, f) for f in SHAPE_FIELDS}
    assert read.name == preset and read.architecture == config["architectures"][0]
    for tp in (1, 2, 4):
        assert read.gemms(tp) == ours.gemms(tp)
        assert read.weight_bytes_per_gpu(tp) == ours.weight_bytes_per_gpu(tp)
    assert ModelConfig.from_hf(folder / "config.json") == read  # the file itself, or its folder
    assert resolve_model(str(folder)) == read and resolve_model(preset) == ours


def test_preset_configs_keep_the_preset_values():
    for name, fields in MODELS.items():
        cfg = ModelConfig.from_preset(name)
        assert {f: getattr(cfg, f) for f in fields} == fields


def test_parameter_counts_match_the_published_sizes(tmp_path):
    assert ModelConfig.from_preset("Llama-3.1-8B").num_parameters == 8_030_261_248
    qwen25 = ModelConfig.from_hf(write(tmp_path, QWEN25_7B))
    assert qwen25.qkv_bias and qwen25.num_key_value_heads == 4 and qwen25.head_dim == 128
    assert qwen25.num_parameters == 7_615_616_512  # Qwen2.5-7B's 7.61B, q/k/v biases included


def test_llama_weights_per_gpu_are_what_vllm_loads():
    m = ModelConfig.from_preset("Llama-3.1-8B")
    # 8,030,261,248 bf16 parameters and RoPE's cos/sin cache of 131072 x 128 bf16: vLLM's
    # "Model loading took 14.9888 GiB".
    assert m.weight_bytes_per_gpu() == 2 * 8_030_261_248 + 2 * 131072 * 128
    assert round(m.weight_bytes_per_gpu() / 2**30, 4) == 14.9888


def test_gqa_head_dim_and_qk_norm_are_read(tmp_path):
    no_head_dim = {k: v for k, v in MISTRAL_7B_V03.items()}
    cfg = ModelConfig.from_hf(write(tmp_path, {**no_head_dim, "num_key_value_heads": 4, "head_dim": None}))
    assert cfg.head_dim == 4096 // 32 and cfg.num_queries_per_kv == 8 and not cfg.qk_norm
    assert ModelConfig.from_hf(write(tmp_path, QWEN3_8B, "q")).qk_norm
    without_kv = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_hf(write(tmp_path, without_kv, "mha")).num_key_value_heads == 32  # plain MHA


def test_both_rope_layouts_read_alike_and_must_agree(tmp_path):
    hub = ModelConfig.from_hf(write(tmp_path, LLAMA_31_8B, "hub"))
    t5 = ModelConfig.from_hf(write(tmp_path, transformers5(LLAMA_31_8B), "t5"))
    assert hub.rope_theta == t5.rope_theta == 500000.0 and hub.rope_scaling == t5.rope_scaling
    assert t5.rope_scaling == MODELS["Llama-3.1-8B"]["rope_scaling"]
    old = {**LLAMA_31_8B, "rope_scaling": {**{k: v for k, v in LLAMA_31_8B["rope_scaling"].items()
                                              if k != "rope_type"}, "type": "llama3"}}
    assert ModelConfig.from_hf(write(tmp_path, old, "old")).rope_scaling == hub.rope_scaling  # "type", older files
    both = {**transformers5(LLAMA_31_8B), "rope_theta": 10000.0}
    with pytest.raises(ServesimError, match="disagree"):
        ModelConfig.from_hf(write(tmp_path, both, "both"))


def test_rope_is_read_as_transformers_reads_both_layouts_together(tmp_path):
    """transformers' convert_rope_params_to_dict: the top-level rope_scaling where set, else
    rope_parameters; rope_parameters' own rope_theta first. A null rope_scaling beside rope_parameters
    (nvidia/Kimi-K2.7-Code-NVFP4 writes both) reads rope_parameters; two set values that differ are refused."""
    t5 = transformers5(LLAMA_31_8B)
    hub = ModelConfig.from_hf(write(tmp_path, LLAMA_31_8B, "hub"))
    for extra in ({"rope_scaling": None}, {"rope_theta": 500000.0, "rope_scaling": None},
                  {"rope_theta": 500000, "rope_scaling": LLAMA_31_8B["rope_scaling"]},
                  {"rope_scaling": {}}):  # empty: falsy to transformers' `rope_scaling or rope_parameters`
        m = ModelConfig.from_hf(write(tmp_path, {**t5, **extra}, "mixed"))
        assert (m.rope_theta, m.rope_scaling) == (hub.rope_theta, hub.rope_scaling), extra
    # rope_parameters without its own theta takes the top level's, as transformers' setdefault does
    params = {k: v for k, v in t5["rope_parameters"].items() if k != "rope_theta"}
    m = ModelConfig.from_hf(write(tmp_path, {**t5, "rope_parameters": params, "rope_theta": 500000.0}, "theta"))
    assert (m.rope_theta, m.rope_scaling) == (hub.rope_theta, hub.rope_scaling)
    # a rope_scaling with its own rope_theta: transformers takes that object whole, its theta included
    inner = {**LLAMA_31_8B["rope_scaling"], "rope_theta": 500000.0}
    m = ModelConfig.from_hf(write(tmp_path, {**LLAMA_31_8B, "rope_theta": None, "rope_scaling": inner}, "inner"))
    assert (m.rope_theta, m.rope_scaling) == (hub.rope_theta, hub.rope_scaling)
    with pytest.raises(ServesimError, match="top-level rope_theta .10000.0. and rope_scaling's own .500000.0. disagree"):
        ModelConfig.from_hf(write(tmp_path, {**LLAMA_31_8B, "rope_theta": 10000.0, "rope_scaling": inner}, "inner2"))
    other = {**LLAMA_31_8B["rope_scaling"], "factor": 16.0}
    with pytest.raises(ServesimError, match="disagree"):
        ModelConfig.from_hf(write(tmp_path, {**t5, "rope_scaling": other}, "two"))
    for bad, said in (({"rope_theta": "5e5"}, "rope_theta = '5e5', expected a number"),
                      ({"rope_parameters": {"rope_theta": True}}, "rope_theta = True, expected a number"),
                      ({"rope_scaling": 2.0}, "rope_scaling = 2.0, expected an object or null")):
        with pytest.raises(ServesimError, match=said):
            ModelConfig.from_hf(write(tmp_path, {**t5, **bad}, "bad"))


def test_rope_parameters_per_layer_type_read_as_the_full_attention_layers(tmp_path):
    """transformers 5 saves Gemma 3's RoPE as one object per layer type (Gemma3TextConfig's
    convert_rope_params_to_dict: rope_theta and rope_scaling go to full_attention, rope_local_base_freq
    to sliding_attention); servesim reads the full_attention one, as the flat layout states it. It was
    read as plain RoPE at 10,000."""
    from tests.moe_configs import GEMMA3_1B

    scaling = {"rope_type": "linear", "factor": 8.0}
    flat = ModelConfig.from_hf(write(tmp_path, {**GEMMA3_1B, "rope_scaling": scaling}, "flat"))
    nested = {k: v for k, v in GEMMA3_1B.items() if k != "rope_theta"}
    nested["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {**scaling, "rope_theta": 1000000.0}}
    m = ModelConfig.from_hf(write(tmp_path, nested, "nested"))
    assert (m.rope_theta, m.rope_scaling) == (flat.rope_theta, flat.rope_scaling) == (1000000.0, scaling)
    nested["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    with pytest.raises(ServesimError, match="rope_parameters holds one object per layer type but no full_attention"):
        ModelConfig.from_hf(write(tmp_path, nested, "sliding"))


@pytest.mark.parametrize("change,field", [
    ({"num_local_experts": 8, "model_type": "mixtral"}, "num_experts_per_tok"),  # MoE fields missing
    ({"num_experts": 128, "model_type": "qwen3_moe", "num_experts_per_tok": 8}, "moe_intermediate_size"),
    ({"n_routed_experts": 256}, "n_routed_experts"),  # experts in a dense family
    ({"kv_lora_rank": 512, "q_lora_rank": 1536}, "kv_lora_rank"),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, "sliding_window = 4096"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"model_type": "gemma2"}, "sliding_window is null"),
    ({"model_type": "llama4_text"}, "no num_experts (or num_local_experts, n_routed_experts)"),  # transformers: 16
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
      "mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"model_type": "deepseek_v3", "index_topk": 2048}, "index_topk"),
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
      "quantization_config": {"quant_method": "modelopt"}}, "quant_method = 'modelopt'"),
    ({"hidden_size": None}, "no hidden_size"),
    # A model_type that is not text (a list, an object) was an internal error (TypeError: unhashable type).
    ({"model_type": ["llama"]}, "model_type = ['llama'], expected text"),
    ({"model_type": {"a": 1}}, "model_type = {'a': 1}, expected text"),
    ({"model_type": "gemma3", "text_config": {"model_type": ["gemma3_text"]}},
     "text_config's model_type = ['gemma3_text'], expected text"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers = '32'"),
    # A quantization_config's lists and objects of another type were internal errors (TypeError, AttributeError).
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}}, "weight_block_size = 128"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": [1]}},
     "config_groups = [1], expected an object"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": [8]}}}},
     "weights = [8], expected an object"),
    ({"quantization_config": {"quant_algo": "NVFP4", "exclude_modules": 5}},
     "exclude_modules = 5, expected a list of module names"),
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
      "quantization_config": {"quant_method": "compressed-tensors", "ignore": "lm_head", "config_groups": {
          "g": {"weights": {"num_bits": 4, "type": "int", "group_size": 32}}}}},
     "ignore = 'lm_head', expected a list of module names"),
])
def test_unpriceable_configs_are_refused_naming_file_and_field(tmp_path, change, field):
    folder = write(tmp_path, {**MISTRAL_7B_V03, **change})
    with pytest.raises(ServesimError) as e:
        ModelConfig.from_hf(folder)
    message = str(e.value)
    assert field in message and str(folder / "config.json") in message and "\n" not in message


def test_inactive_sliding_windows_are_accepted(tmp_path):
    assert ModelConfig.from_hf(write(tmp_path, QWEN25_7B)).hidden_size == 3584  # use_sliding_window false
    full = {**QWEN3_8B, "layer_types": ["full_attention"] * 36}
    assert ModelConfig.from_hf(write(tmp_path, full, "full")).num_hidden_layers == 36


def test_unknown_names_and_missing_files(tmp_path):
    with pytest.raises(ServesimError, match="not a preset"):
        resolve_model("Llama-9")
    with pytest.raises(ServesimError, match="no such file"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ServesimError, match="cannot read it as JSON"):
        ModelConfig.from_hf(tmp_path)


def test_tp2_halves_the_per_gpu_gemms_and_kv():
    m = ModelConfig.from_preset("Llama-3.1-8B")
    assert m.gemms(1) == [Gemm("qkv", 4096, 6144), Gemm("o", 4096, 4096), Gemm("gate_up", 4096, 28672),
                          Gemm("down", 14336, 4096)]
    assert m.gemms(2) == [Gemm("qkv", 4096, 3072), Gemm("o", 2048, 4096), Gemm("gate_up", 4096, 14336),
                          Gemm("down", 7168, 4096)]
    assert m.kv_bytes_per_token(1) == 2 * 32 * 8 * 128 * 2 == 2 * m.kv_bytes_per_token(2)
    # 8 KV heads on 16 GPUs: each keeps one (replicated), so 16 GPUs hold no less KV per token than 8.
    assert m.num_kv_heads_per_gpu(16) == m.num_kv_heads_per_gpu(8) == 1
    assert m.gemms(16)[0] == Gemm("qkv", 4096, (2 + 2) * 128)
    with pytest.raises(ServesimError, match="--tp 3 does not split"):
        m.gemms(3)


def test_fp8_halves_the_weight_and_kv_bytes():
    m = ModelConfig.from_preset("Qwen3-8B")
    linear = m.num_hidden_layers * sum(g.k * g.n for g in m.gemms(1))
    assert m.weight_bytes_per_gpu(1, "bf16") - m.weight_bytes_per_gpu(1, "fp8") == linear  # 2 bytes -> 1
    assert m.kv_bytes_per_token(1, "fp8") * 2 == m.kv_bytes_per_token(1, "auto")
    assert m.kv_bytes_per_token(2, "fp8") * 4 == m.kv_bytes_per_token(1, "auto")


# A dense checkpoint's own quantization (quantization_config), as vLLM serves it.

FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
MODELOPT_FP8 = {"quant_algo": "FP8", "producer": {"name": "modelopt", "version": "0.31.0"},
                "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 8, "type": "float"}}}}
CT_FP8 = {"quant_method": "compressed-tensors",
          "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}


@pytest.mark.parametrize("quantization, weight_dtype", [
    (None, ""), (FP8_BLOCK, "fp8-block"), ({"quant_method": "fp8"}, "fp8"), (MODELOPT_FP8, "fp8"), (CT_FP8, "fp8"),
])
def test_a_dense_checkpoints_quantization_is_read(tmp_path, quantization, weight_dtype):
    config = {**QWEN3_8B, **({"quantization_config": quantization} if quantization else {})}
    assert ModelConfig.from_hf(write(tmp_path, config)).weight_dtype == weight_dtype


def test_a_dense_checkpoint_in_a_quantization_servesim_does_not_price_is_refused(tmp_path):
    # Before, any quantization_config of a dense model was ignored: a GPTQ checkpoint priced as bf16.
    folder = write(tmp_path, {**QWEN3_8B, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(ServesimError, match="quantization_config quant_method = 'gptq' is not supported"):
        ModelConfig.from_hf(folder)


def test_a_dense_fp8_checkpoint_is_priced_as_fp8_weights(tmp_path):
    """vLLM serves the checkpoint's quantization (its --dtype is the activations'): a block-fp8 Qwen3-8B is
    priced as the bf16 one with --dtype fp8 (block fp8 as per-tensor fp8: the GEMM tables time the block-fp8
    kernels without a CUDA graph), step for step and block for block; fp4 on it is refused."""
    from sim.app.options import ReplayOptions
    from sim.app.plan import resolve
    from sim.batch import Batch

    quantized = str(write(tmp_path, {**QWEN3_8B, "quantization_config": FP8_BLOCK}, "fp8"))
    plain = str(write(tmp_path, QWEN3_8B, "bf16"))
    served = resolve(ReplayOptions(model=quantized, hardware="H100-SXM"))
    asked = resolve(ReplayOptions(model=plain, hardware="H100-SXM", dtype="fp8"))
    assert served.options.dtype == "fp8" and served.num_blocks == asked.num_blocks
    batch = Batch()
    for i, (computed, scheduled) in enumerate([(0, 700), (300, 1), (900, 1)]):
        batch.add(str(i), computed, scheduled, [0], True, scheduled == 1)
    assert served.backend.execute(batch).seconds == asked.backend.execute(batch).seconds
    bf16 = resolve(ReplayOptions(model=plain, hardware="H100-SXM"))
    assert bf16.backend.execute(batch).seconds > served.backend.execute(batch).seconds
    with pytest.raises(ServesimError, match="checkpoint is quantized .fp8-block"):
        resolve(ReplayOptions(model=quantized, hardware="H100-SXM", dtype="fp4"))


MIMO_7B = {  # XiaomiMiMo/MiMo-7B-Base's config.json (aiconfigurator-core's model_configs/ has it)
    "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_hidden_layers": 36, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 11008,
    "vocab_size": 151680, "max_position_embeddings": 32768, "rope_theta": 640000, "rms_norm_eps": 1e-05,
    "hidden_act": "silu", "attention_bias": True, "sliding_window": 32768, "max_window_layers": 32,
    "use_sliding_window": False, "use_mrope": False, "num_nextn_predict_layers": 1, "tie_word_embeddings": False}


def test_mimo_is_qwen2_as_vllm_builds_it(tmp_path):
    """vLLM's MiMoForCausalLM is its Qwen2ForCausalLM (q, k, v biases), the MTP layer left to a draft
    model: the same shapes, weights and KV cache as the config read as Qwen2."""
    mimo = ModelConfig.from_hf(write(tmp_path, MIMO_7B, "mimo"))
    qwen2 = ModelConfig.from_hf(write(tmp_path, {**MIMO_7B, "model_type": "qwen2",
                                                 "architectures": ["Qwen2ForCausalLM"]}, "qwen2"))
    assert (mimo.architecture, mimo.qkv_bias, mimo.rope_theta) == ("MiMoForCausalLM", True, 640000.0)
    assert mimo.weight_bytes_per_gpu(tp=2) == qwen2.weight_bytes_per_gpu(tp=2)
    assert mimo.kv_bytes_per_token() == qwen2.kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2
    layer = 4096 * (32 + 2 * 8) * 128 + (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert mimo.num_parameters == 36 * layer + 4096 + 2 * 151680 * 4096 == 7_622_619_136
