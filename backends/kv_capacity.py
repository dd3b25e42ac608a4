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
    capped_from: int | None = None  # the derived count, when it was above MAX_NUM_BLOCKS and capped to it

    def as_dict(self) -> dict:
        d = {"num_gpu_blocks": self.num_gpu_blocks, "source": self.source, "block_bytes": self.block_bytes,
             "bytes_per_gpu": {k: int(v) for k, v in self.terms.items()},
             "formula": "floor((memory x gpu_memory_utilization - weights - activation_peak - non_torch "
                        "- cuda_graph_pool) / block_bytes), per GPU"}
        if self.capped_from is not None:
            d["capped"] = {"derived_num_gpu_blocks": self.capped_from, "cap": MAX_NUM_BLOCKS,
                           "why": CAP_REASON}
        return d

    def warning(self) -> str | None:
        """What a command prints when the cache was capped."""
        if self.capped_from is None:
            return None
        return (f"the KV cache derived for this GPU holds {self.capped_from:,} blocks; servesim simulates at most "
                f"{MAX_NUM_BLOCKS:,} ({CAP_REASON}), so it runs with {self.num_gpu_blocks:,}: a larger --block-size "
                "or --num-gpu-blocks gives the figure you mean")


CAP_REASON = "each KV block takes about 60 bytes of host memory"


def activation_peak_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1) -> float:
    """The torch peak of vLLM's profile run (see the module docstring)."""
    t = max_num_batched_tokens
    rows = min(max_num_seqs, max_num_batched_tokens)
    sampler = SAMPLER_FP32_COPIES * rows * model.vocab_size * 4
    mlp = t * 3 * (model.intermediate_size // tp) * 2
    return max(sampler, mlp) + HIDDEN_BF16_COPIES * t * model.hidden_size * 2


def kv_capacity(model: ModelConfig, hardware: Hardware, *, block_size: int, gpu_memory_utilization: float,
                max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1, dtype: str = "bf16",
                kv_cache_dtype: str = "auto", max_model_len: int | None = None,
                num_gpu_blocks_override: int | None = None) -> KVCapacity:
    """The blocks vLLM would allocate; with `num_gpu_blocks_override` that figure, taken as given
    (the memory checks then do not apply)."""
    hardware.check_tp(tp)
    block_bytes = block_size * model.kv_bytes_per_token(tp, kv_cache_dtype)
    terms = {"requested": hardware.memory_bytes * gpu_memory_utilization,
             "weights": model.weight_bytes_per_gpu(tp, dtype),
             "activation_peak": activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, tp),
             "non_torch": NON_TORCH_BYTES[min(tp, 2)],
             "cuda_graph_pool": CUDA_GRAPH_POOL_BYTES}
    available = int(terms["requested"] - terms["weights"] - terms["activation_peak"] - terms["non_torch"]
                    - terms["cuda_graph_pool"])
    terms["available"] = available
    if num_gpu_blocks_override is not None:  # checked by sim.config.CacheConfig
        return KVCapacity(num_gpu_blocks_override, block_bytes, terms, "--num-gpu-blocks")
    where = f"{model.name} on {hardware.description or hardware.name}" + (f" x {tp}" if tp > 1 else "")
    if available <= 0:
        raise ServesimError(
            f"the weights ({terms['weights'] / GIB:.2f} GiB per GPU), activations "
            f"({terms['activation_peak'] / GIB:.2f} GiB) and buffers "
            f"({(terms['non_torch'] + terms['cuda_graph_pool']) / GIB:.2f} GiB) of {where} do not fit in "
            f"{gpu_memory_utilization:.0%} of {hardware.memory_bytes / GIB:.2f} GiB, leaving nothing for the KV "
            "cache; choose bigger hardware, a larger --tp or a smaller model")
    num_blocks = available // block_bytes
    if max_model_len is not None and -(-max_model_len // block_size) > num_blocks:
        raise ServesimError(
            f"the KV cache of {where} ({num_blocks} blocks of {block_size} tokens) cannot hold one request of "
            f"--max-model-len {max_model_len} tokens; vLLM would not start. Lower --max-model-len (at most "
            f"{num_blocks * block_size}) or raise --gpu-memory-utilization")
    if num_blocks > MAX_NUM_BLOCKS:  # no trace fills 2**25 blocks; reported as capped
        return KVCapacity(MAX_NUM_BLOCKS, block_bytes, terms, "derived", capped_from=num_blocks)
    return KVCapacity(num_blocks, block_bytes, terms, "derived")
