"""`chunked`: Sarathi-Serve stall-free batching, as vLLM V1 schedules (Scheduler.schedule in
vllm/v1/core/sched/scheduler.py, version 0.33).

First the running requests, in the order they were admitted: each gets what it has left to
compute (one token for a decode), capped by `long_prefill_token_threshold` and by the budget
left. A request whose blocks do not fit preempts the most recently admitted running request
(under `--scheduling-policy priority`, the running request with the largest priority value,
latest arrival on a tie, then latest in the trace (`victim_key`), even one scheduled earlier in
the step, which is then taken back out) until it fits or preempted itself. Then, unless the step
preempted, waiting requests are admitted in queue order, each prefill chunked to the budget left
(and the threshold), while the blocks of its whole sequence fit (`reserve_full_isl`). Steps mix
prefill chunks and decodes.

vLLM's scheduler options, each as vLLM applies them (docs/policies.md):
- `--long-prefill-token-threshold-adaptive`: the cap floored at the budget over the requests
  running and waiting;
- `--prefill-schedule-interval N`: the prefill cadence (`_holds_prefill`): one engine's own, or,
  on a mixture of experts' DP rank, the one its DP group drives (`throttle_prefills`);
- `--cache-aware-admission-window N` (vLLM 0.34): before admitting, the first N waiting requests
  that never ran are reordered among their own places, the longest cached prefix first, queue
  order breaking ties (`_reorder_by_cached_prefix`);
- `--watermark` is in `Policy._try_admit` (policies/base.py), shared by every policy;
- `--max-num-active-seqs N`: admission (of waiting and preempted requests) stops once N run, where it
  would stop at max_num_seqs (`SchedulerConfig.max_num_active_reqs`; vLLM's Scheduler.schedule, the
  WAITING loop: `if num_running >= self.max_num_active_reqs: break`).
"""

from __future__ import annotations

from itertools import islice

from policies.base import NO_PROMISES, Policy, Promises, victim_key
from sim.batch import Batch
from sim.request import Request, Status, num_leading_decoding
from sim.state import EngineState


class ChunkedPolicy(Policy):
    name = "chunked"
    # The promises of policies/base.py: admission only as finish_may_admit says; with none waiting, every
    # running request decodes; a step that the decodes and a chunk fill repeats.
    promises = Promises(fast_forward=True, decodes_all_when_none_waits=True, repeats_full_chunk_steps=True)

    def __init__(self, config) -> None:
        super().__init__(config)
        # vLLM's prefill cadence (Scheduler.__init__: local_prefill_interval, last_prefill_step,
        # num_executed_steps, prefill_capacity_bound).
        self._interval = config.prefill_schedule_interval
        # None: the engine's own (local) cadence, as vLLM's scheduler runs it where data_parallel_size is 1
        # (one engine, or a dense model's DP rank, which vLLM reconfigures to size 1). True or False: this is
        # a mixture of experts' DP rank, whose local cadence vLLM turns off (`local_prefill_interval` 1 while
        # data_parallel_size > 1); its DP group then sets this before each schedule, as vLLM's engine core
        # passes `Scheduler.schedule(throttle_prefills)` (vllm/v1/engine/core.py,
        # DPEngineCoreProc._should_throttle_prefills; sim/data_parallel.py, DataParallelGroup._throttle_prefills).
        self.throttle_prefills: bool | None = None
        self._last_prefill_step = -self._interval  # a full interval back: the first step is never held
        self._num_executed_steps = 0
        self._capacity_bound = False
        if config.cache_aware_admission_window or self._interval > 1:
            # The queue's order then follows what the cache holds at every step (an eviction by a decode's new
            # block can bring another request to the head), or a held prefill is released by the count of
            # steps alone: no run of steps may be planned past either.
            self.promises = NO_PROMISES  # type: ignore[misc]  # this instance's, narrower than the class's

    def chunk_run_budget(self) -> int | None:
        """The step budget, where the decodes and one prefill fill it (`Policy`'s third promise):
        the running requests come first in running order, each decode one token and the prefill
        chunk what is left, so a full step admits no one (`while ... budget > 0`, as vLLM's
        Scheduler.schedule admits from its WAITING queue only `while self.waiting and
        token_budget > 0`, vllm/v1/core/sched/scheduler.py). The promise
        holds unless `long_prefill_token_threshold` can cap the chunk below what is left: it is a
        step's cap only while more than one request runs or waits, which arrivals change."""
        cfg = self.config
        threshold = cfg.long_prefill_token_threshold
        if not self.promises.repeats_full_chunk_steps or 0 < threshold < cfg.max_num_batched_tokens:
            return None
        return cfg.max_num_batched_tokens

    def schedule(self, state: EngineState, now: float) -> Batch:
        batch = Batch()
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        # vLLM lifts the cap when a single request waits or runs: it has nobody to starve.
        num_seats = state.num_seats
        num_eligible = num_seats + len(state.waiting)
        threshold = cfg.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold and cfg.long_prefill_token_threshold_adaptive:
            # vLLM's floor: a fair share of the budget (Scheduler.schedule, `adaptive_long_prefill_threshold`).
            threshold = max(threshold, cfg.max_num_batched_tokens // num_eligible)
        num_preemptions = state.num_preemptions
        cadence = self._interval > 1
        defer = cadence and self._holds_prefill(state)
        budget = self._schedule_running_in_order(state, batch, budget, threshold, defer)
        # A running request's prefill chunk in this step (vLLM's `prefill_scheduled`), or an admission that
        # computes a prompt (`prefill_admitted`: its cached prefix leaves more than its last token).
        carries_prefill = cadence and not all(batch.is_decode)
        # Then new requests, unless this step had to preempt (vLLM admits only `if not preempted_reqs`).
        if state.num_preemptions == num_preemptions:  # (so the seats are those counted above)
            if cfg.cache_aware_admission_window and len(state.waiting) > 1 and not defer:
                self._reorder_by_cached_prefix(state)
            chunk_cap = min(budget, threshold) if threshold else budget
            # vLLM's WAITING loop stops once `len(self.running)` reaches `max_num_active_reqs` (max_num_active_seqs,
            # else max_num_seqs): waiting and preempted requests alike, never the running ones.
            limit = cfg.max_num_active_reqs
            while state.waiting and budget > 0 and num_seats < limit:
                head = state.waiting[0]
                if defer and self._needs_prefill(state, head):
                    break  # held to a step the cadence allows
                admitted = self._try_admit(state, batch, now, max_chunk=chunk_cap)
                if not admitted:
                    break
                carries_prefill = carries_prefill or (cadence and head.num_computed_tokens < head.num_tokens - 1)
                num_seats += 1  # it runs now
                budget -= admitted
                chunk_cap = min(budget, threshold) if threshold else budget
            if cadence and not defer:  # a step that could carry prefill: did it drain the queue?
                self._capacity_bound = bool(state.waiting)
        if cadence:
            self._count_step(batch, carries_prefill)
        return batch

    @staticmethod
    def _needs_prefill(state: EngineState, request: Request) -> bool:
        """Whether admitting `request` computes a prompt: its cached prefix leaves more than its last
        token (vLLM's `num_computed_tokens < request.num_tokens - 1` after the prefix lookup)."""
        bm = state.block_manager
        return len(bm.cached_prefix(request)) * bm.block_size < request.num_tokens - 1

    def _count_step(self, batch: Batch, carries_prefill: bool) -> None:
        """vLLM's cadence clock: a step that scheduled anything is executed (`num_executed_steps`), and one
        that carried prefill restarts the interval (`last_prefill_step`)."""
        if batch.requests:
            self._num_executed_steps += 1
        if carries_prefill:
            self._last_prefill_step = self._num_executed_steps

    def _holds_prefill(self, state: EngineState) -> bool:
        """Whether this step holds prefill back (vLLM's `defer_prefills`, vllm/v1/core/sched/scheduler.py,
        `Scheduler.schedule`, with `prefill_schedule_interval` > 1). The step is throttled either by the
        local cadence (an engine whose data_parallel_size is 1: the step comes fewer than `interval`
        executed steps after the last step that carried prefill) or, on a mixture of experts' DP rank,
        by its DP group's shared step counter (`throttle_prefills`, vllm/v1/engine/core.py,
        DPEngineCoreProc._should_throttle_prefills). A throttled step holds prefill while some running
        request is past its prefill (`any(not r.is_prefill_chunk for r in self.running)`; vLLM's running
        list holds the finishing ones too), unless the last step that could carry prefill left requests
        waiting (`prefill_capacity_bound`)."""
        throttle = self.throttle_prefills
        if throttle is None:
            throttle = (self._num_executed_steps + 1) - self._last_prefill_step < self._interval
        if self._capacity_bound or not throttle:
            return False
        return bool(state.finishing) or any(r.is_decoding for r in state.running)

    def _reorder_by_cached_prefix(self, state: EngineState) -> None:
        """vLLM 0.34's cache-aware admission (vllm/v1/core/sched/scheduler.py,
        `Scheduler._reorder_waiting_by_cached_prefix`, called before the waiting loop of a step that
        preempted nothing): once the cache's usage (`BlockPool.get_usage`: 1 - free / usable blocks)
        is at least the threshold, the requests among the first `window` waiting that never ran (status
        WAITING, no computed tokens: a preempted one keeps its place) are put, in their own places, in
        order of their cached prefix (`KVCacheManager.get_num_cached_tokens`: the admission's hit, at
        most num_tokens - 1 tokens), longest first, queue order breaking ties. Only under fcfs with
        prefix caching (sim/app/plan.py refuses the rest, which vLLM ignores)."""
        cfg = self.config
        block_manager = state.block_manager
        if 1.0 - block_manager.num_free_blocks / block_manager.num_blocks < cfg.cache_aware_admission_threshold:
            return
        waiting = state.waiting
        head = list(islice(waiting, cfg.cache_aware_admission_window))
        slots = [i for i, request in enumerate(head) if not request.num_preemptions and not request.num_computed_tokens]
        if len(slots) < 2:
            return
        cached = {i: len(block_manager.cached_prefix(head[i])) for i in slots}  # blocks: the same order as tokens
        order = sorted(slots, key=lambda i: (-cached[i], i))
        if order == slots:
            return
        reordered = list(head)
        for slot, source in zip(slots, order):
            reordered[slot] = head[source]
        for _ in head:
            waiting.popleft()  # type: ignore[union-attr]  # fcfs: a deque
        waiting.extendleft(reversed(reordered))  # type: ignore[union-attr]

    def _schedule_running_in_order(self, state: EngineState, batch: Batch, budget: int, threshold: int,
                                   defer: bool = False) -> int:
        """The running requests' tokens, in running order; returns the budget left. `defer`: a prefill
        chunk of a running request is skipped this step (the cadence holds it; decodes still run)."""
        running = state.running
        bm = state.block_manager
        priority = self.config.scheduling_policy == "priority"
        # The leading decodes (all of them, most steps) first, as the loop below would schedule
        # them but faster: _schedule_decodes takes their blocks in bulk, or one by one preempting
        # from the end of the running list as vLLM does. Under priority only when their blocks fit
        # (then nothing is preempted); else the loop does it all.
        num_leading = num_leading_decoding(running)
        i = 0
        if num_leading:
            decoders = running if num_leading == len(running) else running[:num_leading]
            bs = bm.block_size
            if not priority or bm.blocks_per_opening * sum(
                    len(r.block_table) * bs <= r.num_computed_tokens for r in decoders) <= bm.num_free_blocks:
                self._schedule_decodes(state, batch, decoders)
                i = len(batch.requests)  # the leading decodes still running, all scheduled
                budget -= i
        step = state.step_index
        while i < len(running) and budget > 0:
            request = running[i]
            if defer and not request.is_decoding:
                i += 1
                continue
            num_tokens = request.num_tokens - request.num_computed_tokens
            if 0 < threshold < num_tokens:
                num_tokens = threshold
            num_tokens = min(num_tokens, budget)
            while not bm.can_append(request, num_tokens):
                victim = self._running_victim(state, request, priority)
                num_scheduled = 0
                if victim.last_scheduled_step == step and victim is not request:
                    num_scheduled = batch.remove(victim)  # scheduled earlier in this step: taken back out
                    budget += num_scheduled
                if victim.status is Status.RUNNING and running.index(victim) < i:  # (not a finishing one)
                    i -= 1
                self._preempt(state, victim, num_scheduled)
                if victim is request:
                    break
            else:
                bm.append(request, num_tokens)
                self._add(state, batch, request, num_tokens, request.is_decoding)
                budget -= num_tokens
                i += 1
                continue
            if not priority:
                break  # everything after it was preempted first
            # Under priority the requests after it rank higher and may still fit; `i` is theirs now.
        return budget

    def _running_victim(self, state: EngineState, request: Request, priority: bool) -> Request:
        """vLLM's choice: the last running request (FCFS), or the one with the largest (priority,
        arrival) under priority (`victim_key`), a finishing one included (`_or_finishing`)."""
        running = state.running
        return self._or_finishing(state, max(running, key=victim_key) if priority else running[-1], priority)
