"""One serving engine (a replica): its step loop as a SimPy process.

Each turn of the loop is the same few calls, whatever the step:

    workload.deliver(now)                     # the requests that arrived by now join the queue
    batch = policy.schedule(state, now)       # which requests get how many tokens
    run   = plan(batch, now)                  # the steps to take from it: one, or a run of them
                                              #   (fast-forward plans; backend.execute prices)
    now   = apply(batch, run, now)            # every step's tokens, blocks, finishes, log rows

A `Run` (sim/fast_forward.py) is k >= 1 steps of the same running requests; a single step is a run
of one. Fast-forward only plans (a pure function of the engine's state, the workload's next
events and the backend's costs); `apply` is the one place that makes a step's effects, for a run
of any length, with exactly the answers of stepping one by one.

The engine takes its requests from a workload (sim/workload.py) at the start of each step and
sleeps on an event when it has nothing to do. There is one clock, SimPy's: each step or run moves
it to its end before the next is scheduled (`run` says how, at no event's cost where nothing else
is due meanwhile).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from itertools import accumulate
from struct import pack
from typing import Callable

import numpy as np
import simpy

from sim.admission import QueueLimits
from sim.backend import Backend, ChunkStepsBackend, DecodeRunBackend, StepResult
from sim.batch import Batch
from sim.block_manager import BlockManager
from sim.errors import ServesimError
from sim.fast_forward import FastForward, Run, single_step
from sim.request import Request, Status
from sim.state import EngineState
from sim.step_log import StepLog
from sim.workload import Workload


def delay_to(now: float, when: float) -> float:
    """A delay that moves the clock from `now` towards `when` without passing it. now + (when - now)
    can round either way; rounded down, one more (exact) step lands on `when`."""
    delay = when - now
    if now + delay > when:
        delay = math.nextafter(delay, 0.0)
    return delay


def _through_run(env: simpy.Environment, run):
    """Move SimPy's clock to the end of `run`, whose steps start at env.now, through timeouts that
    let every event due meanwhile happen in order: in one move where that lands exactly on the
    run's end, else step by step (their seconds one by one, as stepping would add them)."""
    end = run.ends[-1]
    if env.now + (end - env.now) == end:
        if end > env.now:
            yield env.timeout(end - env.now)
        return
    if run.first is not None:
        yield env.timeout(run.first.seconds)
    for seconds in (run.seconds if isinstance(run.seconds, list) else run.seconds.tolist()):
        yield env.timeout(seconds)


class TokenTimes:
    """Every emitted token's time, request after request, kept after the requests end: request r's
    tokens are at `offsets[i]:offsets[i] + r.max_tokens`, where i is r's place in `requests`.

    While a request is in the engine its token times are a list (`Request.token_times`); when it
    finishes they are stored here. Without a TokenTimes (a streamed replay) the list is dropped when
    the request ends, after the workload has heard of the end (`on_done`), so memory holds the token
    times of the requests in flight only."""

    def __init__(self, requests: list[Request]):
        self.requests = requests
        offsets = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum([r.max_tokens for r in requests], out=offsets[1:])
        self.offsets = offsets[:-1]
        self.times = np.full(int(offsets[-1]), np.nan)
        self._offset_of = dict(zip([r.index for r in requests], self.offsets.tolist()))

    def store(self, request: Request) -> None:
        """Keep a finished request's token times. Past a few dozen they are packed as C doubles by
        `struct` first (the same values, for about a third of the instructions numpy's own
        conversion of a list of floats takes; for a short list numpy's is the cheaper)."""
        start = self._offset_of[request.index]
        times: list[float] = request.token_times  # type: ignore[assignment]  # a finished request has its list
        n = len(times)
        self.times[start:start + n] = times if n < 32 else np.frombuffer(pack(f"{n}d", *times))

    def offset(self, request: Request) -> int:
        return self._offset_of[request.index]

    def of(self, request: Request) -> np.ndarray:
        start = self._offset_of[request.index]
        return self.times[start:start + request.max_tokens]


class SimResult:
    """What a run leaves: its steps and totals; with a TokenTimes, every request and token time too
    (a streamed replay keeps neither: its requests went to the workload's listener as they ended)."""

    def __init__(self, requests: list[Request] | None, token_times: TokenTimes | None, steps: StepLog, end_s: float,
                 num_preemptions: int, num_prefix_queried_tokens: int, num_prefix_hit_tokens: int):
        self.requests = requests  # in arrival order
        self.token_times = None if token_times is None else token_times.times  # request after request
        self.token_offsets = None if token_times is None else token_times.offsets  # requests[i]'s first token
        self.steps = steps
        self.end_s = end_s
        self.num_preemptions = num_preemptions
        self.num_prefix_queried_tokens = num_prefix_queried_tokens
        self.num_prefix_hit_tokens = num_prefix_hit_tokens

    def tokens_of(self, i: int) -> np.ndarray:
        """The token times of requests[i]."""
        start = int(self.token_offsets[i])  # type: ignore[index]  # an in-memory result has them
        return self.token_times[start:start + self.requests[i].max_tokens]  # type: ignore[index]


class Engine:
    workload: Workload  # what sends it requests (`attach`)
    # Whether this engine takes runs of more than one step (sim/fast_forward.py). An engine whose
    # `apply` does more after a step than the steps' effects (a prefill replica hands a request
    # off once it has its first token, sim/disagg.py) states False: its steps are applied one by one.
    plans_runs = True

    def __init__(self, policy, backend: Backend, block_manager: BlockManager, token_times: TokenTimes | None,
                 max_model_len: int, fast_forward: bool = True,
                 progress: Callable[[float, int], None] | None = None, steps: StepLog | None = None):
        self.policy = policy
        self.backend = backend
        self.block_manager = block_manager
        self.token_times = token_times
        self.max_model_len = max_model_len
        self._max_kv_tokens = block_manager.max_request_tokens()  # a request that needs KV for more never runs
        self.progress = progress
        self.state = EngineState(block_manager, priority=policy.config.scheduling_policy == "priority")
        self.steps = steps if steps is not None else StepLog()
        self.num_finished = 0
        # vLLM's API server's admission limits (--max-num-queued-reqs, --max-num-queued-tokens: sim/admission.py):
        # checked at `submit` unless a DP group checks them for all its ranks when it routes (`checks_admission`).
        self.queue_limits = QueueLimits.of(policy.config)
        self.checks_admission = True
        self.busy_until_s = 0.0  # when the step or run under way ends (a decode replica reads a prefill replica's)
        self.fast_forward: FastForward | None = None
        self._fold = False
        self._chunk_budget: int | None = None
        # The policy's promises (policies/base.py, Promises) are read only where runs could be taken.
        if (fast_forward and self.plans_runs and backend.supports_fast_forward and isinstance(backend, DecodeRunBackend)
                and not block_manager.slides_windows):  # (a run's blocks are handed out in one go)
            promises = policy.promises
            if promises.fast_forward:
                self.fast_forward = FastForward(self)
                # Fold a step that admits requests into the decode run after it (the second promise).
                self._fold = promises.decodes_all_when_none_waits
                # Take runs of steps that carry a prefill forward beside the decodes in one go
                # (chunk runs, sim/fast_forward.py): the third promise, for the steps its budget fills.
                if isinstance(backend, ChunkStepsBackend) and promises.repeats_full_chunk_steps:
                    self._chunk_budget = policy.chunk_run_budget()
        self._wake: simpy.Event | None = None  # what the engine waits on while idle
        # vLLM's AsyncScheduler with the engine core's batch queue (docs/async-scheduling.md): step n+1 is
        # scheduled when step n is launched, so it sees the arrivals up to step n's start (`_last_start`).
        self.asynchronous = bool(getattr(policy.config, "async_scheduling", False))
        self._last_start = 0.0  # the start of the last step taken
        self._in_flight = False  # a step was taken since the engine last slept or waited (asynchronously)
        if self.asynchronous:
            self._chunk_budget = None  # chunk runs deliver and free by the synchronous clock: stepped instead

    # Requests in.

    def attach(self, workload: Workload) -> None:
        """The workload that feeds this engine (sim/workload.py); each workload attaches itself."""
        self.workload = workload

    @property
    def is_idle(self) -> bool:
        """Asleep, and not yet woken."""
        return self._wake is not None and not self._wake.triggered

    def wake(self) -> simpy.Event:
        """Wake the idle engine; returns the event it waited on."""
        event = self._wake
        assert event is not None, "wake() of an engine that is not asleep"
        event.succeed()
        return event

    def submit(self, r: Request, after_outputs: bool = False) -> None:
        """A request arrives: it joins the waiting queue, or is rejected if vLLM's API server would
        answer it 503 (`queue_limits`, checked first, as vLLM's server checks admission before it
        renders the prompt) or it can never run (too long: not counted by the limits).
        `after_outputs`: a send that the outputs at its instant caused (a closed loop's), which sees
        them (sim/admission.py)."""
        limits = self.queue_limits if self.checks_admission else None
        reason = limits.check(r, after_outputs) if limits is not None else None
        if reason is None:
            reason = self.cannot_run(r)
            if reason is None and limits is not None:
                limits.count(r)
        if reason is None:
            self.state.waiting.append(r)
        else:
            self._reject(r, reason)

    def cannot_run(self, r: Request) -> str | None:
        """Why `r` can never run here (longer than --max-model-len, or than the whole KV cache), or None."""
        total = r.num_prompt_tokens + r.max_tokens
        if total > self.max_model_len:
            return f"prompt + output is {total} tokens, more than --max-model-len {self.max_model_len}"
        if total - 1 > self._max_kv_tokens:  # (its KV: every token but the last output one, `max_kv_tokens`)
            bm = self.block_manager
            return f"needs {bm.max_blocks_needed(r.max_kv_tokens)} KV blocks, the whole cache has {bm.num_blocks}"
        return None

    def _reject(self, r: Request, reason: str) -> None:
        r.status = Status.REJECTED
        r.reject_reason = reason
        self.workload.on_done(r, None)

    # The step loop.

    def run(self, env: simpy.Environment):
        """The engine's SimPy process: step while there is work, sleep while there is none, end
        when the workload has nothing more to send.

        One clock, SimPy's (`env.now`): each step or run moves it to its end before it is applied.
        Where the workload says that nothing else in the simulation acts while the engine is busy
        (`busy_engine_alone`: a lone engine's trace or closed loop, which hand over arrivals by
        time) and no event is due before the run ends (SimPy's queue), the clock is set to the end
        directly, as the run's timeout would set it once processed, without the event: a timeout
        per step or run costs 2.3% more instructions on the bundled sample's replay
        (docs/architecture.md). Otherwise (a cluster's replica, whose router reads it at each
        arrival) the run's timeouts move it, and every event due meanwhile happens in order. Either
        way the clock takes the same values: each step's end is its start plus its seconds, added
        in order."""
        state, workload, progress = self.state, self.workload, self.progress
        alone = workload.busy_engine_alone
        asynchronous = self.asynchronous
        while True:
            now = env._now  # (SimPy's clock, `env.now`, without the property's call on every turn)
            steps_before, num_preempted_before = state.step_index, state.num_preemptions
            freed = False
            batch = None
            if asynchronous and self._in_flight:
                # vLLM schedules this step when it launched the one before (its start), before that
                # step's output: arrivals since then wait a step more, and the requests that finished
                # in it still hold their seats and blocks (`EngineState.finishing`) while it is scheduled.
                freed = bool(state.finishing)
                batch = self._schedule_pipelined()
                if batch is None:  # nothing to launch beside the step in flight: once it ends, schedule anew
                    self._in_flight = False
            if batch is None:
                workload.deliver(now)
                if not state.has_work:
                    if workload.is_exhausted:
                        return
                    yield from self._sleep(env, None)
                    continue
                batch = self.policy.schedule(state, now)
                if not batch.requests:
                    if state.num_preemptions > num_preempted_before:
                        # It preempted the only requests past their prefill while the prefill cadence held the
                        # rest (chunked's --prefill-schedule-interval): vLLM's engine core runs the empty step
                        # (no model: the runner returns EMPTY_MODEL_RUNNER_OUTPUT) and schedules again at once
                        # (vllm/v1/engine/core.py, EngineCore.step), now with no decode to hold prefill for.
                        continue
                    yield from self._wait_for_policy(env, now)  # the policy holds its waiting requests back for now
                    continue
            # A step that frees blocks asynchronously is taken alone: the next may admit a waiting request, or
            # one the workload holds until a finish frees room (a decode replica's transferred requests).
            run = self.plan(batch, now, state.num_preemptions - num_preempted_before,
                            freed and (bool(state.waiting) or workload.reacts_to_finishes))
            ends = run.ends
            end = self.busy_until_s = ends[-1]
            queue = env._queue  # SimPy's events due, a heap of (time, priority, id, event) (simpy/core.py)
            if alone and (not queue or queue[0][0] >= end):
                env._now = end  # nothing is due before the run ends: its timeout would do just this
            else:
                yield from _through_run(env, run)
            if asynchronous:  # (read only by asynchronous scheduling)
                self._last_start = ends[-2] if len(ends) > 1 else now
                self._in_flight = True
            self.apply(batch, run, now)
            if progress is not None and (state.step_index >> 12) != (steps_before >> 12):
                progress(end, self.num_finished)

    def _schedule_pipelined(self) -> Batch | None:
        """Asynchronous scheduling of the step after the one in flight (vllm/v1/engine/core.py,
        step_with_batch_queue): from the arrivals up to that step's start, with the requests that finished in
        it still counted as running (skipped: `EngineState.finishing`); their blocks are freed after.
        None where it schedules nothing (vLLM queues an empty batch and schedules again once the step in
        flight's output is processed)."""
        state = self.state
        self.workload.deliver(self._last_start)
        batch = None
        if state.has_work:
            batch = self.schedule_beside_step(self._last_start)
        if state.finishing:
            self.free_finishing()
        return batch if batch is not None and batch.requests else None

    def schedule_beside_step(self, at: float) -> Batch:
        """The policy's schedule as of `at` while a step is in flight (vLLM's AsyncScheduler): the block
        manager is told, as a sliding window's cache does not count that step's tokens computed
        (sim/sliding_block_manager.py). The engine's and the DP lockstep's (sim/data_parallel.py)."""
        bm = self.block_manager
        bm.pipelined = True
        bm.step_in_flight = self.state.step_index - 1
        try:
            return self.policy.schedule(self.state, at)
        finally:
            bm.pipelined = False

    def _wait_for_policy(self, env: simpy.Environment, now: float):
        """The policy scheduled nothing though requests wait: sleep until its retry time or the next
        arrival, or fail where it broke its contract (`Policy.retry_s`)."""
        state = self.state
        retry_s = self.policy.retry_s(state, now)
        if state.running or (retry_s is None and self.workload.is_exhausted) or (retry_s is not None and retry_s <= now):
            # The policy broke its contract (a user's policy can; servesim's own are tested not to).
            raise ServesimError(
                f"policy {self.policy.name} scheduled nothing at t={now:.6f} s with {len(state.waiting)} waiting and "
                f"{len(state.running)} running, and asked to try again at {retry_s}: a policy must schedule a request "
                "while any runs, and otherwise give a retry time later than now, or None only while more requests "
                "will arrive (Policy.retry_s)")
        yield from self._sleep(env, retry_s)
        self._in_flight = False

    def plan(self, batch: Batch, now: float, num_preempted: int, alone: bool = False) -> Run:
        """The steps to take from `batch` (just scheduled, having preempted `num_preempted`): a run
        that fast-forward plans where the policy's promises allow one (and not `alone`), else the single step. The
        backend prices step 0 (`execute`) unless a decode run costs it with the others."""
        state, fast_forward = self.state, self.fast_forward
        result: StepResult | None = None
        n = len(batch.requests)
        if fast_forward is not None and not num_preempted and not alone and n == len(state.running):
            run = None
            # (The leading decodes are decodes that need logits: only the rest of the batch is read.)
            num_leading = batch.num_leading_decodes
            if num_leading == n or all(batch.is_decode[num_leading:]):
                run = fast_forward.plan(batch, now)
            elif (self._fold and not state.waiting and all(batch.needs_logits[num_leading:])
                  and batch.requests == state.running):
                # Every running request emits a token in this step and none waits: the steps
                # after it decode them all (the policy's promise), so one run may take both.
                result = self.backend.execute(batch)
                run = fast_forward.plan(batch, now, result)
            elif (self._chunk_budget is not None and not batch.needs_logits[-1]
                  and batch.needs_logits.count(False) == 1 and batch.requests == state.running):
                # Every running request but the last emits a token in this step, so decodes
                # after it; the last carries a prefill forward: where the decodes and that
                # prefill fill the budget, the steps after it repeat (the policy's promise).
                result = self.backend.execute(batch)
                run = fast_forward.plan_chunks(batch, now, result, self._chunk_budget)
            if run is not None:
                return run
        return single_step(now, self.backend.execute(batch) if result is None else result, num_preempted,
                           self.block_manager.num_used_blocks, len(state.waiting))

    def _sleep(self, env: simpy.Environment, until_s: float | None):
        """Sleep until the workload wakes the engine (an arrival), or until `until_s` if given."""
        self._wake = env.event()
        self.workload.engine_idle()
        if until_s is None:
            yield self._wake
        else:
            yield env.any_of([self._wake, env.timeout(delay_to(env.now, until_s))])
        self._wake = None

    # A run's effects.

    def apply(self, batch: Batch, run: Run, start: float) -> float:
        """Make every effect of the run's steps, from `start`, in the order stepping one by one
        makes them: the start of step 0 for the requests it is the first step of (TTFT in parts),
        each step's tokens (computed, emitted, sampled), the blocks its tokens open (through the
        block manager), the requests that finish in it, and its step-log row. Returns the run's end."""
        num_leading = batch.num_leading_decodes  # a request's first step is never one of its leading decodes
        if num_leading < len(batch.requests):
            for r in batch.requests[num_leading:]:
                if r.first_step_start_s is None:
                    r.first_step_start_s = start
        if len(run.ends) == 1:
            self._apply_step(batch, run, start)
        elif run.chunks is None:
            self._log_decode_run(batch, start, run.num_waiting, run, self._advance_decode_run(batch, run))
        else:
            self._apply_chunk_run(batch, start, run.num_waiting, run)
        return run.ends[-1]

    def _apply_step(self, batch: Batch, run: Run, start: float) -> None:
        """One step: its log row; computed tokens advance, a request that caught up emits a token
        (and a sampling backend's token is kept), finished requests free their blocks. The policy
        reserved the step's blocks when it scheduled it."""
        result: StepResult = run.first  # type: ignore[assignment]  # a single step is priced
        self.steps.append_step(batch, start, result, run.num_used_blocks, run.num_waiting, run.num_preempted)
        if self.asynchronous:  # which requests sample, for their blocks' caching (Request.cached_short_step)
            step = self.state.step_index
            for r, samples in zip(batch.requests, batch.needs_logits):
                if samples:
                    if r.last_sampled_step == step - 1:
                        r.cached_short_step = step
                    r.last_sampled_step = step
        now = run.ends[0]
        sampled = result.sampled_token_ids
        if sampled is not None:  # a sampling backend: each logits row's token to its request
            logits_row = 0
            for r, needs_logits in zip(batch.requests, batch.needs_logits):
                if needs_logits:
                    r.sampled_token_ids.append(int(sampled[logits_row]))
                    logits_row += 1
        finished = []
        requests, scheduled = batch.requests, batch.num_scheduled_tokens
        num_leading = batch.num_leading_decodes
        if num_leading:
            # The leading decodes computed the token each sampled last, so each emits one (and had
            # emitted one before): the loop below for them, without its tests.
            for r in requests[:num_leading]:
                r.num_computed_tokens += 1
                r.token_times.append(now)
                num_output = r.num_output_tokens + 1
                r.num_output_tokens = num_output
                if num_output == r.max_tokens:
                    finished.append(r)
            requests, scheduled = requests[num_leading:], scheduled[num_leading:]
        for r, num_tokens in zip(requests, scheduled):
            num_computed = r.num_computed_tokens + num_tokens
            r.num_computed_tokens = num_computed
            num_output = r.num_output_tokens
            if num_computed != r.num_prompt_tokens + num_output:
                continue  # a partial prefill chunk emits nothing
            if num_output:
                r.token_times.append(now)
            else:
                r.first_token_s = now
                r.token_times = [now]
            r.num_output_tokens = num_output + 1
            if num_output + 1 == r.max_tokens:
                finished.append(r)
        if finished:
            for r in finished:
                self.finish(r, now)
            self.state.running = [r for r in self.state.running if r.status is Status.RUNNING]
        if self.block_manager.slides_windows:  # sliding windows free the blocks they passed
            self.block_manager.slide(self.state.running)
        self.state.step_index += 1

    def _advance_decode_run(self, batch: Batch, run: Run) -> list[int]:
        """Apply a decode run's tokens, blocks and finishes; returns the blocks in use at each step."""
        ends_list = run.ends
        k = len(ends_list)
        reqs = batch.requests
        engine = self
        finishing = _emit_tokens(reqs, batch.num_scheduled_tokens, run.active_steps, ends_list,
                                 engine.state.step_index, engine.asynchronous)
        # Hand out new blocks and free finished requests' blocks in the order step-by-step
        # simulation would: each step's new blocks in batch order, then at its end the requests
        # that finished in it, in batch order (freed blocks are the next ones taken).
        bm = engine.block_manager
        used_before = bm.num_used_blocks  # step 0's blocks were reserved by the policy
        change = [0] * (k + 1)  # change[j]: blocks in use at step j less at step j - 1
        opens, taken, n = run.opens, 0, len(reqs)
        for o in opens:  # step * n + batch index, sorted
            change[o // n] += 1
        for last_step, i in finishing + [(k - 1, None)]:  # the last: the run's remaining blocks
            upto = bisect_left(opens, (last_step + 1) * n, taken)  # the blocks opened up to last_step
            if upto > taken:
                bm.grow_tables_at(reqs, opens[taken:upto], n)
                taken = upto
            if i is not None:
                before = bm.num_used_blocks
                engine.finish(reqs[i], ends_list[last_step])
                change[last_step + 1] -= before - bm.num_used_blocks  # freed at the end of its last step
        if finishing:
            engine.state.running = [r for r in engine.state.running if r.status is Status.RUNNING]
        engine.state.step_index += k
        used = list(accumulate(change[:k], initial=used_before))
        del used[0]
        return used

    def _log_decode_run(self, batch: Batch, now: float, num_waiting: int, run: Run, num_used_blocks: list[int]) -> None:
        """The step log's rows of a decode run: step 0's alone where `execute` priced it, then the
        decode steps in one go."""
        ends = run.ends
        k = len(ends)
        n = len(batch)
        num_running: int | np.ndarray = n
        if min(run.active_steps) < k:  # some finish before the last step
            num_running = n - np.searchsorted(sorted(run.active_steps), np.arange(k), side="right")
        steps = self.steps
        first = run.first
        if first is None:
            starts = [now]
            starts += ends[:-1]
        else:  # step 0 as a single step logs it, then the decode steps
            steps.append_step(batch, now, first, num_used_blocks[0], num_waiting, 0)
            starts = ends[:-1]
            if not isinstance(num_running, int):
                num_running = num_running[1:]
            num_used_blocks = num_used_blocks[1:]
            k -= 1
        steps.extend(k, {
            "start_s": starts, "seconds": run.seconds, "num_decode_tokens": num_running,
            "num_requests": num_running, "num_kv_blocks_used": num_used_blocks, "num_waiting": num_waiting,
        }, run.parts)  # no prefill tokens, no preemptions

    def _apply_chunk_run(self, batch: Batch, start: float, num_waiting: int, run: Run) -> None:
        """Apply and log a chunk run, doing what step-by-step simulation does in its order: before
        each step after the first, the arrivals up to its start join the queue, the decodes take
        the blocks they open, in batch order, then the prefill its chunk's (indexed as the policy
        indexes them); at the end of a step, the decodes that emitted their last token in it
        leave, in batch order, their blocks freed before the next step takes any."""
        engine = self
        state, bm, workload = engine.state, engine.block_manager, engine.workload
        waiting = state.waiting
        reqs = batch.requests
        n = len(reqs) - 1
        prefill = reqs[-1]
        ends, opens = run.ends, run.opens
        chunks: list[int] = run.chunks  # type: ignore[assignment]  # a chunk run has them
        k = len(ends)
        first_step = state.step_index
        # Step 0's row: the policy reserved its blocks.
        engine.steps.append_step(batch, start, run.first, run.num_used_blocks, num_waiting, 0)
        # The decodes' tokens, all of each one's steps at once (a finish, below, needs them all).
        finishing = _emit_tokens(reqs[:n], batch.num_scheduled_tokens, run.active_steps, ends, first_step)
        # The blocks of each step 1..: its decodes' opening blocks in batch order, then the
        # prefill's new ones.
        bs = bm.block_size
        num_table = len(prefill.block_table)
        computed = batch.num_computed_tokens[-1] + batch.num_scheduled_tokens[-1]  # the prefill's, before step 1
        counts = []  # per step 1..: (the decodes' new blocks, the prefill's)
        taken = 0
        for j in range(1, k):
            upto = bisect_left(opens, (j + 1) * n, taken) if n else 0
            computed += chunks[j - 1]
            new = -(-computed // bs) - num_table
            if new > 0:
                num_table += new
            else:
                new = 0
            counts.append((upto - taken, new))
            taken = upto
        # Where the workload cannot deliver by time, nothing arrived before the last step's start
        # (plan_chunks), and what arrived since is for the step after the run.
        by_time = workload.delivers_by_time  # (chunk runs are synchronous: asynchronously `_chunk_budget` is None)
        used, num_waiting_at = [], []  # steps 1..'s
        f, num_finishing = 0, len(finishing)
        while f < num_finishing and finishing[f][0] == 0:  # decodes that ended in step 0
            engine.finish(reqs[finishing[f][1]], ends[0])
            f += 1
        # Between two finishes, the steps' blocks are taken from the free queue in one go, in the
        # order above (nothing is freed meanwhile, so taking them step by step takes the same
        # blocks). The prefill's full blocks are indexed once, after the run: nobody looks the
        # index up meanwhile, and its blocks are held, so no eviction or free meets them (a block
        # indexed with the same key before is found first either way).
        taken = 0
        j = 1
        while j < k:
            end = finishing[f][0] + 1 if f < num_finishing else k  # steps j..end - 1
            owners: list[Request] = []  # who takes the stretch's blocks, in order, and how many each
            num_taken: list[int] = []
            used_now = bm.num_used_blocks  # before step j
            for step, (num_decode_blocks, new) in enumerate(counts[j - 1:end - 1], j):
                if by_time:  # it starts when the step before ends (no block moves)
                    workload.deliver(ends[step - 1])
                if num_decode_blocks:
                    owners += [reqs[o % n] for o in opens[taken:taken + num_decode_blocks]]
                    num_taken += [1] * num_decode_blocks
                    taken += num_decode_blocks
                if new:
                    owners.append(prefill)
                    num_taken.append(new)
                used_now += num_decode_blocks + new
                used.append(used_now)
                num_waiting_at.append(len(waiting))
            if owners:
                bm.grow_tables(owners, num_taken)
            while f < num_finishing and finishing[f][0] == end - 1:  # at the end of step end - 1
                engine.finish(reqs[finishing[f][1]], ends[end - 1])
                f += 1
            j = end
        prefill.num_computed_tokens = computed
        bm.index_full_blocks(prefill, computed)
        prefill.last_scheduled_step = first_step + k - 1
        run_decodes: list[int] = run.num_decodes  # type: ignore[assignment]  # a chunk run has them
        num_decodes: int | list[int] = run_decodes
        num_requests: int | list[int]
        logged_chunks: int | list[int] = chunks
        if run_decodes[-1] == n:  # none finished before the last step
            num_decodes, num_requests, logged_chunks = n, n + 1, chunks[0]
        else:
            num_requests = [d + 1 for d in run_decodes]
        engine.steps.extend(k - 1, {
            "start_s": ends[:-1], "seconds": run.seconds, "num_prefill_tokens": logged_chunks, "num_decode_tokens": num_decodes,
            "num_requests": num_requests, "num_kv_blocks_used": used, "num_waiting": num_waiting_at,
        }, run.parts)  # no preemptions
        if finishing:
            state.running = [r for r in state.running if r.status is Status.RUNNING]
        state.step_index += k


    def free_finishing(self) -> None:
        """Free the blocks of the requests that finished in the last step and were held while the
        next was scheduled (asynchronous scheduling: `EngineState.finishing`)."""
        for r in self.state.finishing:
            self.block_manager.release_finished(r)
        self.state.finishing = []

    def finish(self, r: Request, now: float) -> None:
        r.status = Status.FINISHED
        r.finish_s = now
        if self.asynchronous:  # its blocks are freed once the next step is scheduled (`run`)
            self.state.finishing.append(r)
        else:
            self.block_manager.release_finished(r)
        self.num_finished += 1
        if self.queue_limits is not None:
            self.queue_limits.finished(now)
        if self.token_times is not None:
            self.token_times.store(r)
        self.workload.on_done(r, now)
        r.token_times = None


def _emit_tokens(reqs: list, scheduled: list[int], active_steps: list[int], ends: list[float],
                 first_step: int, asynchronous: bool = False) -> list[tuple[int, int]]:
    """Apply a run's tokens to its requests: in step 0 each computes its `scheduled` tokens (all it
    had left: a decode's one, or a prompt's last chunk), in each later step one more, and it emits
    a token at the end of each of the `active_steps` it takes part in (`ends`: each step's end;
    step 0 of the run is engine step `first_step`). Returns (its last step, index) of the
    requests that emitted their last token, sorted: they finish then. `asynchronous`: each
    request's sampled steps are kept (Request.last_sampled_step, cached_short_step)."""
    k = len(ends)
    finishing = []
    before_first = first_step - 1
    for i, (r, q, num) in enumerate(zip(reqs, scheduled, active_steps)):
        num_output = r.num_output_tokens
        if num_output:
            r.token_times.extend(ends if num == k else ends[:num])
        else:  # its prompt ended in step 0: its first token
            r.first_token_s = ends[0]
            r.token_times = ends[:num]
        r.num_computed_tokens += q + num - 1
        num_output += num
        r.num_output_tokens = num_output
        last = before_first + num
        r.last_scheduled_step = last
        if asynchronous:  # it sampled in each of its steps, so in the one before its last if it took two
            if num > 1 or r.last_sampled_step == before_first:
                r.cached_short_step = last
            r.last_sampled_step = last
        if num_output == r.max_tokens:
            finishing.append((num - 1, i))
    finishing.sort()
    return finishing
