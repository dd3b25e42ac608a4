"""config.json fields the tests read where the tables package is not installed (or ships no such
file): the dense sliding-window Mistral-7B-v0.1, Gemma 3 1B and Gemma 2 9B as their model cards'
config.json give them, and GLM-5.2-FP8's text fields as aiconfigurator-core's model_configs/ has them."""

MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "vocab_size": 32000}
GEMMA3_1B = {  # google/gemma-3-1b-it's text fields
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144,
    "max_position_embeddings": 32768, "rope_theta": 1000000, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
    "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "sliding_window": 4096, "vocab_size": 256000, "max_position_embeddings": 8192, "rope_theta": 10000.0}

# zai-org/GLM-5.2-FP8's text fields (DeepSeek sparse attention whose layers share the top-k of every
# fourth: index_topk_freq 4, index_skip_topk_offset 3), for the suites that run without the tables package
GLM5_2_FP8 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 78, "num_attention_heads": 64,
    "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "vocab_size": 154880, "max_position_embeddings": 1048576,
    "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128, "index_topk_freq": 4,
    "index_skip_topk_offset": 3, "norm_topk_prob": True, "tie_word_embeddings": False, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}}

# nvidia/Llama-3_3-Nemotron-Super-49B-v1's config.json (nemotron-nas, DeciLM), its 80 block_configs
# written as runs of (n_heads_in_group, 0 for a no-op attention; ffn_mult; layers), in order, for
# the parity suite, whose virtualenv lacks the tables package that ships the file.
_SUPER_49B_RUNS = [(8, 2.625, 1), (8, 5.25, 5), (0, 2.625, 2), (8, 5.25, 3), (0, 3.28125, 1), (8, 5.25, 30),
                   (0, 1.3125, 1), (0, 2.625, 2), (0, 1.3125, 1), (0, 5.25, 1), (0, 1.3125, 1), (0, 2.625, 1),
                   (0, 1.3125, 3), (8, 5.25, 1), (0, 1.3125, 1), (0, 1.0, 2), (0, 1.3125, 1), (0, 1.0, 3),
                   (0, 1.3125, 2), (0, 0.5, 2), (0, 1.0, 2), (0, 0.5, 2), (0, 1.0, 1), (0, 0.5, 2), (8, 5.25, 9)]
NEMOTRON_SUPER_49B = {
    "architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas", "hidden_size": 8192, "hidden_act": "silu",
    "intermediate_size": None, "num_key_value_heads": None, "num_attention_heads": 64, "num_hidden_layers": 80,
    "max_position_embeddings": 131072, "vocab_size": 128256, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "block_configs": [{"attention": {"n_heads_in_group": group or None, "no_op": not group,
                                     "replace_with_linear": False, "sparsify": None, "window_length": None,
                                     "num_sink_tokens": None, "unshifted_sink": False,
                                     "use_prefill_window_in_sink_attention": False},
                       "ffn": {"ffn_mult": mult, "no_op": False, "replace_with_linear": False, "sparsify": None}}
                      for group, mult, n in _SUPER_49B_RUNS for _ in range(n)],
}
