"""Dense sliding-window config.json fields the tests read (aiconfigurator-core ships no such file):
Mistral-7B-v0.1, Gemma 3 1B and Gemma 2 9B as their model cards' config.json give them."""

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

