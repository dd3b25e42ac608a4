"""How many KV blocks vLLM V1 allocates on one GPU.

vLLM's worker profiles memory before it sizes the cache (vllm/v1/worker/gpu_worker.py,
`Worker.init_device` and `Worker.determine_available_memory`; vllm/utils/mem_utils.py,
`memory_profiling`):

    requested  = total device memory x gpu_memory_utilization
    available  = requested - weights - activation peak - non-torch memory - CUDA-graph pool

`weights` is what loading the model took (`model_memory_usage`), the activation peak is the torch
peak of `GPUModelRunner.profile_run` (vllm/v1/worker/gpu_model_runner.py: a dummy forward of
max_num_batched_tokens tokens, then `_dummy_sampler_run` on min(max_num_seqs,
max_num_batched_tokens) logits rows), non-torch memory is what grew outside torch's allocator
meanwhile (NCCL and custom all-reduce buffers), and since vLLM 0.21 the CUDA-graph pool is
estimated before the cache is sized (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 by default).
The blocks follow (vllm/v1/core/kv_cache_utils.py, `get_kv_cache_config_from_groups` and
`get_num_blocks`): int(available) // page_size // num_layers, with one layer's page
2 x block_size x kv_heads_per_gpu x head_dim x kv dtype bytes; `num_gpu_blocks_override` replaces
the figure (`may_override_num_blocks`). Under tensor parallelism every GPU holds its shard of the
weights and 1/T of the KV heads (at least one), and the engine takes the smallest count of all
workers (`get_kv_cache_configs`); the workers being alike, that is one GPU's count. A cache too
small for one request of max_model_len tokens stops vLLM at start-up
(`_check_enough_kv_cache_memory`); so does it here.

What vLLM measures, servesim models (each constant's source is beside it):
- weights: `ModelConfig.weight_bytes_per_gpu` (Llama-3.1-8B bf16: 14.9888 GiB, the figure vLLM's
  "Model loading took" line prints);
- activation peak: max(SAMPLER_FP32_COPIES x N x vocab x 4 bytes, the MLP's intermediate
  T x 3 x intermediate/T_p x 2 bytes) + HIDDEN_BF16_COPIES x T x hidden x 2 bytes, with T tokens
  and N logits rows of the profile run. The two constants are a fit to vLLM 0.11's DEBUG
  profiles on an H100 (T = 8192, N = 1024: Llama-3.1-8B 4.76 GiB, Qwen3-0.6B 5.56, Qwen3-32B
  5.64, Llama-3.3-70B TP 2 4.84; every one within 0.005 GiB), and give 1.25 GiB at N = 256, as
  the logs of older versions (max_num_seqs 256) print for Llama-3.1-8B (1.19 - 1.24 GiB);
- non-torch memory: 0.13 GiB at TP 1, 0.55 GiB with NCCL at TP >= 2 (the same vLLM 0.11 logs);
- CUDA-graph pool: 0.6 GiB, between the estimates vLLM 0.21+ prints for dense 8B-class models with
  the default capture sizes (51 piecewise graphs up to 512 tokens: 0.52, 0.62, 0.76 GiB).
Blocks counted this way are within about 1% of what a vLLM log prints; `--num-gpu-blocks` takes
the logged figure exactly.

A derived count above sim.config.MAX_NUM_BLOCKS (a tiny model with small blocks on a big GPU: each
block costs the simulator ~60 bytes of host memory) is capped to it, and said so: `capped_from` holds
the derived figure, summary.json's kv_cache reports it beside the cap, and the command warns.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.hardware import Hardware
from backends.model_config import ModelConfig
from sim.config import MAX_NUM_BLOCKS
from sim.errors import ServesimError

GIB = 2**30
SAMPLER_FP32_COPIES = 9.56  # fp32 [N, vocab] tensors alive at the sampler's peak (fit; see above)
HIDDEN_BF16_COPIES = 1.28  # bf16 [T, hidden] tensors kept beside it (fit; see above)
NON_TORCH_BYTES = {1: 0.13 * GIB, 2: 0.55 * GIB}  # by min(tp, 2)
CUDA_GRAPH_POOL_BYTES = 0.6 * GIB


@dataclass(frozen=True)
class KVCapacity:
    """The KV cache one engine gets: `num_gpu_blocks` as vLLM logs it ("GPU KV cache size:
    num_gpu_blocks x block_size tokens") and the terms it came from (bytes per GPU)."""

    num_gpu_blocks: int
    block_bytes: int  # one block over all layers, on one GPU
    terms: dict  # requested, weights, activation_peak, non_torch, cuda_graph_pool, available
    source: str  # "derived" or "--num-gpu-blocks"
    vllm: dict | None = None  # MoE, MLA and sliding-window models: `vllm_kv_cache` (groups, tokens)
    capped_from: int | None = None  # the derived count, when it was above MAX_NUM_BLOCKS and capped to it

    def as_dict(self) -> dict:
        d = {"num_gpu_blocks": self.num_gpu_blocks, "source": self.source, "block_bytes": self.block_bytes,
             "bytes_per_gpu": {k: int(v) for k, v in self.terms.items()},
             "formula": "floor((memory x gpu_memory_utilization - weights - activation_peak - non_torch "
                        "- cuda_graph_pool) / block_bytes), per GPU"}
        if self.capped_from is not None:
            d["capped"] = {"derived_num_gpu_blocks": self.capped_from, "cap": MAX_NUM_BLOCKS,
                           "why": CAP_REASON}
        if self.vllm is not None:
            d["vllm"] = self.vllm
        return d

    def warning(self) -> str | None:
        """What a command prints when the cache was capped."""
        if self.capped_from is None:
            return None
        return (f"the KV cache derived for this GPU holds {self.capped_from:,} blocks; servesim simulates at most "
                f"{MAX_NUM_BLOCKS:,} ({CAP_REASON}), so it runs with {self.num_gpu_blocks:,}: a larger --block-size "
                "or --num-gpu-blocks gives the figure you mean")


CAP_REASON = "each KV block takes about 60 bytes of host memory"


def activation_peak_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1,
                          dp: int = 1, enable_expert_parallel: bool = False) -> float:
    """The torch peak of vLLM's profile run (see the module docstring); a mixture-of-experts
    layer's in place of the MLP's (`moe_workspace_bytes`)."""
    t = max_num_batched_tokens
    rows = min(max_num_seqs, max_num_batched_tokens)
    sampler = SAMPLER_FP32_COPIES * rows * model.vocab_size * 4
    mlp = t * 3 * (model.intermediate_size // tp) * 2
    if model.num_experts:
        mlp = max(mlp if model.num_dense_mlp_layers else 0, moe_workspace_bytes(model, t, tp, dp,
                                                                                 enable_expert_parallel))
    return max(sampler, mlp) + HIDDEN_BF16_COPIES * t * model.hidden_size * 2


def max_in_flight_tokens(max_num_batched_tokens: int, async_scheduling: bool) -> int:
    """Tokens scheduled but not yet settled (vllm/config/vllm.py VllmConfig.max_in_flight_tokens):
    max_concurrent_batches x max_num_batched_tokens, the batches two with asynchronous scheduling, one
    without (one pipeline stage). A sliding window's admission cap counts them
    (SlidingWindowSpec.max_admission_blocks_per_request)."""
    return (2 if async_scheduling else 1) * max_num_batched_tokens


def kv_capacity(model: ModelConfig, hardware: Hardware, *, block_size: int, gpu_memory_utilization: float,
                max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1, dtype: str = "bf16",
                kv_cache_dtype: str = "auto", max_model_len: int | None = None,
                num_gpu_blocks_override: int | None = None, dp: int = 1,
                enable_expert_parallel: bool = False, async_scheduling: bool = True,
                disable_hybrid_kv_cache_manager: bool = False) -> KVCapacity:
    """The blocks vLLM would allocate; with `num_gpu_blocks_override` that figure, taken as given
    (the memory checks then do not apply). `dp`, `enable_expert_parallel`: where a mixture of
    experts' experts lie (the figures are one GPU's, of one DP rank: each rank has its own cache).
    For a MoE, MLA or sliding-window model `vllm` in the result has vLLM's allocation and the
    tokens it fits (`vllm_kv_cache`). A hybrid model's (sliding and full layers: several KV cache
    groups) blocks are vLLM's shared pool, a block one page of each layer of one group
    (`block_bytes` then that), and it starts when one request of max_model_len tokens fits in the
    blocks it takes from every group (vLLM's _check_enough_kv_cache_memory over
    max_memory_usage_bytes). servesim's block manager (sim/sliding_block_manager.py SlidingWindowBlockManager)
    charges a request every group's blocks: all of them under full attention, a window's under a
    sliding one (`KVCacheGroup.blocks_held`). A model whose only group slides (Mistral-7B-v0.1) starts
    when a window's blocks fit, as vLLM checks it (sim/sliding_block_manager.py holds them).
    `async_scheduling`: the server's, which sets the tokens in flight that a sliding window's
    admission cap counts (`max_in_flight_tokens`). `disable_hybrid_kv_cache_manager`: vLLM's
    --disable-hybrid-kv-cache-manager; a model of sliding and full-attention layers is then sized and
    checked as one of full-attention layers only (`kv_cache_groups`)."""
    hardware.check_tp(tp)
    if enable_expert_parallel and not model.num_experts:
        raise ServesimError(f"--enable-expert-parallel splits a mixture of experts' experts; model {model.name} has "
                            "none")
    block_bytes = block_size * model.kv_bytes_per_token(tp, kv_cache_dtype)
    terms = {"requested": hardware.memory_bytes * gpu_memory_utilization,
             "weights": model.weight_bytes_per_gpu(tp, dtype, dp, enable_expert_parallel),
             "activation_peak": activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, tp, dp,
                                                      enable_expert_parallel),
             "non_torch": NON_TORCH_BYTES[min(tp, 2)],
             "cuda_graph_pool": CUDA_GRAPH_POOL_BYTES}
    available = int(terms["requested"] - terms["weights"] - terms["activation_peak"] - terms["non_torch"]
                    - terms["cuda_graph_pool"])
    terms["available"] = available
    if num_gpu_blocks_override is not None:  # checked by sim.config.CacheConfig
        vllm = _vllm(model, available, block_size, max_model_len, max_in_flight_tokens(max_num_batched_tokens, async_scheduling),
                     tp, kv_cache_dtype, disable_hybrid_kv_cache_manager, num_gpu_blocks_override)
        if vllm is not None and len(vllm["groups"]) > 1:
            block_bytes = vllm["bytes_per_block"]
        return KVCapacity(num_gpu_blocks_override, block_bytes, terms, "--num-gpu-blocks", vllm)
    where = f"{model.name} on {hardware.description or hardware.name}" + (f" x {tp}" if tp > 1 else "")
    if available <= 0:
        raise ServesimError(
            f"the weights ({terms['weights'] / GIB:.2f} GiB per GPU), activations "
            f"({terms['activation_peak'] / GIB:.2f} GiB) and buffers "
            f"({(terms['non_torch'] + terms['cuda_graph_pool']) / GIB:.2f} GiB) of {where} do not fit in "
            f"{gpu_memory_utilization:.0%} of {hardware.memory_bytes / GIB:.2f} GiB, leaving nothing for the KV "
            "cache; choose bigger hardware, a larger --tp or a smaller model")
    num_blocks = available // block_bytes
    vllm = _vllm(model, available, block_size, max_model_len, max_in_flight_tokens(max_num_batched_tokens, async_scheduling),
                 tp, kv_cache_dtype, disable_hybrid_kv_cache_manager)
    if vllm is not None and (len(vllm["groups"]) > 1 or vllm["groups"][0]["kind"] == "sliding_attention"):
        num_blocks, block_bytes = vllm["num_blocks"], vllm["bytes_per_block"]
        needed = sum(g["max_blocks_per_request"] for g in vllm["groups"])
        if needed > num_blocks:
            raise ServesimError(
                f"the KV cache of {where} ({num_blocks} blocks of {block_size} tokens, "
                + (f"shared by {len(vllm['groups'])} KV cache groups" if len(vllm["groups"]) > 1 else
                   "one sliding window's group") + ") cannot hold one request of --max-model-len "
                f"{vllm['max_model_len']} tokens ({needed} blocks); vLLM would not start. Lower --max-model-len "
                "or raise --gpu-memory-utilization")
    elif max_model_len is not None and -(-max_model_len // block_size) > num_blocks:
        raise ServesimError(
            f"the KV cache of {where} ({num_blocks} blocks of {block_size} tokens) cannot hold one request of "
            f"--max-model-len {max_model_len} tokens; vLLM would not start. Lower --max-model-len (at most "
            f"{num_blocks * block_size}) or raise --gpu-memory-utilization")
    if num_blocks > MAX_NUM_BLOCKS:  # no trace fills 2**25 blocks; reported as capped
        return KVCapacity(MAX_NUM_BLOCKS, block_bytes, terms, "derived", vllm, capped_from=num_blocks)
    return KVCapacity(num_blocks, block_bytes, terms, "derived", vllm)


def _vllm(model: ModelConfig, available: int, block_size: int, max_model_len: int | None,
          max_in_flight_tokens: int, tp: int, kv_cache_dtype: str, disable_hybrid_kv_cache_manager: bool,
          override: int | None = None) -> dict | None:
    if not model.is_extended or (available <= 0 and override is None):
        return None
    return vllm_kv_cache(model, available, block_size=block_size,
                         max_model_len=max_model_len or model.max_position_embeddings,
                         max_in_flight_tokens=max_in_flight_tokens, tp=tp,
                         kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=override,
                         disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager)


# Mixture of experts, MLA and sliding windows as vLLM allocates them.


def moe_workspace_bytes(model: ModelConfig, num_tokens: int, tp: int = 1, dp: int = 1,
                        enable_expert_parallel: bool = False) -> int:
    """The fused MoE kernel's intermediate caches over `num_tokens` tokens on one GPU
    (vllm/model_executor/layers/fused_moe/fused_moe.py: cache13, [T x top-k x max(N, K)], shared by
    the gate-up output and the down output, and intermediate_cache2 [T x top-k, N / 2]; N is the
    local gate-up width 2 x moe_intermediate_size / MoE TP, K the hidden size), in bf16."""
    moe_tp, _ = model.moe_parallel(tp, dp, enable_expert_parallel)
    n = 2 * model.moe_intermediate_size // moe_tp
    rows = num_tokens * model.num_experts_per_tok
    return 2 * (rows * max(n, model.hidden_size) + rows * (n // 2))


@dataclass(frozen=True)
class KVCacheGroup:
    """One of vLLM's KV cache groups: `num_layers` layers of one attention kind sharing a block
    table (vllm/v1/core/kv_cache_planning.py, _get_kv_cache_groups_uniform_page_size)."""

    kind: str  # "full_attention" or "sliding_attention"
    num_layers: int
    sliding_window: int | None = None

    def max_blocks_per_request(self, block_size: int, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Blocks one request of max_model_len tokens may hold in this group (the spec's
        max_memory_usage_bytes / page_size_bytes, vllm/v1/kv_cache_interface.py): every block for
        full attention (FullAttentionSpec); for a window, SlidingWindowSpec's
        max_admission_blocks_per_request: cdiv(min(window - 1 + in-flight tokens, max_model_len),
        block_size) + 1 (the window need not start at a block's start)."""
        if self.kind == "full_attention":
            return -(-max_model_len // block_size)
        assert self.sliding_window is not None
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return -(-tokens // block_size) + 1

    def blocks_held(self, num_computed_tokens: int, num_tokens: int, block_size: int) -> int:
        """Blocks a request holds in this group with `num_tokens` tokens allocated once
        `num_computed_tokens` of them are computed (and committed): all of them under full attention;
        under a window, less those wholly before it, which vLLM frees (SlidingWindowManager's
        get_num_skipped_tokens: max(0, computed - window + 1) tokens skipped; remove_skipped_blocks
        frees the skipped // block_size blocks before them, vllm/v1/core/single_type_kv_cache_manager.py).
        sim/sliding_block_manager.py SlidingWindowBlockManager holds this many once the request is
        next scheduled (tests/test_hybrid_blocks.py)."""
        blocks = -(-num_tokens // block_size)
        if self.kind == "full_attention":
            return blocks
        assert self.sliding_window is not None
        skipped = max(0, num_computed_tokens - self.sliding_window + 1) // block_size
        return blocks - min(skipped, blocks)


def kv_cache_groups(model: ModelConfig, disable_hybrid_kv_cache_manager: bool = False) -> list[KVCacheGroup]:
    """The KV cache groups vLLM makes of the model's layers. One group of every layer when they are
    all alike (_get_kv_cache_groups_uniform_spec); else the hybrid manager's
    _get_kv_cache_groups_uniform_page_size: the layers of each kind in one bucket; the group size
    is the smallest bucket's layer count (the largest's when that is under 1.5 times it); each bucket
    is split into cdiv(count, group size) groups, layers[i::num_groups] in the i-th. Every layer's page
    is the same size here (all layers share num_kv_heads and head_dim), so no page is padded
    (unify_kv_cache_spec_page_size). Only layers with attention have a spec: a DeciLM (nemotron-nas)
    layer whose attention is a no-op has none (DeciLMDecoderLayer builds no Attention), so
    Super-49B's 49 attention layers of 80 make one group of 49. (Full-attention layers whose pages
    differ, DeciLM layers of different KV heads, would make one group too, its page their pages'
    sum: get_kv_cache_groups' UniformTypeKVCacheSpecs.from_specs path; servesim refuses such a
    config when it reads it, its cost models pricing one KV head count.)

    With `disable_hybrid_kv_cache_manager` (vLLM's --disable-hybrid-kv-cache-manager,
    SchedulerConfig.disable_hybrid_kv_cache_manager) a model of sliding and full-attention layers is
    one full-attention group of every layer: get_kv_cache_groups calls unify_hybrid_kv_cache_specs,
    whose _promote_local_kv_cache_specs turns each SlidingWindowSpec into a FullAttentionSpec (its
    window kept for the attention kernel only), and the specs, now alike, make one group
    (vllm/v1/core/kv_cache_planning.py, vLLM 0.33 and 0.34). Each layer then holds every token's KV and
    no block is freed as the window slides. A model whose every layer slides (Mistral-7B-v0.1) keeps
    its sliding group: the promotion needs full-attention layers beside the sliding ones.

    A model with chunked local attention (Llama 4) is one full-attention group of every layer
    whatever the flag: vLLM turns the hybrid manager off for it by default (VllmConfig's
    need_disable_hybrid_kv_cache_manager, vllm/config/vllm.py: "There is a latency regression when
    using chunked local attention with the hybrid KV cache manager", unless
    VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1, which servesim does not model), and
    _promote_local_kv_cache_specs turns each ChunkedLocalAttentionSpec into a FullAttentionSpec, the
    chunk kept for the attention kernel only."""
    if model.num_chunked_layers:
        return [KVCacheGroup("full_attention", model.num_hidden_layers)]
    # (a DeciLM layer without attention reports no KV cache spec: it is in no group)
    kinds = model.layer_types or ("full_attention",) * model.num_attention_layers
    buckets: dict[str, int] = {}
    for kind in kinds:
        buckets[kind] = buckets.get(kind, 0) + 1
    window = model.sliding_window
    if disable_hybrid_kv_cache_manager and set(buckets) == {"full_attention", "sliding_attention"}:
        return [KVCacheGroup("full_attention", model.num_hidden_layers)]
    if len(buckets) == 1:
        kind, count = next(iter(buckets.items()))
        return [KVCacheGroup(kind, count, window if kind == "sliding_attention" else None)]
    smallest, largest = min(buckets.values()), max(buckets.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups = []
    for kind, count in buckets.items():
        num_groups = -(-count // group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroup(kind, len(range(i, count, num_groups)),
                                       window if kind == "sliding_attention" else None))
    return groups


def vllm_kv_cache(model: ModelConfig, available: int, *, block_size: int, max_model_len: int,
                  max_in_flight_tokens: int, tp: int = 1, kv_cache_dtype: str = "auto",
                  num_gpu_blocks_override: int | None = None, disable_hybrid_kv_cache_manager: bool = False) -> dict:
    """vLLM's KV cache for `available` bytes on one GPU, and how many tokens it fits
    (vllm/v1/core/kv_cache_planning.py and kv_cache_utils.py):
    - blocks: get_kv_cache_config_from_groups, available // bytes_per_block, a block's bytes the
      largest group's pages (_get_kv_cache_bytes_per_block: group layers x one layer's page, the
      page block_size x the per-layer bytes of `ModelConfig.kv_bytes_per_token`; MLA's page is one
      latent head, MLAAttentionSpec; `num_gpu_blocks_override` replaces the figure,
      may_override_num_blocks);
    - tokens: get_kv_cache_capacity, int(max_concurrency x max_model_len), with max_concurrency =
      num_blocks / the blocks one request of max_model_len tokens takes from every group together
      (get_max_concurrency_for_kv_cache_config; `KVCacheGroup.max_blocks_per_request`);
      `max_in_flight_tokens` as the function of that name gives it (two batches asynchronously).
    `disable_hybrid_kv_cache_manager`: the groups of that flag (`kv_cache_groups`)."""
    groups = kv_cache_groups(model, disable_hybrid_kv_cache_manager)
    layers = model.num_attention_layers
    page = block_size * model.kv_bytes_per_token(tp, kv_cache_dtype) // layers
    bytes_per_block = max(g.num_layers for g in groups) * page
    if len(groups) == 1:  # one group: its page the sum of its layers' pages (UniformTypeKVCacheSpecs), which
        # differ where a sparse-attention layer keeps no indexer key (GLM-5.2's layers that share a top-k)
        bytes_per_block = block_size * model.kv_bytes_per_token(tp, kv_cache_dtype)
    num_blocks = available // bytes_per_block if num_gpu_blocks_override is None else num_gpu_blocks_override
    per_request = sum(g.max_blocks_per_request(block_size, max_model_len, max_in_flight_tokens) for g in groups)
    concurrency = num_blocks / per_request
    return {"num_blocks": num_blocks, "bytes_per_block": bytes_per_block, "page_bytes_per_layer": page,
            "groups": [{"kind": g.kind, "num_layers": g.num_layers, "sliding_window": g.sliding_window,
                        "max_blocks_per_request": g.max_blocks_per_request(block_size, max_model_len,
                                                                           max_in_flight_tokens)}
                       for g in groups],
            "max_model_len": max_model_len, "max_in_flight_tokens": max_in_flight_tokens,
            "max_concurrency": concurrency,
            "tokens": int(concurrency * max_model_len),
            "formula": "num_blocks = available // bytes_per_block; tokens = int(num_blocks / "
                       "sum(max_blocks_per_request) x max_model_len) (vLLM get_kv_cache_capacity)"}
