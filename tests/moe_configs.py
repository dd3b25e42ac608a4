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
