"""Run servesim on a parity case: the same trace, options and step-time function as the vLLM
driver, through servesim's engine and `chunked` policy, with a backend whose every step takes
exactly what the step-time function says."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import fields, replace

import numpy as np

from sim import tokens
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.app.replay import make_requests, replay, with_api_server
from sim.backend import StepResult
from sim.config import CacheConfig, SchedulerConfig
from sim.data_parallel import DataParallelGroup
from sim.engine import Engine, TokenTimes
from tests.parity.vllm_driver import EngineSetup, StepTime, Timeline, TraceRequest
from traces.trace import Trace

MODEL = "Llama-3.1-8B"


@functools.lru_cache(maxsize=None)
def sliding_model(window: int) -> str:
    """A folder holding Mistral-7B-v0.1's config.json with a `window`-token sliding window: every
    layer slides, so servesim runs one sliding group (sim/sliding_block_manager.py) as vLLM's side does."""
    from tests.moe_configs import MISTRAL_7B_V01

    folder = tempfile.mkdtemp(prefix="servesim-parity-sliding-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**MISTRAL_7B_V01, "sliding_window": window, "max_position_embeddings": 1 << 20}, f)
    return folder


@functools.lru_cache(maxsize=None)
def hybrid_model(window: int) -> str:
    """Gemma 2 9B's config.json with a `window`-token sliding window: its layers alternate, sliding
    first, so servesim's KV cache groups are a sliding one and a full-attention one, in that order."""
    from tests.moe_configs import GEMMA2_9B

    folder = tempfile.mkdtemp(prefix="servesim-parity-hybrid-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**GEMMA2_9B, "sliding_window": window, "max_position_embeddings": 1 << 20}, f)
    return folder


class StepTimeBackend:
    """A backend whose step takes `step_time(tokens scheduled, context lengths)` seconds."""

    name = "step-time"
    device = "cpu"
    dtype = "none"
    num_blocks = None  # the run's --num-gpu-blocks decides
    supports_fast_forward = True

    def __init__(self, step_time: StepTime):
        self.step_time = step_time

    def execute(self, batch) -> StepResult:
        scheduled = list(batch.num_scheduled_tokens)
        contexts = [c + n for c, n in zip(batch.num_computed_tokens, scheduled)]
        return StepResult(self.step_time(scheduled, contexts), {})

    def decode_run(self, context_lens, num_steps: int, active_steps=None) -> tuple[np.ndarray, dict]:
        """Each step of a decode run costed as `execute` would cost it alone."""
        contexts = list(context_lens)
        active = list(active_steps) if active_steps is not None else [num_steps] * len(contexts)
        seconds = np.empty(num_steps)
        for j in range(num_steps):
            grown = [c + j for c, a in zip(contexts, active) if a > j]
            seconds[j] = self.step_time([1] * len(grown), grown)
        return seconds, {}


def options_for(setup: EngineSetup) -> ReplayOptions:
    sched = {"policy": "chunked", "max_num_batched_tokens": setup.max_num_batched_tokens,
             "max_num_seqs": setup.max_num_seqs, "max_model_len": setup.max_model_len}
    # V1's scheduler options, where this servesim has them.
    known = {f.name for f in fields(SchedulerConfig)}
    for name in ("long_prefill_token_threshold", "scheduling_policy", "reserve_full_isl", "async_scheduling", "watermark",
                 "long_prefill_token_threshold_adaptive", "prefill_schedule_interval",
                 "cache_aware_admission_window", "cache_aware_admission_threshold"):
        if name in known:
            sched[name] = getattr(setup, name)
    if "max_num_active_seqs" in known:
        sched["max_num_active_seqs"] = setup.max_num_active_seqs or 0  # servesim's unset is 0
    if "host_time" in known:
        sched["host_time"] = False  # the step-time function is the whole step, as the vLLM driver's
    cache = {}
    if setup.disable_hybrid_kv_cache_manager:  # (a servesim without the flag fails such a case)
        cache["disable_hybrid_kv_cache_manager"] = True
    return ReplayOptions(
        scheduler=SchedulerConfig(**sched),
        cache=CacheConfig(block_size=setup.block_size, num_blocks=setup.num_gpu_blocks,
                          enable_prefix_caching=setup.enable_prefix_caching, **cache),
        model=MODEL if setup.sliding_window is None else
        (hybrid_model if setup.hybrid else sliding_model)(setup.sliding_window))


def vllm_requests(trace: Trace, setup: EngineSetup, priority=None) -> list[TraceRequest]:
    """The trace's requests with the very token ids servesim gives them: prompt ids from
    `Request.token_ids`, output ids from `sim.tokens.output_token_ids`."""
    spec = resolve(options_for(setup), build_backend=False).token_spec  # the run's seed and vocabulary
    out = []
    for r in make_requests(trace):
        prompt = r.token_ids(0, r.num_prompt_tokens, spec).tolist()
        output = tokens.output_token_ids(spec.seed, r.index, 0, r.max_tokens, spec.vocab_size).tolist()
        p = 0 if priority is None else int(priority[r.index])
        out.append(TraceRequest(r.arrival_s, tuple(prompt), tuple(output), p))
    return out


def run_servesim(trace: Trace, setup: EngineSetup, step_time: StepTime, fast_forward: bool,
                 priority=None) -> Timeline:
    if priority is not None and hasattr(trace, "priority"):
        trace = replace(trace, priority=np.asarray(priority, dtype=np.int64))
    plan = resolve(options_for(setup), backend=StepTimeBackend(step_time))
    result = replay(trace, plan, fast_forward=fast_forward) if not setup.moe_dp_rank else dp_rank_alone(trace, plan)
    n = len(trace)
    timeline = Timeline([None] * n, [None] * n)
    for r in result.requests:
        timeline.first_token_s[r.index] = r.first_token_s
        timeline.finish_s[r.index] = r.finish_s
    steps = result.steps
    timeline.steps = list(zip(steps.num_prefill_tokens.tolist(), steps.num_decode_tokens.tolist(),
                              steps.num_preemptions.tolist()))
    timeline.prefix_queries = result.num_prefix_queried_tokens
    timeline.prefix_hits = result.num_prefix_hit_tokens
    return timeline


def dp_rank_alone(trace: Trace, plan):
    """A mixture of experts' DP rank as the vLLM driver runs one (`DPRankLoop`): a lockstep DP group
    (sim/data_parallel.py) of that one rank, its dummy batches priced by the step-time function as the
    driver prices them, its prefills throttled by the group's step counter. The group never fast-forwards."""
    requests = sorted(make_requests(with_api_server(trace, plan.options)), key=lambda r: (r.arrival_s, r.index))
    token_times = TokenTimes(requests)
    group = DataParallelGroup(requests, token_times, 1, lockstep=True)
    group.add_rank(Engine(plan.make_policy(), plan.backend, plan.make_block_manager(), token_times, plan.max_model_len,
                          fast_forward=False))
    return group.run()
