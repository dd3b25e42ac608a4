"""servesim's KV cache groups, blocks and token capacity for MLA and sliding-window models against
vLLM's own functions (vllm/v1/core/kv_cache_planning.py get_kv_cache_groups and
get_kv_cache_config_from_groups, vllm/v1/core/kv_cache_utils.py get_kv_cache_capacity) on the same
layers' specs (FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec), with and without vLLM's
--disable-hybrid-kv-cache-manager.

Skipped where vLLM is not installed (the `parity` extra: see the README).
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is first imported
pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="vLLM is not installed (pip install '.[parity]')")

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from vllm.config import CacheConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.config import ModelConfig as VllmModelConfig  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec  # noqa: E402

from backends.kv_capacity import kv_cache_groups, vllm_kv_cache  # noqa: E402
from backends.model_config import ModelConfig, resolve_model  # noqa: E402
from tests.moe_configs import GEMMA2_9B, GEMMA3_1B, GLM5_2_FP8, MISTRAL_7B_V01, NEMOTRON_SUPER_49B  # noqa: E402
from tests.parity.vllm_driver import allow_config_without_triton  # noqa: E402

allow_config_without_triton()


def vllm_config(max_model_len: int, block_size: int, max_num_batched_tokens: int,
                disable_hybrid_kv_cache_manager: bool = False) -> VllmConfig:
    folder = tempfile.mkdtemp(prefix="servesim-kv-parity-")
    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=1 << 20,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    model = VllmModelConfig(model=folder, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                            max_model_len=max_model_len)
    scheduler = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
                                disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager or None)
    config = VllmConfig(scheduler_config=scheduler, model_config=model, cache_config=CacheConfig(block_size=block_size))
    config.cache_config.kv_cache_layout = "NHD"  # what the engine core resolves for FlashAttention
    return config


def specs(model: ModelConfig, block_size: int, tp: int) -> dict:
    """Each layer's spec as vLLM's attention layers report it."""
    out = {}
    for i in range(model.num_hidden_layers):
        if model.kv_lora_rank:
            out[f"l{i}"] = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                            head_size=model.kv_lora_rank + model.qk_rope_head_dim, dtype=torch.bfloat16)
            continue
        common = dict(block_size=block_size, num_kv_heads=model.num_kv_heads_per_gpu(tp), head_size=model.head_dim,
                      dtype=torch.bfloat16)
        if model.layer_types and model.layer_types[i] == "sliding_attention":
            out[f"l{i}"] = SlidingWindowSpec(sliding_window=model.sliding_window, **common)
        else:
            out[f"l{i}"] = FullAttentionSpec(**common)
    return out


def from_config(config: dict) -> ModelConfig:
    folder = tempfile.mkdtemp(prefix="servesim-kv-model-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return ModelConfig.from_hf(folder)


@pytest.mark.parametrize("name,tp,block_size,max_model_len,available", [
    ("gpt-oss-120b", 1, 16, 131072, 10 * 2**30),
    ("gpt-oss-120b", 2, 16, 8192, 3 * 2**30 + 12345),
    ("DeepSeek-V3", 8, 64, 163840, 40 * 2**30),
    ("Qwen3-30B-A3B", 2, 16, 40960, 20 * 2**30),
    ("gemma3", 1, 16, 32768, 3 * 2**30),
    ("gemma2", 2, 32, 8192, 5 * 2**30),
    ("mistral-v0.1", 1, 16, 32768, 7 * 2**30),
])
@pytest.mark.parametrize("disable_hybrid", [False, True], ids=["hybrid", "no-hybrid"])
def test_blocks_and_tokens_as_vllm(name, tp, block_size, max_model_len, available, disable_hybrid):
    """With disable_hybrid, vLLM's --disable-hybrid-kv-cache-manager: get_kv_cache_groups promotes a
    sliding layer beside full-attention ones to full attention (unify_hybrid_kv_cache_specs)."""
    configs = {"gemma3": GEMMA3_1B, "gemma2": GEMMA2_9B, "mistral-v0.1": MISTRAL_7B_V01}
    model = from_config(configs[name]) if name in configs else resolve_model(name)
    config = vllm_config(max_model_len, block_size, 2048, disable_hybrid)
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is disable_hybrid  # (vLLM's default on: off)
    groups = get_kv_cache_groups(config, specs(model, block_size, tp))
    theirs = get_kv_cache_config_from_groups(config, groups, available)
    tokens, _ = get_kv_cache_capacity(config, theirs)
    ours = vllm_kv_cache(model, available, block_size=block_size, max_model_len=max_model_len,
                         max_in_flight_tokens=config.max_in_flight_tokens, tp=tp,
                         disable_hybrid_kv_cache_manager=disable_hybrid)
    assert [(g.kind == "sliding_attention", g.num_layers) for g in kv_cache_groups(model, disable_hybrid)] == [
        (isinstance(g.kv_cache_spec, SlidingWindowSpec), len(g.layer_names)) for g in groups]
    assert ours["num_blocks"] == theirs.num_blocks
    assert ours["tokens"] == tokens


def sparse_specs(model: ModelConfig, block_size: int, kv_cache_dtype: str) -> dict:
    """A DeepSeek-sparse-attention model's layer specs as vLLM's layers report them: every layer's
    MLAAttention (its latent; with an fp8 cache FlashMLA's fp8_ds_mla row, `state_content_bytes` 656:
    vllm/model_executor/layers/attention/mla_attention.py, get_kv_cache_spec) and, in each layer that
    builds an indexer, its DeepseekV32IndexerCache (132 uint8 a token, cache_role INDEXER:
    vllm/model_executor/models/deepseek_v2.py)."""
    from vllm.v1.kv_cache_interface import SparseCacheRole

    fp8 = kv_cache_dtype == "fp8"
    out = {}
    for i in range(model.num_hidden_layers):
        own = not model.indexer_types or model.indexer_types[i] == "full"
        out[f"layers.{i}.attn"] = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=model.kv_lora_rank + model.qk_rope_head_dim,
            dtype=torch.uint8 if fp8 else torch.bfloat16, cache_dtype_str="fp8_ds_mla" if fp8 else "auto",
            state_content_bytes=656 if fp8 else None, is_index_group_leader=own)
        if own:
            out[f"layers.{i}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=model.indexer_key_bytes,
                dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
    return out


@pytest.mark.parametrize("name", ["GLM-5.2", "GLM-5"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_sparse_attention_blocks_and_tokens_as_vllm(name, kv_cache_dtype):
    """DeepSeek sparse attention (GLM-5, and GLM-5.2 whose 57 layers of 78 share a top-k and keep no
    indexer key): one group of every layer's specs, a block the sum of their pages."""
    config = GLM5_2_FP8 if name == "GLM-5.2" else {
        k: v for k, v in GLM5_2_FP8.items() if k not in ("index_topk_freq", "index_skip_topk_offset")}
    model = from_config(config)
    available, max_model_len = 40 * 2**30 + 777, 200000
    vllm = vllm_config(max_model_len, 64, 8192)
    groups = get_kv_cache_groups(vllm, sparse_specs(model, 64, kv_cache_dtype))
    theirs = get_kv_cache_config_from_groups(vllm, groups, available)
    tokens, _ = get_kv_cache_capacity(vllm, theirs)
    ours = vllm_kv_cache(model, available, block_size=64, max_model_len=max_model_len,
                         max_in_flight_tokens=vllm.max_in_flight_tokens, tp=8, kv_cache_dtype=kv_cache_dtype)
    assert len(groups) == 1 == len(ours["groups"])
    assert ours["bytes_per_block"] == groups[0].kv_cache_spec.page_size_bytes
    assert ours["num_blocks"] == theirs.num_blocks and ours["tokens"] == tokens


@pytest.mark.parametrize("tp,block_size,available", [(1, 16, 30 * 2**30), (2, 16, 30 * 2**30 + 4321),
                                                     (16, 32, 7 * 2**30)])
def test_decilm_blocks_and_tokens_as_vllm(tp, block_size, available):
    """Llama-3.3-Nemotron-Super-49B (nemotron-nas): only its 49 attention layers of 80 report a spec
    (vLLM's DeciLMDecoderLayer builds no Attention for a no-op one), each a FullAttentionSpec of its
    own KV heads (num_attention_heads // n_heads_in_group, 8; one a GPU at TP 16)."""
    model = from_config(NEMOTRON_SUPER_49B)
    heads = max(1, model.num_key_value_heads // tp)
    layer_specs = {f"l{i}": FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=model.head_dim,
                                              dtype=torch.bfloat16)
                   for i, has in enumerate(model.attention_layers) if has}
    assert len(layer_specs) == 49
    config = vllm_config(131072, block_size, 2048)
    groups = get_kv_cache_groups(config, layer_specs)
    theirs = get_kv_cache_config_from_groups(config, groups, available)
    tokens, _ = get_kv_cache_capacity(config, theirs)
    ours = vllm_kv_cache(model, available, block_size=block_size, max_model_len=131072,
                         max_in_flight_tokens=config.max_in_flight_tokens, tp=tp)
    assert [g.num_layers for g in kv_cache_groups(model)] == [len(g.layer_names) for g in groups] == [49]
    assert ours["num_blocks"] == theirs.num_blocks
    assert ours["tokens"] == tokens
