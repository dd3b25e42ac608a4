"""Drive vLLM's own V1 `Scheduler` step by step on the CPU, with a mocked forward pass.

This is how vLLM tests its scheduler (`tests/v1/core/utils.py`, `create_scheduler`): a
`VllmConfig` built from a tiny model config (here a `LlamaConfig` saved into a temporary
folder: no weights, no tokenizer), a `KVCacheConfig` with one full-attention group (or one
sliding-window group, `EngineSetup.sliding_window`) and `num_gpu_blocks` blocks, and a
`ModelRunnerOutput` handed to `update_from_output` in place of a forward pass. Nothing here runs a model.

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
from dataclasses import dataclass, field, fields

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import pytest
import torch
import vllm
from transformers import LlamaConfig
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from sim.config import vllm_release

try:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
except ImportError:  # vLLM before 0.33 (bench/host_time.py measures older schedulers), which plans no other way here
    get_kv_cache_groups = None

VOCAB_SIZE = 1 << 20  # above any synthetic token id


def allow_config_without_triton() -> None:
    """vLLM 0.34 refuses a `VllmConfig` on an x86 CPU without Triton's CPU backend
    (vllm/platforms/cpu.py, `CpuPlatform.check_and_update_config`: "vLLM on x86 CPUs requires
    Triton"), which its CPU model runner's kernels need. The parity suite builds the config for the
    scheduler alone and runs no model, so it tells that check Triton is there (0.33 has no check)."""
    import vllm.triton_utils

    vllm.triton_utils.HAS_TRITON = True


allow_config_without_triton()

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
    long_prefill_token_threshold_adaptive: bool = False
    prefill_schedule_interval: int = 1
    scheduling_policy: str = "fcfs"
    reserve_full_isl: bool = True
    max_model_len: int = 1 << 16
    async_scheduling: bool = False  # vLLM's AsyncScheduler driven as the engine core's batch queue drives it
    sliding_window: int | None = None  # one group of sliding-window layers (SlidingWindowSpec) in place of full attention
    hybrid: bool = False  # with sliding_window: a sliding group, then a full-attention group (gpt-oss, Gemma 2)
    # vLLM's --disable-hybrid-kv-cache-manager: the groups are what vLLM's get_kv_cache_groups makes of the layers'
    # specs with it (a sliding layer beside a full one promoted to full attention: one group)
    disable_hybrid_kv_cache_manager: bool = False
    watermark: float = 0.0  # blocks kept free at admission while any request runs
    max_num_active_seqs: int | None = None  # the admission limit into RUNNING (None: max_num_seqs)
    cache_aware_admission_window: int = 0  # vLLM 0.34's cache-aware admission (0: off; not in 0.33)
    cache_aware_admission_threshold: float = 0.5
    # One DP rank of a mixture of experts (`DPRankLoop`): the scheduler made as a DP rank's, driven as
    # DPEngineCoreProc.run_busy_loop drives it, `schedule(throttle_prefills)` from the shared step counter.
    moe_dp_rank: bool = False


DUMMY_STEP = ([1], [1])  # a DP rank's dummy batch, for the step-time function: one decode token, context 1


class DPRankLoop:
    """The busy loop of one mixture-of-experts DP rank (vllm/v1/engine/core.py, DPEngineCoreProc), for a
    rank whose peers never hold a request (each of their turns a dummy batch, which the step-time
    function prices no longer than any real step, so the lockstep step is this rank's):

        each turn: add the arrivals (one to a paused rank starts a wave: `engines_running`);
            schedule(throttle_prefills = N > 1 and step_counter % N != 0)   (_should_throttle_prefills)
            and run it; where the turn ran no model but the wave runs: a dummy batch (execute_dummy_batch)
        then step_counter += 1; at the wave's first step and every dp_sync_interval (16) steps, a rank
        with no unfinished request ends the wave: step_counter = 0, paused until the next arrival
        (_has_global_unfinished_reqs, run_busy_loop)."""

    DP_SYNC_INTERVAL = 16  # vllm/config/parallel.py ParallelConfig.dp_sync_interval

    def __init__(self, interval: int):
        self.interval = interval
        self.step_counter = 0
        self.running = False  # engines_running: a wave runs

    @property
    def throttle_prefills(self) -> bool:
        return self.interval > 1 and self.step_counter % self.interval != 0

    def end_turn(self, scheduler: Scheduler) -> None:
        self.step_counter += 1
        if self.step_counter == 1 or self.step_counter % self.DP_SYNC_INTERVAL == 0:
            self.running = scheduler.has_unfinished_requests()
            if not self.running:
                self.step_counter = 0


@dataclass
class Timeline:
    """What a run produced: per request (in trace order) and per step."""

    first_token_s: list[float | None]
    finish_s: list[float | None]
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (prefill tokens, decode tokens, preemptions)
    prefix_queries: int = 0  # tokens looked up at first admissions (vLLM's PrefixCacheStats.queries)
    prefix_hits: int = 0  # of which found cached (PrefixCacheStats.hits)
    # Filled by run_vllm_async only (the asynchronous engine's clock, docs/async-scheduling.md):
    first_scheduled_s: list[float | None] = field(default_factory=list)  # per request: CPU time of its first schedule
    # per step: (launched: scheduled plus the host time before the launch, GPU start, GPU end)
    step_times: list[tuple[float, float, float]] = field(default_factory=list)


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


def runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """The mocked forward pass's output: one list of sampled tokens per scheduled request. vLLM 0.33's
    `ModelRunnerOutput` also takes `req_id_to_index`; 0.34's derives it."""
    extra = {}
    if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}:
        extra["req_id_to_index"] = {r: k for k, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)


# The scheduler options later vLLMs added, at their defaults: an older vLLM is driven only with them there.
ABSENT_OPTIONS = {"scheduler_reserve_full_isl": (True,), "watermark": (0.0, 0), "long_prefill_token_threshold_adaptive": (False,),
                  "prefill_schedule_interval": (1,), "max_num_active_seqs": (0, None), "disable_hybrid_kv_cache_manager": (None,)}


def make_scheduler(setup: EngineSetup) -> Scheduler:
    model = ModelConfig(model=_model_dir(), skip_tokenizer_init=True, dtype="float16", seed=0,
                        max_model_len=setup.max_model_len)
    extra = {}
    if setup.cache_aware_admission_window:
        if "cache_aware_admission_window" not in SchedulerConfig.__dataclass_fields__:
            pytest.skip(f"vLLM {vllm.__version__} has no cache-aware admission (it came in 0.34)")
        extra = {"cache_aware_admission_window": setup.cache_aware_admission_window,
                 "cache_aware_admission_threshold": setup.cache_aware_admission_threshold}
    options = dict(
        max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
        long_prefill_token_threshold=setup.long_prefill_token_threshold, policy=setup.scheduling_policy,
        scheduler_reserve_full_isl=setup.reserve_full_isl, async_scheduling=setup.async_scheduling,
        watermark=setup.watermark, long_prefill_token_threshold_adaptive=setup.long_prefill_token_threshold_adaptive,
        prefill_schedule_interval=setup.prefill_schedule_interval, max_num_active_seqs=setup.max_num_active_seqs,
        disable_hybrid_kv_cache_manager=setup.disable_hybrid_kv_cache_manager or None, **extra)
    # An older vLLM (bench/host_time.py measures vLLM 0.12's scheduler) lacks the later options: they may
    # only be left at their defaults, and are not passed.
    for name in [n for n in options if n not in SchedulerConfig.__dataclass_fields__]:
        value = options.pop(name)
        if value not in ABSENT_OPTIONS.get(name, ()):
            raise NotImplementedError(f"vLLM {vllm.__version__} has no SchedulerConfig.{name} (asked for {value!r})")
    if options["disable_hybrid_kv_cache_manager"] is None and (vllm_release(vllm.__version__) or (0, 0)) < (0, 33):
        # (a bool there, default False)
        options["disable_hybrid_kv_cache_manager"] = False
    scheduler = SchedulerConfig(**options)
    cache = CacheConfig(block_size=setup.block_size, enable_prefix_caching=setup.enable_prefix_caching)
    config = VllmConfig(scheduler_config=scheduler, model_config=model, cache_config=cache)
    # VllmConfig turns asynchronous scheduling off on this CPU platform; on a GPU it stays on, and
    # `max_concurrent_batches` (2) counts two batches in flight, which a sliding window's admission
    # cap reads (SlidingWindowSpec.max_admission_blocks_per_request). The scheduler reads nothing
    # else of it here (the AsyncScheduler class is chosen below).
    config.scheduler_config.async_scheduling = setup.async_scheduling
    if setup.moe_dp_rank:
        # A mixture of experts' DP rank keeps data_parallel_size > 1 (core.py run_engine_core makes a
        # DPEngineCoreProc), so vLLM's Scheduler.__init__ turns its local cadence off itself
        # (`local_prefill_interval` 1); nothing else of the scheduler reads the size.
        config.parallel_config.data_parallel_size = 2
    num_blocks = setup.num_gpu_blocks + 1  # block 0 is vLLM's null block
    layer = dict(block_size=setup.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    spec = (FullAttentionSpec(**layer) if setup.sliding_window is None
            else SlidingWindowSpec(sliding_window=setup.sliding_window, **layer))
    groups = [KVCacheGroupSpec(["layer"], spec)]
    if setup.hybrid:
        groups.append(KVCacheGroupSpec(["full"], FullAttentionSpec(**layer)))
    if setup.disable_hybrid_kv_cache_manager:
        # vLLM's own grouping under the flag (vllm/v1/core/kv_cache_planning.py get_kv_cache_groups:
        # unify_hybrid_kv_cache_specs, then one group of the specs now alike), from each layer's spec.
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is True
        groups = get_kv_cache_groups(config, {name: g.kv_cache_spec for g in groups for name in g.layer_names})
    kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    cache.num_gpu_blocks = num_blocks
    kind = AsyncScheduler if setup.async_scheduling else Scheduler
    return kind(vllm_config=config, kv_cache_config=kv_cache,
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
    dp = DPRankLoop(setup.prefill_schedule_interval) if setup.moe_dp_rank else None
    for _ in range(max_steps):
        if num_finished == n:
            break
        if dp is not None and next_arrival < n and requests[order[next_arrival]].arrival_s <= now:
            dp.running = True  # a request starts a wave (DPEngineCoreProc.add_request)
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
        if dp is not None and (dp.running or scheduler.has_requests()):
            out = scheduler.schedule(dp.throttle_prefills) if scheduler.has_requests() else None
            if out is None or not out.total_num_scheduled_tokens:  # no model ran: a dummy batch
                now += step_time(*DUMMY_STEP)
                dp.end_turn(scheduler)
                continue
        elif not scheduler.get_num_unfinished_requests():
            now = requests[order[next_arrival]].arrival_s
            continue
        else:
            out = scheduler.schedule()
        if not out.total_num_scheduled_tokens:
            if not out.preempted_req_ids:
                raise RuntimeError(f"vLLM scheduled nothing at t={now} with requests waiting")
            # It preempted the only decodes while the cadence held the prefills: EngineCore.step runs the empty
            # step (the runner returns EMPTY_MODEL_RUNNER_OUTPUT at once) and schedules again, no time passing.
            scheduler.update_from_output(out, runner_output([], []))
            continue
        # Decode: a running request computing only its last sampled token (servesim's is_decode;
        # an admission is counted as a prefill even when a cached prefix leaves one token).
        new_ids = {d.req_id for d in out.scheduled_new_reqs}
        resumed = set(getattr(out.scheduled_cached_reqs, "resumed_req_ids", ()))  # 0.34: in scheduled_new_reqs
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
        output = runner_output(req_ids, sampled)
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
        if dp is not None:
            dp.end_turn(scheduler)
    else:
        raise RuntimeError(f"vLLM did not finish {n} requests in {max_steps} steps")
    return timeline


def run_vllm_async(requests: list[TraceRequest], setup: EngineSetup, step_time: StepTime,
                   host_time: StepTime | None = None, output_time: StepTime | None = None,
                   max_steps: int = 1_000_000) -> Timeline:
    """Replay `requests` through vLLM's `AsyncScheduler` as `EngineCore.step_with_batch_queue` drives it
    (vllm/v1/engine/core.py, batch queue of 2: `VllmConfig.max_concurrent_batches`), the forward pass mocked.

    The engine core's thread, in discrete time (docs/async-scheduling.md):

        add the requests that arrived by now                      (run_busy_loop: _process_input_queue)
        if the scheduler has requests:
            out = scheduler.schedule(); now += host_time(out)     (the CPU's share before the launch)
            the GPU runs it from max(now, the previous batch's end) for step_time(out) seconds
            push it on the queue; if the queue is not full and the step ran a model (or requests
            remain): go round again without waiting
        pop the oldest batch; now = max(now, its end)             (future.result())
        scheduler.update_from_output(its output); now += output_time(it)   (tokens appear now)

    An empty batch (nothing schedulable: every running request's last token already in flight) runs
    no model and is done at once. `host_time` (default none) is the CPU's seconds per scheduled step
    spent before its launch (schedule, prepare the inputs); `output_time` (default none) the seconds of
    processing a step's output once the GPU is done (sampling bookkeeping, update_from_output), after
    which its tokens are seen. The parity cases use neither, so times stay whole numbers.

    Tokens: a scheduled request samples when the step reaches the end of its known tokens plus its
    output placeholders (`not request.is_prefill_chunk` after `_update_after_schedule`); the sampled id
    is the next of its output ids when the step's output is processed.
    """
    _block_hasher_ready()
    assert setup.async_scheduling, "run_vllm_async drives the AsyncScheduler: EngineSetup(async_scheduling=True)"
    scheduler = make_scheduler(setup)
    hasher = get_request_block_hasher(setup.block_size, sha256)
    n = len(requests)
    ids = [f"{i:08d}" for i in range(n)]
    order = sorted(range(n), key=lambda i: (requests[i].arrival_s, i))
    timeline = Timeline([None] * n, [None] * n, first_scheduled_s=[None] * n)
    index_of = {rid: i for i, rid in enumerate(ids)}
    live: dict[str, Request] = {}
    queue: list[tuple] = []  # oldest first: (out, req ids, samples, GPU end, tokens scheduled, contexts)
    now, gpu_free, next_arrival, num_finished, steps = 0.0, 0.0, 0, 0, 0
    # Preemptions of a schedule that ran nothing (its only request preempted itself) count in the next
    # step that runs, as servesim records them (vLLM's output of the empty step carries them alone).
    carried_preemptions = 0
    queue_size = 2  # VllmConfig.max_concurrent_batches with async scheduling, pipeline parallel 1
    dp = DPRankLoop(setup.prefill_schedule_interval) if setup.moe_dp_rank else None
    executed = False  # whether this turn's schedule ran a model (a DP rank runs a dummy batch otherwise)

    def end_turn() -> None:
        nonlocal now, gpu_free
        if dp is None:
            return
        if not executed:  # run_busy_loop: execute_dummy_batch, waited for, after what the GPU still runs
            now = gpu_free = max(now, gpu_free) + step_time(*DUMMY_STEP)
        dp.end_turn(scheduler)

    while num_finished < n:
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"vLLM did not finish {n} requests in {max_steps} steps")
        if dp is not None and next_arrival < n and requests[order[next_arrival]].arrival_s <= now:
            dp.running = True  # a request starts a wave (DPEngineCoreProc.add_request)
        while next_arrival < n and requests[order[next_arrival]].arrival_s <= now:
            i = order[next_arrival]
            live[ids[i]] = _add_request(scheduler, requests[i], ids[i], next_arrival, hasher)
            next_arrival += 1
        executed = False
        if not scheduler.has_requests() and not queue:
            if dp is not None and dp.running:  # nothing to run while the wave runs: a dummy turn
                end_turn()
                continue
            now = requests[order[next_arrival]].arrival_s  # idle until the next arrival
            continue
        # step_with_batch_queue
        if scheduler.has_requests():
            out = scheduler.schedule() if dp is None else scheduler.schedule(dp.throttle_prefills)
            executed = out.total_num_scheduled_tokens > 0
            req_ids = list(out.num_scheduled_tokens)
            scheduled, contexts = [], []
            samples = [not live[rid].is_prefill_chunk for rid in req_ids]
            if executed:
                for rid in req_ids:
                    scheduled.append(out.num_scheduled_tokens[rid])
                    contexts.append(live[rid].num_computed_tokens)  # includes tokens still in flight
                    if timeline.first_scheduled_s[index_of[rid]] is None:
                        timeline.first_scheduled_s[index_of[rid]] = now
                num_prefill, num_decode, num_preempted = _classify(out, live, samples)
                timeline.steps.append((num_prefill, num_decode, num_preempted + carried_preemptions))
                carried_preemptions = 0
                if host_time is not None:
                    now += host_time(scheduled, contexts)
                start = max(now, gpu_free)
                gpu_free = start + step_time(scheduled, contexts)
                timeline.step_times.append((now, start, gpu_free))
                end = gpu_free
            else:
                end = now
                carried_preemptions += len(out.preempted_req_ids or ())
            queue.append((out, req_ids, samples, end, scheduled, contexts))
            if len(queue) < queue_size and (executed or scheduler.has_requests()):
                end_turn()
                continue
        out, req_ids, samples, end, scheduled, contexts = queue.pop(0)
        now = max(now, end)
        sampled = []
        for rid, samples_one in zip(req_ids, samples):
            request = live.get(rid)
            if samples_one and request is not None:
                tokens = requests[index_of[rid]].output_token_ids
                if request.num_output_tokens >= len(tokens):
                    raise RuntimeError(f"vLLM sampled request {rid} past its {len(tokens)} output tokens")
                sampled.append([tokens[request.num_output_tokens]])
            else:
                sampled.append([])
        output = runner_output(req_ids, sampled)
        _count_prefix_stats(timeline, scheduler.update_from_output(out, output))
        if output_time is not None and scheduled:
            now += output_time(scheduled, contexts)
        for rid, tokens in zip(req_ids, sampled):
            request = live.get(rid)
            if not tokens or request is None:
                continue
            i = index_of[rid]
            if request.num_output_tokens >= 1 and timeline.first_token_s[i] is None:
                timeline.first_token_s[i] = now
            if request.is_finished():
                timeline.finish_s[i] = now
                num_finished += 1
                del live[rid]
        end_turn()
    return timeline


def _add_request(scheduler: Scheduler, r: TraceRequest, request_id: str, rank: int, hasher) -> Request:
    """Add one trace request to the scheduler (arrival times as run_vllm gives them)."""
    params = SamplingParams(max_tokens=len(r.output_token_ids), ignore_eos=True)
    request = Request(request_id, list(r.prompt_token_ids), params, None, arrival_time=r.arrival_s + rank * 1e-6,
                      priority=r.priority, block_hasher=hasher)
    scheduler.add_request(request)
    return request


def _classify(out, live: dict[str, Request], samples: list[bool]) -> tuple[int, int, int]:
    """(prefill tokens, decode tokens, preemptions) of a step just scheduled by the AsyncScheduler: a decode
    computes one token of a running request that already has an output (delivered or in flight)."""
    new_ids = {d.req_id for d in out.scheduled_new_reqs}
    resumed = set(getattr(out.scheduled_cached_reqs, "resumed_req_ids", ()))  # 0.34: in scheduled_new_reqs
    num_prefill = num_decode = 0
    for (rid, num), samples_one in zip(out.num_scheduled_tokens.items(), samples):
        request = live[rid]
        # This step's own placeholder was added at scheduling: earlier outputs are the rest.
        earlier = request.num_output_tokens + request.num_output_placeholders - (1 if samples_one else 0)
        if num == 1 and rid not in new_ids and rid not in resumed and samples_one and earlier > 0:
            num_decode += 1
        else:
            num_prefill += num
    return num_prefill, num_decode, len(out.preempted_req_ids)


def _count_prefix_stats(timeline: Timeline, engine_outputs) -> None:
    for outputs in engine_outputs.values():
        stats = outputs.scheduler_stats  # this step's, reset by update_from_output (make_stats)
        if stats is not None and stats.prefix_cache_stats is not None:
            timeline.prefix_queries += stats.prefix_cache_stats.queries
            timeline.prefix_hits += stats.prefix_cache_stats.hits
