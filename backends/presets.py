"""Hardware and model presets: plain data, no classes.

Model presets carry the Hugging Face `config.json` fields that decide a decoder step's cost
and shapes. Hardware presets carry dense bf16 peak FLOP/s, HBM bandwidth and memory size
(the total that nvidia-smi reports).
"""

from __future__ import annotations

from sim.errors import ServesimError

HARDWARE: dict[str, dict] = {
    "A100-80GB": {
        "peak_flops": 312e12,  # dense bf16
        "memory_bandwidth": 2.039e12,  # bytes/s, SXM4 HBM2e
        "memory_bytes": 81920 * 2**20,
        "description": "NVIDIA A100 SXM4 80GB",
    },
    "H100-SXM": {
        "peak_flops": 989.4e12,
        "memory_bandwidth": 3.35e12,
        "memory_bytes": 81559 * 2**20,
        "description": "NVIDIA H100 SXM5 80GB",
    },
    "H200": {
        "peak_flops": 989.4e12,
        "memory_bandwidth": 4.8e12,
        "memory_bytes": 143771 * 2**20,
        "description": "NVIDIA H200 SXM 141GB",
    },
}

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


def get_hardware(name: str) -> dict:
    if name not in HARDWARE:
        raise ServesimError(
            f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE)} (see `sim hardware`)"
        )
    return HARDWARE[name]


def num_parameters(model: dict) -> int:
    """Parameters of the decoder: embeddings, attention, MLP, norms and the LM head."""
    return _config(model).num_parameters


def kv_bytes_per_token(model: dict, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    return _config(model).kv_bytes_per_token() // 2 * dtype_bytes


def activation_reserve_bytes(model: dict, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A bound on the memory one step needs beyond weights and KV cache: the fp32 working set of a
    full token budget through the widest layer, plus fp32 logits for every running request."""
    h, i = model["hidden_size"], model["intermediate_size"]
    return max_num_batched_tokens * (4 * h + 2 * i) * 4 + max_num_seqs * model["vocab_size"] * 4


def derive_num_blocks(model: dict, hardware: dict, block_size: int, gpu_memory_utilization: float,
                      max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int = 2) -> int:
    """KV blocks that fit in the device's memory share after weights and the activation reserve."""
    weights = num_parameters(model) * dtype_bytes
    reserve = activation_reserve_bytes(model, max_num_batched_tokens, max_num_seqs)
    available = hardware["memory_bytes"] * gpu_memory_utilization - weights - reserve
    num_blocks = int(available // (block_size * kv_bytes_per_token(model, dtype_bytes)))
    if num_blocks < 1:
        raise ServesimError(
            f"the model's weights ({weights / 2**30:.1f} GiB) and activation reserve ({reserve / 2**30:.1f} GiB) "
            f"do not fit in {gpu_memory_utilization:.0%} of {hardware['description']} "
            f"({hardware['memory_bytes'] / 2**30:.1f} GiB); choose bigger hardware or a smaller model"
        )
    return num_blocks


def _config(model: dict):
    from backends.model_config import ModelConfig

    return ModelConfig.from_fields("preset", model)
