"""Drive vLLM's own V1 `Scheduler` step by step on the CPU, with a mocked forward pass.

This is how vLLM tests its scheduler (`tests/v1/core/utils.py`, `create_scheduler`): a
`VllmConfig` built from a tiny model config (here a `LlamaConfig` saved into a temporary
folder: no weights, no tokenizer), a `KVCacheConfig` with one full-attention group and
`num_gpu_blocks` blocks, and a `ModelRunnerOutput` handed to `update_from_output` in place
of a forward pass. Nothing here runs a model.

The loop is the engine's, in discrete time:

    add the requests that arrived by now
    out = scheduler.schedule()
    now += step_time(tokens scheduled per request, context length per request)
    one sampled token for each request whose computed tokens reached its known tokens
    scheduler.update_from_output(out, that output)

The sampled tokens are the ones the caller gives (servesim's synthetic output ids), so the
blocks holding generated tokens hash exactly as servesim's do.

vLLM's block pool keeps block 0 as its null block: the pool gets `num_gpu_blocks + 1` blocks
so that `num_gpu_blocks` are usable, as in servesim.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
from transformers import LlamaConfig
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

VOCAB_SIZE = 1 << 20  # above any synthetic token id

# (tokens scheduled this step, context length after the step), one entry per request -> seconds
StepTime = Callable[[list[int], list[int]], float]


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # the tokens it will generate: max_tokens is their count
    priority: int = 0


@dataclass(frozen=True)
class EngineSetup:
    """The scheduler and cache options both simulators are given (vLLM's names)."""

    block_size: int = 16
    num_gpu_blocks: int = 1000  # usable KV blocks
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    reserve_full_isl: bool = True
    max_model_len: int = 1 << 16


@dataclass
class Timeline:
    """What a run produced: per request (in trace order) and per step."""

    first_token_s: list[float | None]
    finish_s: list[float | None]
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (prefill tokens, decode tokens, preemptions)
    prefix_queries: int = 0  # tokens looked up at first admissions (vLLM's PrefixCacheStats.queries)
    prefix_hits: int = 0  # of which found cached (PrefixCacheStats.hits)


@functools.lru_cache(maxsize=1)
def _model_dir() -> str:
    folder = tempfile.mkdtemp(prefix="servesim-parity-")
    LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1 << 20,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


@functools.lru_cache(maxsize=1)
def _block_hasher_ready() -> bool:
    init_none_hash(sha256)
    return True


def make_scheduler(setup: EngineSetup) -> Scheduler:
    model = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0,
                        max_model_len=setup.max_model_len)
    scheduler = SchedulerConfig(
        max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
        long_prefill_token_threshold=setup.long_prefill_token_threshold, policy=setup.scheduling_policy,
        scheduler_reserve_full_isl=setup.reserve_full_isl, async_scheduling=False)
    cache = CacheConfig(block_size=setup.block_size, enable_prefix_caching=setup.enable_prefix_caching)
    config = VllmConfig(scheduler_config=scheduler, model_config=model, cache_config=cache)
    num_blocks = setup.num_gpu_blocks + 1  # block 0 is vLLM's null block
    kv_cache = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=setup.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    cache.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=setup.block_size, log_stats=True)


def run_vllm(requests: list[TraceRequest], setup: EngineSetup, step_time: StepTime,
             max_steps: int = 1_000_000) -> Timeline:
    """Replay `requests` through vLLM's V1 scheduler; times come from `step_time` alone."""
    _block_hasher_ready()
    scheduler = make_scheduler(setup)
    hasher = get_request_block_hasher(setup.block_size, sha256)
    n = len(requests)
    ids = [f"{i:08d}" for i in range(n)]  # zero-padded: vLLM breaks priority ties by id as text
    order = sorted(range(n), key=lambda i: (requests[i].arrival_s, i))
    timeline = Timeline([None] * n, [None] * n)
    index_of = {rid: i for i, rid in enumerate(ids)}
    live: dict[str, Request] = {}
    now, next_arrival, num_finished = 0.0, 0, 0
    for _ in range(max_steps):
        if num_finished == n:
            break
        while next_arrival < n and requests[order[next_arrival]].arrival_s <= now:
            i = order[next_arrival]
            r = requests[i]
            params = SamplingParams(max_tokens=len(r.output_token_ids), ignore_eos=True)
            # A real engine's arrival time is its clock when the request is added, so requests added
            # one after another never tie, and the later one is later: a burst's requests (one
            # instant in the trace) get microseconds apart in trace order, as servesim's victim_key
            # breaks their tie (policies/base.py). Fed the tie itself, vLLM's preemption under
            # priority takes the first in running order, and two requests can preempt each other
            # for ever. Arrivals are whole seconds: this never reorders distinct ones.
            request = Request(ids[i], list(r.prompt_token_ids), params, None,
                              arrival_time=r.arrival_s + next_arrival * 1e-6, priority=r.priority,
                              block_hasher=hasher)
            live[ids[i]] = request
            scheduler.add_request(request)
            next_arrival += 1
        if not scheduler.get_num_unfinished_requests():
            now = requests[order[next_arrival]].arrival_s
            continue
        out = scheduler.schedule()
        if not out.total_num_scheduled_tokens:
            raise RuntimeError(f"vLLM scheduled nothing at t={now} with requests waiting")
        # Decode: a running request computing only its last sampled token (servesim's is_decode;
        # an admission is counted as a prefill even when a cached prefix leaves one token).
        new_ids = {d.req_id for d in out.scheduled_new_reqs}
        resumed = set(out.scheduled_cached_reqs.resumed_req_ids)
        num_prefill = num_decode = 0
        scheduled, contexts = [], []
        for rid, num in out.num_scheduled_tokens.items():
            request = live[rid]
            # num_computed_tokens was advanced at scheduling (_update_after_schedule).
            computed_after = request.num_computed_tokens
            scheduled.append(num)
            contexts.append(computed_after)
            is_decode = (num == 1 and rid not in new_ids and rid not in resumed
                         and request.num_output_tokens > 0 and computed_after == request.num_tokens)
            if is_decode:
                num_decode += 1
            else:
                num_prefill += num
        timeline.steps.append((num_prefill, num_decode, len(out.preempted_req_ids)))
        now += step_time(scheduled, contexts)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = live[rid]
            if request.num_computed_tokens >= request.num_tokens:  # caught up: samples a token
                i = index_of[rid]
                sampled.append([requests[i].output_token_ids[request.num_output_tokens]])
            else:
                sampled.append([])  # a partial prefill chunk samples nothing
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: k for k, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled)
        for outputs in scheduler.update_from_output(out, output).values():
            stats = outputs.scheduler_stats  # this step's, reset by update_from_output (make_stats)
            if stats is not None and stats.prefix_cache_stats is not None:
                timeline.prefix_queries += stats.prefix_cache_stats.queries
                timeline.prefix_hits += stats.prefix_cache_stats.hits
        for rid, tokens in zip(req_ids, sampled):
            if not tokens:
                continue
            i = index_of[rid]
            request = live[rid]
            if request.num_output_tokens == 1 and timeline.first_token_s[i] is None:
                timeline.first_token_s[i] = now
            if request.is_finished():
                timeline.finish_s[i] = now
                num_finished += 1
                del live[rid]
    else:
        raise RuntimeError(f"vLLM did not finish {n} requests in {max_steps} steps")
    return timeline
