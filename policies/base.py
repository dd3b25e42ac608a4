"""What every policy shares: a token budget per step, an admission limit (`max_num_seqs`, or
`--max-num-active-seqs` below it), FCFS admission, and the KV cache's rules (admit only when
blocks fit; preempt by recompute when a running request cannot grow)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from sim.batch import Batch
from sim.config import SchedulerConfig
from sim.request import Request, Status, split_decoding
from sim.state import EngineState

# Methods that decide admission or the decodes of a step: a subclass overriding any of them
# changes what fast-forward relies on, so it must state its promises itself (see `Policy`).
SCHEDULING_METHODS = ("schedule", "finish_may_admit", "_try_admit", "_admit_whole_prompts", "_schedule_decodes",
                      "_schedule_all_decodes", "_schedule_running", "_victim", "_split_running")


@dataclass(frozen=True)
class Promises:
    """What a policy promises the engine about the steps it would schedule, so that the engine may
    plan runs of them instead of asking it step by step (sim/fast_forward.py). Each is explained
    in `Policy`'s docstring; the second and third are relied on only together with the first.

    - `fast_forward`: after a decode-only step of every running request, the same decodes until
      the next arrival, admitting only where `finish_may_admit` says so;
    - `decodes_all_when_none_waits`: with none waiting and every running request decoding, the
      next step decodes them all (a run may begin with the step that admitted a request);
    - `repeats_full_chunk_steps`: a step that the decodes and one prefill chunk fill to
      `chunk_run_budget()` repeats (a chunk run)."""

    fast_forward: bool = False
    decodes_all_when_none_waits: bool = False
    repeats_full_chunk_steps: bool = False


NO_PROMISES = Promises()
# The class attributes that declared the promises before `Promises` (a policy written with them
# keeps working: `Policy.__init_subclass__` reads them): old name -> Promises field.
LEGACY_PROMISES = {"supports_fast_forward": "fast_forward",
                   "decodes_all_when_none_waits": "decodes_all_when_none_waits",
                   "repeats_full_chunk_steps": "repeats_full_chunk_steps"}


def victim_key(request: Request) -> tuple[int, float, int]:
    """The order in which `--scheduling-policy priority` preempts: the largest key first. vLLM's
    Scheduler.schedule (vllm/v1/core/sched/scheduler.py) preempts
    `max(self.running, key=lambda r: (r.priority, r.arrival_time))`; its arrival times are the
    engine's clock at each request's creation, so they never tie and later ones belong to later
    requests. A trace's arrivals may tie (a burst in one millisecond, a closed loop's first
    requests at 0), and Python's max then returns the first in running order: two requests that
    cannot both fit would preempt each other by turns, each losing its progress, for ever. So a
    tie goes by trace order, the later request first, as vLLM's clock would have ordered them and
    as the waiting queue orders them (PriorityWaiting). Under `chunked` the request with the
    smallest key is then never preempted while another one runs, so it finishes."""
    return request.priority, request.arrival_s, request.index


class Policy:
    """A scheduling policy: `schedule(state, now)` returns this step's batch, reserving its KV blocks.

    What a policy may read: `state.waiting`, `state.running`, `state.num_seats` (the seats of the
    admission limit, `config.max_num_active_reqs`, taken, finishing requests' too under
    asynchronous scheduling) and their requests' token state (`num_prompt_tokens`,
    `num_computed_tokens`, `num_output_tokens`, `max_tokens`, `arrival_s`, ...),
    `state.block_manager`'s `can_*` queries, `state.step_index`, `now` and `self.config`.
    What it changes, only through this class's helpers: admission (`_try_admit`), block
    reservations (`_schedule_running`, `_schedule_decodes`) and preemption (`_preempt`). It must
    not touch the backend, the clock, the step log, or a request's timeline fields.

    Promises. `promises` (a `Promises`, one typed value on the class) says what the engine may rely
    on to plan runs of steps instead of asking the policy step by step (sim/fast_forward.py). The
    base class makes none; the three built-in policies make theirs. A subclass inherits its
    parent's promises as long as it overrides none of `SCHEDULING_METHODS`; one that overrides any
    of them must state its own in its class body (`promises = Promises()` to make none, or
    `promises = ChunkedPolicy.promises` to keep them, having checked they still hold): otherwise
    defining the class raises TypeError. Nothing is withdrawn behind a class's back.

    `Promises.fast_forward` is a promise the engine relies on to skip steps: whenever this policy
    has scheduled a decode-only step of every running request without preempting, then until the
    next arrival, and as long as the free blocks cover the decodes' growth, it would schedule
    exactly the same requests one decode token each and admit no waiting request, whatever `now`
    is; and after a running request finishes, a waiting request could be admitted only where
    `finish_may_admit(state)` says so. A policy that admits by waiting time, say, must not make it.

    `Promises.decodes_all_when_none_waits` lets a run of decode steps begin with the step before
    it, the one that admitted a request (a mixed or prefill step), so that one plan costs and
    applies both: whenever no request waits and every running request is decoding, the next step
    this policy schedules is a decode-only step of every running request, one token each, in
    running order, unless their new blocks do not fit.

    `Promises.repeats_full_chunk_steps` lets the engine take a run of steps that carry a long
    prompt's prefill forward chunk by chunk beside the decodes in one go (a chunk run,
    sim/fast_forward.py): whenever every running request but the last (in running order) is
    decoding, and the last has a prefill with more tokens left than the budget that
    `chunk_run_budget()` returns leaves after one token for each decode, then as long as the free
    blocks cover the step, the next step this policy schedules is the decodes one token each and
    the last request the rest of the budget, admitting no one, whatever arrived meanwhile. Only
    `chunked` makes it (whole-prompt policies never schedule such steps).

    Before `Promises`, policies declared them as three booleans in the class body
    (`supports_fast_forward`, `decodes_all_when_none_waits`, `repeats_full_chunk_steps`). A class
    that still does keeps working: its promises are made from them, those it does not set
    inherited, or none where it overrides a scheduling method (the old rule). It may not set both.
    """

    name = ""
    promises: ClassVar[Promises] = NO_PROMISES
    # A step may hold a whole prompt beyond the token budget (`_admit_whole_prompts`): a sliding
    # window's cache then has up to max_model_len tokens in flight, not only the budget's (sim/app/plan.py).
    whole_prompts: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        overridden = [m for m in SCHEDULING_METHODS if m in own]
        legacy = {field: bool(own[old]) for old, field in LEGACY_PROMISES.items() if old in own}
        if legacy:
            if "promises" in own:
                raise TypeError(f"policy class {cls.__qualname__} sets both `promises` and the old "
                                f"{', '.join(LEGACY_PROMISES)} flags: keep `promises` only")
            inherited = NO_PROMISES if overridden else cls.promises
            cls.promises = Promises(**{f.name: legacy.get(f.name, getattr(inherited, f.name)) for f in fields(Promises)})
        elif "promises" in own:
            if not isinstance(own["promises"], Promises):
                raise TypeError(f"policy class {cls.__qualname__}: `promises` must be a policies.base.Promises, "
                                f"not {type(own['promises']).__name__}")
        elif overridden and cls.promises != NO_PROMISES:
            raise TypeError(
                f"policy class {cls.__qualname__} overrides {', '.join(overridden)} and would inherit the promises "
                f"{cls.promises}: state them in its class body, `promises = Promises()` to make none or "
                f"`promises = <its parent>.promises` to keep them (see policies.base.Policy)")

    def __init__(self, config: SchedulerConfig):
        config.check_max_num_active_seqs()  # (a plan checked it; a config built by hand is checked here)
        self.config = config

    def schedule(self, state: EngineState, now: float) -> Batch:
        """Choose this step's requests and token counts, reserving their KV blocks."""
        raise NotImplementedError

    def chunk_run_budget(self) -> int | None:
        """The token budget of the steps that `Promises.repeats_full_chunk_steps` is about; None where the
        promise is not made (the base class never makes it)."""
        return None

    def retry_s(self, state: EngineState, now: float) -> float | None:
        """When `schedule` returned an empty batch (it may only do so with no request running),
        the time to try again; None: at the next arrival. The built-in policies always schedule
        something when there is work."""
        return None

    def finish_may_admit(self, state: EngineState) -> bool:
        """Whether a request finishing (freeing its slot and blocks) could let a waiting request
        in at the next step. The engine's fast-forward runs past finishes when it cannot."""
        return bool(state.waiting)

    # Running requests.

    def _schedule_running(self, state: EngineState, batch: Batch, request: Request, num_tokens: int) -> bool:
        """Reserve blocks for `num_tokens` more tokens of a running request and add it to the batch,
        preempting the most recently admitted unscheduled requests while blocks run short.
        Returns False when the request itself had to be preempted. Every preemption, of it or of
        another request, is counted in `state.num_preemptions`: a caller compares that count to
        know whether its step preempted."""
        bm = state.block_manager
        while not bm.can_append(request, num_tokens):
            victim = self._victim(state)
            self._preempt(state, victim)
            if victim is request:
                return False
        bm.append(request, num_tokens)
        self._add(state, batch, request, num_tokens, request.is_decoding)
        return True

    def _schedule_decodes(self, state: EngineState, batch: Batch, decoders: list[Request]) -> bool:
        """One token for each of `decoders` (running requests that are decoding), in order.
        Returns True if any request was preempted. This runs for every decoding request on every
        step, so when the free blocks cover every decode that opens a block (the common case),
        the batch is filled in bulk, taking blocks in the same order as one by one (a block manager
        that frees blocks as it schedules, `frees_when_scheduled`, frees them in the same order too:
        the frees only add to blocks that already cover every opening)."""
        bm = state.block_manager
        bs = bm.block_size
        opening = [r for r in decoders if len(r.block_table) * bs <= r.num_computed_tokens]
        if len(opening) * bm.blocks_per_opening > bm.num_free_blocks:
            num_preemptions = state.num_preemptions
            for request in decoders:
                if request.status is Status.RUNNING:  # not preempted meanwhile
                    self._schedule_running(state, batch, request, 1)
            return state.num_preemptions != num_preemptions
        if bm.frees_when_scheduled:  # each frees, then takes, in order (what one by one would do)
            bm.grow_decodes(decoders)
        elif opening:
            bm.grow_tables(opening)
        step = state.step_index
        num_computed = []
        for request in decoders:
            request.last_scheduled_step = step
            num_computed.append(request.num_computed_tokens)
        batch.add_decodes(decoders, num_computed)
        return False

    @staticmethod
    def _split_running(state: EngineState) -> tuple[list[Request], list[Request]]:
        """The running requests that are decoding, and the others (prefilling), in order."""
        return split_decoding(state.running)

    def _victim(self, state: EngineState) -> Request:
        """The running request to preempt among those not yet scheduled in this step: the most
        recently admitted, or under `--scheduling-policy priority` the one with the largest
        (priority, arrival) (`victim_key`), as vLLM picks (`chunked` follows vLLM further: see its
        docstring); a finishing one where vLLM's running list has it there (`_or_finishing`)."""
        step = state.step_index
        if self.config.scheduling_policy == "priority":
            victim = max((r for r in state.running if r.last_scheduled_step != step), key=victim_key, default=None)
            return self._or_finishing(state, victim, True)
        for r in reversed(state.running):
            if r.last_scheduled_step != step:
                return self._or_finishing(state, r, False)
        return self._or_finishing(state, None, False)

    @staticmethod
    def _or_finishing(state: EngineState, victim: Request | None, priority: bool) -> Request:
        """`victim`, or a request finishing in the step in flight that vLLM would preempt first.
        Under asynchronous scheduling vLLM's running list still holds them, in their place, until
        that step's output is processed, and Scheduler.schedule picks its victim from the whole list
        (`self.running[-1]`, or the largest (priority, arrival)): a finishing request can be
        preempted, its blocks freed at once; its last token, in flight, still finishes it
        (`_preempt_request` keeps it as a stale output)."""
        if state.finishing:
            if priority:
                last = max(state.finishing, key=victim_key)
                if victim is None or victim_key(last) > victim_key(victim):
                    return last
            else:
                last = max(state.finishing, key=lambda r: r.admission_order)
                if victim is None or last.admission_order > victim.admission_order:
                    return last
        if victim is None:
            raise AssertionError("no unscheduled running request to preempt")
        return victim

    def _preempt(self, state: EngineState, request: Request, num_scheduled: int = 0) -> None:
        """Preemption by recompute: drop its KV blocks; it restarts from the front of the queue.
        `num_scheduled`: its tokens of this step, for a request preempted after it was scheduled.
        A request finishing in the step in flight (`_or_finishing`) only frees its blocks."""
        if request.status is Status.FINISHED:
            state.finishing.remove(request)
            state.block_manager.release_finished(request)
            request.num_preemptions += 1
            state.num_preemptions += 1
            return
        state.block_manager.free(request, preempted=True, num_scheduled=num_scheduled)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        state.num_preemptions += 1
        state.running.remove(request)
        state.waiting.appendleft(request)

    # Waiting requests.

    def _try_admit(self, state: EngineState, batch: Batch, now: float, max_chunk: int | None) -> int:
        """Admit the head of the waiting queue if its blocks fit (its cached prefix is computed). With `max_chunk` the prefill is
        chunked to it; without, the whole remaining prompt is scheduled. Returns tokens scheduled
        (0 when it could not be admitted).

        With `reserve_full_isl` (the default) the blocks of the request's whole current sequence
        must be free, not only those of its first chunk: vLLM 0.33's Scheduler.schedule passes
        `full_sequence_must_fit=scheduler_reserve_full_isl` to KVCacheManager.allocate_slots.

        With `--watermark W`, while any request runs (vLLM's `has_scheduled_reqs=bool(self.running)`,
        the finishing ones of a step in flight among them), int(W x the pool's blocks) must stay free
        besides the request's (`allocate_slots`: `watermark_blocks = int(watermark *
        kv_cache_config.num_blocks)`, the pool's blocks with its null block: servesim's + 1)."""
        request = state.waiting[0]
        bm = state.block_manager
        cached = bm.cached_prefix(request)
        remaining = request.num_tokens - len(cached) * bm.block_size
        num_tokens = remaining if max_chunk is None else min(remaining, max_chunk)
        watermark = self.config.watermark
        reserve = int(watermark * (bm.num_blocks + 1)) if watermark and (state.running or state.finishing) else 0
        if not (bm.can_allocate(cached, remaining, num_tokens, reserve) if self.config.reserve_full_isl
                else bm.can_allocate(cached, num_tokens, 0, reserve)):
            return 0
        state.waiting.popleft()
        num_hit = bm.allocate(request, cached, num_tokens)
        request.num_computed_tokens = num_hit
        request.num_prefix_hit_tokens += num_hit
        request.status = Status.RUNNING
        if request.first_scheduled_s is None:
            request.first_scheduled_s = now
        state.join_running(request)
        # An admission is a prefill, even of a preempted request whose cached prefix leaves only
        # its last sampled token to compute.
        self._add(state, batch, request, num_tokens, is_decode=False)
        return num_tokens

    def _admit_whole_prompts(self, state: EngineState, batch: Batch, now: float) -> int:
        """Admit whole prompts FCFS up to the token budget and the admission limit (--max-num-active-seqs,
        else max_num_seqs: `SchedulerConfig.max_num_active_reqs`). The first is admitted even when it
        alone exceeds the budget, so a long prompt never blocks the queue."""
        num_tokens = 0
        cfg = self.config
        limit = cfg.max_num_active_reqs
        while state.waiting and state.num_seats < limit:
            head = state.waiting[0]
            if num_tokens and num_tokens + head.num_tokens_to_compute > cfg.max_num_batched_tokens:
                # Cached prefix tokens are not computed; check the exact count before refusing.
                cached = state.block_manager.cached_prefix(head)
                remaining = head.num_tokens - len(cached) * state.block_manager.block_size
                if num_tokens + remaining > cfg.max_num_batched_tokens:
                    break
            admitted = self._try_admit(state, batch, now, max_chunk=None)
            if not admitted:
                break
            num_tokens += admitted
        return num_tokens

    def _schedule_all_decodes(self, state: EngineState, batch: Batch) -> bool:
        """One token for every running request (with whole-prompt policies every running request
        is decoding). Returns True if any request was preempted."""
        num_preemptions = state.num_preemptions
        decoders, others = self._split_running(state)
        self._schedule_decodes(state, batch, decoders)
        for request in others:
            if request.status is Status.RUNNING:
                self._schedule_running(state, batch, request, request.num_tokens_to_compute)
        return state.num_preemptions != num_preemptions

    @staticmethod
    def _add(state: EngineState, batch: Batch, request: Request, num_tokens: int, is_decode: bool) -> None:
        request.last_scheduled_step = state.step_index
        num_computed = request.num_computed_tokens
        batch.add_request(request, num_computed, num_tokens, num_computed + num_tokens == request.num_tokens,
                          is_decode)
