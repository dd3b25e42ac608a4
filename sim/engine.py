"""One serving engine (a replica): its step loop as a SimPy process.

Each step is three calls, as in every engine this field holds up as a model:

    batch  = policy.schedule(state, now)      # which requests get how many tokens
    result = backend.execute(batch)           # how long the step takes
    advance(batch, result, now + seconds)     # computed tokens, emitted tokens, finishes

The engine takes its requests from a workload (`sim/arrivals.py`) at the start of each step and
sleeps on an event when it has nothing to do. It keeps its own clock through a busy period where
nothing else in the simulation acts meanwhile (a lone engine), and SimPy's otherwise (`run`).
When the policy and the backend both allow it, runs of identical decode-only steps are costed in
one call instead (`sim/fast_forward.py`), with exactly the answers of stepping one by one; such a
run may begin with the step that admitted a request (a folded run), priced by `execute` before the
run is planned. So may a run of steps that each decode the same requests and carry one long
prompt's prefill forward by a chunk (a chunk run), from the step before them (the one that ends a
prompt and begins the next, say).
"""

from __future__ import annotations

import math
from struct import pack
from typing import Callable

import numpy as np
import simpy

from sim.backend import Backend, ChunkStepsBackend, DecodeRunBackend
from sim.batch import Batch
from sim.block_manager import BlockManager
from sim.fast_forward import ChunkRun, DecodeRun, FastForward
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


def _catch_up(env: simpy.Environment, now: float, run=None):
    """Bring SimPy's clock to `now`, the engine's: in one move where it lands exactly there, else
    as the steps of `run` add up to it (their seconds one by one, as stepping would), or without a
    run in moves that never pass it (`delay_to`)."""
    if env.now + (now - env.now) == now:
        if now > env.now:
            yield env.timeout(now - env.now)
        return
    if run is not None:
        if run.first is not None:
            yield env.timeout(run.first.seconds)
        for seconds in (run.seconds if isinstance(run.seconds, list) else run.seconds.tolist()):
            yield env.timeout(seconds)
        return
    while env.now < now:
        yield env.timeout(delay_to(env.now, now))


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

    # Whether a run of decode steps may begin with the step that admitted a request (a folded run,
    # sim/fast_forward.py), applied by the run instead of `advance` and logged by it instead of
    # `_log_step`: a subclass that overrides either loses it.
    folds_admitting_steps = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if "folds_admitting_steps" not in own and ("advance" in own or "_log_step" in own):
            cls.folds_admitting_steps = False

    def __init__(self, policy, backend: Backend, block_manager: BlockManager, token_times: TokenTimes | None,
                 max_model_len: int, fast_forward: bool = True,
                 progress: Callable[[float, int], None] | None = None, steps: StepLog | None = None):
        self.policy = policy
        self.backend = backend
        self.block_manager = block_manager
        self.token_times = token_times
        self.max_model_len = max_model_len
        self.progress = progress
        self.state = EngineState(block_manager, priority=policy.config.scheduling_policy == "priority")
        self.steps = steps if steps is not None else StepLog()
        self.num_finished = 0
        self.fast_forward: FastForward | None = None
        promises = policy.promises  # policies/base.py, Promises
        if fast_forward and backend.supports_fast_forward and promises.fast_forward and isinstance(backend, DecodeRunBackend):
            self.fast_forward = FastForward(self)
        # Fold a step that admits requests into the decode run after it (the policy's second promise).
        self._fold = (self.fast_forward is not None and self.folds_admitting_steps
                      and promises.decodes_all_when_none_waits)
        # Take runs of steps that carry a prefill forward beside the decodes in one go (chunk runs,
        # sim/fast_forward.py): the policy's third promise, for the steps its budget fills.
        self._chunk_budget = None
        if (self.fast_forward is not None and self.folds_admitting_steps and isinstance(backend, ChunkStepsBackend)
                and promises.repeats_full_chunk_steps):
            self._chunk_budget = policy.chunk_run_budget()
        self._wake: simpy.Event | None = None  # what the engine waits on while idle

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

    def submit(self, r: Request) -> None:
        """A request arrives: it joins the waiting queue, or is rejected if it can never run."""
        bm = self.block_manager
        total = r.num_prompt_tokens + r.max_tokens
        if total > self.max_model_len:
            self._reject(r, f"prompt + output is {total} tokens, more than --max-model-len {self.max_model_len}")
        elif bm.blocks_for(r.max_kv_tokens) > bm.num_blocks:
            self._reject(r, f"needs {bm.blocks_for(r.max_kv_tokens)} KV blocks, the whole cache has {bm.num_blocks}")
        else:
            self.state.waiting.append(r)

    def _reject(self, r: Request, reason: str) -> None:
        r.status = Status.REJECTED
        r.reject_reason = reason
        self.workload.on_done(r, None)

    # The step loop.

    def run(self, env: simpy.Environment):
        """The engine's SimPy process: step while there is work, sleep while there is none, end
        when the workload has nothing more to send.

        The engine keeps the time of its next step itself (`now`). Where the workload says that
        nothing else in the simulation acts while the engine is busy (`busy_engine_alone`: a lone
        engine's trace or closed loop, which hand over arrivals by time), SimPy's clock is brought
        to it only when the engine sleeps or ends: a busy period costs no events. Elsewhere (a
        cluster's replica, whose router reads it) each step or run moves SimPy's clock as it goes.
        Either way the clock takes the same values: each step's end is its start plus its seconds,
        added in order."""
        state, workload = self.state, self.workload
        alone = workload.busy_engine_alone
        now = env.now
        while True:
            workload.deliver(now)
            if not state.has_work:
                yield from _catch_up(env, now)
                if workload.is_exhausted:
                    return
                yield from self._sleep(env, None)
                now = env.now
                continue
            steps_before = state.step_index
            num_preempted_before = state.num_preemptions
            batch = self.policy.schedule(state, now)
            if not batch.requests:  # the policy holds its waiting requests back for now
                retry_s = self.policy.retry_s(state, now)
                if state.running or (retry_s is None and workload.is_exhausted) or (
                        retry_s is not None and retry_s <= now):
                    raise RuntimeError(
                        f"internal error: policy {self.policy.name} scheduled nothing at t={now:.6f}s "
                        f"with {len(state.waiting)} waiting and {len(state.running)} running, "
                        f"and asks to try again at {retry_s}")
                yield from _catch_up(env, now)
                yield from self._sleep(env, retry_s)
                now = env.now
                continue
            num_preempted = state.num_preemptions - num_preempted_before
            run: DecodeRun | ChunkRun | None = None
            result = None
            if self.fast_forward is not None and not num_preempted and len(batch) == len(state.running):
                if all(batch.is_decode):
                    run = self.fast_forward.plan(batch, now)
                elif self._fold and not state.waiting and all(batch.needs_logits) and batch.requests == state.running:
                    # Every running request emits a token in this step and none waits: the steps
                    # after it decode them all (the policy's promise), so one run may take both.
                    result = self.backend.execute(batch)
                    run = self.fast_forward.plan(batch, now, result)
                elif (self._chunk_budget is not None and not batch.needs_logits[-1]
                      and batch.needs_logits.count(False) == 1 and batch.requests == state.running):
                    # Every running request but the last emits a token in this step, so decodes
                    # after it; the last carries a prefill forward: where the decodes and that
                    # prefill fill the budget, the steps after it repeat (the policy's promise).
                    result = self.backend.execute(batch)
                    run = self.fast_forward.plan_chunks(batch, now, result, self._chunk_budget)
            if run is not None:
                if not alone:
                    yield from _catch_up(env, run.ends[-1], run)
                now = self.fast_forward.apply(batch, now, run)  # type: ignore[union-attr]  # it planned the run
            else:
                start = now
                if result is None:
                    result = self.backend.execute(batch)
                self._log_step(batch, start, result, num_preempted)
                now = start + result.seconds
                if not alone:
                    yield env.timeout(result.seconds)
                self.advance(batch, result, now)
                state.step_index += 1
            if self.progress is not None and (state.step_index >> 12) != (steps_before >> 12):
                self.progress(now, self.num_finished)

    def _sleep(self, env: simpy.Environment, until_s: float | None):
        """Sleep until the workload wakes the engine (an arrival), or until `until_s` if given."""
        self._wake = env.event()
        self.workload.engine_idle()
        if until_s is None:
            yield self._wake
        else:
            yield env.any_of([self._wake, env.timeout(delay_to(env.now, until_s))])
        self._wake = None

    def _log_step(self, batch: Batch, start: float, result, num_preempted: int) -> None:
        self.steps.append_step(batch, start, result, self.block_manager.num_used_blocks, len(self.state.waiting),
                               num_preempted)

    def advance(self, batch: Batch, result, now: float) -> None:
        """After a step: advance computed tokens; a request that caught up emits a token; finished
        requests free their blocks."""
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
        self._finish_all(finished, now)

    def _finish_all(self, finished: list[Request], now: float) -> None:
        for r in finished:
            self.finish(r, now)
        if finished:
            self.state.running = [r for r in self.state.running if r.status is Status.RUNNING]

    def finish(self, r: Request, now: float) -> None:
        r.status = Status.FINISHED
        r.finish_s = now
        self.block_manager.free(r)
        r.drop_block_hashes()
        self.num_finished += 1
        if self.token_times is not None:
            self.token_times.store(r)
        self.workload.on_done(r, now)
        r.token_times = None
