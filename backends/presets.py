"""Model presets: plain data, no classes.

Each carries the Hugging Face `config.json` fields that decide a decoder step's cost and shapes;
`backends.model_config.ModelConfig.from_preset` reads one, and every shape and size is worked out
there. Hardware presets live in backends/hardware.py.
"""

from __future__ import annotations

from sim.errors import ServesimError

MODELS: dict[str, dict] = {
    "Llama-3.1-8B": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "qk_norm": False,
    },
    "Llama-3.1-70B": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "qk_norm": False,
    },
    "Mistral-7B": {  # Mistral-7B-v0.3
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32768,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "qk_norm": False,
    },
    "Qwen3-0.6B": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "qk_norm": True,
    },
    "Qwen3-8B": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "qk_norm": True,
    },
    # Mixture-of-experts presets: the fields of their Hugging Face config.json as servesim reads them
    # (backends/model_config.py's extended_from_hf); tests/test_moe_model.py checks each against the
    # file aiconfigurator-core ships.
    "Qwen3-30B-A3B": {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "qk_norm": True,
        "architecture": "Qwen3MoeForCausalLM", "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True,
    },
    "Qwen3-235B-A22B": {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "qk_norm": True,
        "architecture": "Qwen3MoeForCausalLM", "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536, "norm_topk_prob": True,
    },
    "DeepSeek-V3": {  # block-fp8 checkpoint (quantization_config: fp8, weight_block_size [128, 128])
        "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "head_dim": 192, "vocab_size": 129280, "max_position_embeddings": 163840,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "qk_norm": False,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn"},
        "architecture": "DeepseekV3ForCausalLM", "model_type": "deepseek_v3", "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "shared_expert_intermediate_size": 2048,
        "norm_topk_prob": True, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "weight_dtype": "fp8-block",
        "expert_dtype": "fp8-block",
    },
    "gpt-oss-120b": {  # MXFP4 experts; sliding (128 tokens) and full attention alternate, with sinks
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088, "max_position_embeddings": 131072,
        "rope_theta": 150000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "qk_norm": False,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "architecture": "GptOssForCausalLM", "model_type": "gpt_oss", "num_experts": 128, "num_experts_per_tok": 4,
        "moe_intermediate_size": 2880, "norm_topk_prob": True, "sliding_window": 128,
        "layer_types": ("sliding_attention", "full_attention") * 18, "attention_sinks": True,
        "attention_bias": True, "weight_dtype": "bf16", "expert_dtype": "mxfp4",
    },
    "Mixtral-8x7B": {  # Mixtral-8x7B-v0.1
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "qk_norm": False,
        "architecture": "MixtralForCausalLM", "model_type": "mixtral", "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 14336, "norm_topk_prob": True,
    },
    # A toy decoder for the CPU and the tests of the real backend.
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "qk_norm": True,
    },
}


def get_model(name: str) -> dict:
    if name not in MODELS:
        raise ServesimError(f"unknown model {name!r}; choose one of {', '.join(MODELS)} (see `sim models`)")
    return MODELS[name]
