"""The discrete-event core: one SimPy environment, an arrivals process and an engine process.

Each engine step is three calls:

    batch  = policy.schedule(state, now)
    result = backend.execute(batch)
    yield env.timeout(result.seconds)
    postprocess(batch, result, env.now)

The engine sleeps on an event when it has nothing to do; the arrivals process wakes it.

Fast-forward. Most steps of a long replay are decode-only steps of the same requests. Once the
policy has scheduled such a step (every running request decodes, nothing was preempted), the
steps that follow are the same batch with every context one token longer, for as long as:

- no request arrives (a step starting at or after the next arrival is scheduled normally),
- the free blocks cover the blocks the contexts grow into (taken in the order step-by-step
  scheduling would take them; blocks that finishing requests free are not counted on),
- no request finishes, unless its freed slot and blocks could not let a waiting request in
  (`Policy.finish_may_admit`): then the others decode on without it.

Meanwhile no policy admits a waiting request: the head of the queue was refused for
max_num_seqs, blocks, budget or, under decode-first, the running batch, and none of these
improves. So the engine costs the whole run in one call (`backend.decode_run`) and advances the
clock once. The answers are exactly those of step-by-step simulation (`fast_forward=False`);
tests check it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import simpy

from policies.base import Policy
from sim.batch import Batch
from sim.block_manager import BlockManager
from sim.request import Request, Status
from sim.state import EngineState

STEP_COLUMNS = ("start_s", "seconds", "num_prefill_tokens", "num_decode_tokens", "num_requests",
                "num_kv_blocks_used", "num_waiting", "num_preemptions")
MAX_RUN_STEPS = 4096  # bounds the arrays of one run


def _delay_to(now: float, when: float) -> float:
    """A delay that moves the clock from `now` towards `when` without passing it. now + (when - now)
    can round either way; rounded down, one more (exact) step lands on `when`."""
    delay = when - now
    if now + delay > when:
        delay = float(np.nextafter(delay, 0.0))
    return delay


class StepLog:
    """Per-step columns in growable numpy arrays: a single step writes one row, a run of steps a
    slice (a scalar fills the slice). The breakdown keys are the backend's own."""

    def __init__(self) -> None:
        self._capacity = 1024
        self._num_steps = 0
        self._columns: dict[str, np.ndarray] = {
            name: np.zeros(self._capacity, dtype=np.float64 if name in ("start_s", "seconds") else np.int32)
            for name in STEP_COLUMNS}  # counts fit in int32; millions of steps stay small
        self._breakdown: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self._num_steps

    def _reserve(self, num_rows: int) -> None:
        needed = self._num_steps + num_rows
        if needed <= self._capacity:
            return
        while self._capacity < needed:
            self._capacity += self._capacity // 2
        for table in (self._columns, self._breakdown):
            for name, values in table.items():
                grown = np.zeros(self._capacity, dtype=values.dtype)
                grown[:self._num_steps] = values[:self._num_steps]
                table[name] = grown

    def _write(self, table: dict[str, np.ndarray], name: str, start: int, end: int, value) -> None:
        column = table.get(name)
        if column is None:  # a breakdown key seen for the first time
            column = table[name] = np.full(self._capacity, np.nan)
        column[start:end] = value

    def append(self, row: tuple, breakdown: dict[str, float]) -> None:
        """Write one step: `row` in STEP_COLUMNS order."""
        i = self._num_steps
        if i == self._capacity:
            self._reserve(1)
        for column, value in zip(self._columns.values(), row):
            column[i] = value
        for key, value in breakdown.items():
            column = self._breakdown.get(key)
            if column is None:
                self._write(self._breakdown, key, i, i + 1, value)
            else:
                column[i] = value
        self._num_steps = i + 1

    def extend(self, num_rows: int, columns: dict, breakdown: dict) -> None:
        """Write `num_rows` steps; each value is a scalar (the same for every row) or an array. A
        column left out stays 0."""
        start = self._num_steps
        end = start + num_rows
        if end > self._capacity:
            self._reserve(num_rows)
        table = self._columns
        for name, value in columns.items():
            table[name][start:end] = value
        table = self._breakdown
        for key, value in breakdown.items():
            column = table.get(key)
            if column is None:
                self._write(table, key, start, end, value)
            else:
                column[start:end] = value
        self._num_steps = end

    def columns(self) -> dict[str, np.ndarray]:
        """Every column (the breakdown keys too) as one array of length len(self)."""
        n = self._num_steps
        out = {name: values[:n] for name, values in self._columns.items()}
        out.update({key: values[:n] for key, values in self._breakdown.items()})
        return out

    @property
    def breakdown_keys(self) -> list[str]:
        return list(self._breakdown)

    def __getattr__(self, name: str) -> np.ndarray:
        if name in STEP_COLUMNS:
            return self._columns[name][:self._num_steps]
        raise AttributeError(name)


class DecodeRun(NamedTuple):
    """A planned run of decode-only steps (see the module docstring)."""

    ends: np.ndarray  # [steps] end time of each step
    seconds: np.ndarray  # [steps]
    parts: dict  # the backend's breakdown: per key a float (every step) or a [steps] array
    opens: list[tuple[int, int]]  # (step, batch index) of each block opened, in the order taken
    active_steps: list[int]  # per request, the steps it takes part in (it finishes in the last, or runs on)


class SimResult:
    def __init__(self, requests: list[Request], token_times: np.ndarray, steps: StepLog, end_s: float,
                 num_preemptions: int, num_prefix_queried_tokens: int, num_prefix_hit_tokens: int):
        self.requests = requests
        self.token_times = token_times  # every emitted token's time; request r's at [r.token_offset, + output)
        self.steps = steps
        self.end_s = end_s
        self.num_preemptions = num_preemptions
        self.num_prefix_queried_tokens = num_prefix_queried_tokens
        self.num_prefix_hit_tokens = num_prefix_hit_tokens


class Engine:
    def __init__(self, requests: list[Request], policy: Policy, backend, block_manager: BlockManager,
                 max_model_len: int, progress: Callable[[float, int, int], None] | None = None,
                 fast_forward: bool = True):
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        self.policy = policy
        self.backend = backend
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.progress = progress
        self.fast_forward = fast_forward and getattr(backend, "supports_fast_forward", False)
        self.state = EngineState(block_manager)
        self.steps = StepLog()
        offsets = np.zeros(len(self.requests) + 1, dtype=np.int64)
        np.cumsum([r.max_tokens for r in self.requests], out=offsets[1:])
        for r, offset in zip(self.requests, offsets[:-1].tolist()):
            r.token_offset = offset
        self.token_times = np.full(int(offsets[-1]), np.nan)
        self.num_finished = 0
        self._next_arrival = 0  # index into self.requests of the next request to arrive
        self._wake: simpy.Event | None = None  # what the engine waits on while idle
        self._engine_idle: simpy.Event | None = None  # what the arrivals process waits on meanwhile
        self._last_decode_step_s = 0.0  # sizes the next decode run

    def run(self) -> SimResult:
        env = simpy.Environment()
        self._engine_idle = env.event()
        env.process(self._arrivals(env))
        env.run(until=env.process(self._engine(env)))
        bm = self.block_manager
        return SimResult(self.requests, self.token_times, self.steps, env.now, self.state.num_preemptions,
                         bm.num_queried_tokens, bm.num_hit_tokens)

    # Arrivals.

    def _arrivals(self, env: simpy.Environment):
        """Wake the engine when it is idle and the next request arrives. A busy engine takes the
        requests that arrived by each step's start itself, so this sleeps while it is busy."""
        requests = self.requests
        while self._next_arrival < len(requests):
            if self._wake is None:  # the engine is busy
                self._engine_idle = env.event()
                yield self._engine_idle
                continue
            arrival_s = requests[self._next_arrival].arrival_s
            while arrival_s > env.now:
                yield env.timeout(_delay_to(env.now, arrival_s))
            self._wake.succeed()
            yield self._wake  # let the engine take the request before looking again

    def _admit_arrivals(self, now: float) -> None:
        """Move every request that has arrived by `now` into the waiting queue (or reject it)."""
        requests, bm = self.requests, self.block_manager
        while self._next_arrival < len(requests) and requests[self._next_arrival].arrival_s <= now:
            r = requests[self._next_arrival]
            self._next_arrival += 1
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

    # The engine loop.

    def _engine(self, env: simpy.Environment):
        state = self.state
        num_requests = len(self.requests)
        while True:
            self._admit_arrivals(env.now)
            if not state.has_work:
                if self._next_arrival == num_requests:
                    return
                self._wake = env.event()
                if not self._engine_idle.triggered:
                    self._engine_idle.succeed()
                yield self._wake
                self._wake = None
                continue
            num_preempted_before = state.num_preemptions
            batch = self.policy.schedule(state, env.now)
            if not batch.requests:
                raise RuntimeError(
                    f"internal error: policy {self.policy.name} scheduled nothing at t={env.now:.6f}s "
                    f"with {len(state.waiting)} waiting and {len(state.running)} running")
            num_preempted = state.num_preemptions - num_preempted_before
            steps_before = state.step_index
            run = None
            if (self.fast_forward and not num_preempted and len(batch) == len(state.running)
                    and all(batch.is_decode)):
                run = self._plan_decode_run(batch, env.now)
            if run is not None:
                ends = run.ends
                start, num_waiting = env.now, len(state.waiting)
                end = float(ends[-1])
                if env.now + (end - env.now) == end:
                    yield env.timeout(end - env.now)
                else:  # the clock cannot land exactly on `end` in one move: add the steps one by one
                    for seconds in run.seconds.tolist():
                        yield env.timeout(seconds)
                self._log_run(batch, start, num_waiting, run, self._postprocess_run(batch, run))
            else:
                start = env.now
                result = self.backend.execute(batch)
                self._log_step(batch, start, result, num_preempted)
                yield env.timeout(result.seconds)
                self._postprocess(batch, result, env.now)
                state.step_index += 1
            if self.progress is not None and (state.step_index >> 12) != (steps_before >> 12):
                self.progress(env.now, self.num_finished, num_requests)

    def _log_step(self, batch: Batch, start: float, result, num_preempted: int) -> None:
        num_decode = batch.num_decode_tokens
        self.steps.append(
            (start, result.seconds, batch.num_tokens - num_decode, num_decode, len(batch),
             self.block_manager.num_used_blocks, len(self.state.waiting), num_preempted),
            result.breakdown)

    def _postprocess(self, batch: Batch, result, now: float) -> None:
        """Advance computed tokens; a request that caught up emits a token; finished ones free blocks."""
        sampled = result.sampled_token_ids
        logits_row = 0
        emitted = []  # indices into token_times of the tokens emitted now
        finished = []
        for r, num_tokens, needs_logits in zip(batch.requests, batch.num_scheduled_tokens, batch.needs_logits):
            if needs_logits and sampled is not None:
                r.sampled_token_ids.append(int(sampled[logits_row]))
                logits_row += 1
            num_computed = r.num_computed_tokens + num_tokens
            r.num_computed_tokens = num_computed
            num_generated = r.num_output_tokens
            if num_computed != r.num_prompt_tokens + num_generated:
                continue  # a partial prefill chunk emits nothing
            emitted.append(r.token_offset + num_generated)
            if not num_generated:
                r.first_token_s = now
            r.num_output_tokens = num_generated + 1
            if num_generated + 1 == r.max_tokens:
                finished.append(r)
        self.token_times[emitted] = now
        for r in finished:
            self._finish(r, now)
        if finished:
            self.state.running = [r for r in self.state.running if r.status is Status.RUNNING]

    def _finish(self, r: Request, now: float) -> None:
        r.status = Status.FINISHED
        r.finish_s = now
        self.block_manager.free(r)
        r.drop_block_hashes()
        self.num_finished += 1

    # Fast-forward over runs of decode-only steps.

    def _plan_decode_run(self, batch: Batch, now: float) -> DecodeRun | None:
        """The run of decode steps starting with `batch` (already scheduled), or None when it
        would be a single step."""
        reqs = batch.requests
        num_computed = batch.num_computed_tokens
        remaining = [r.max_tokens - r.num_output_tokens for r in reqs]
        # Past a finish the same requests keep decoding unless the freed slot or blocks could let
        # a waiting request in.
        through_finishes = not self.policy.finish_may_admit(self.state)
        max_steps = min(max(remaining) if through_finishes else min(remaining), MAX_RUN_STEPS)
        next_arrival = (self.requests[self._next_arrival].arrival_s
                        if self._next_arrival < len(self.requests) else np.inf)
        if next_arrival < np.inf and self._last_decode_step_s:
            # Cost only about as many steps as fit before the next arrival, judging by the last
            # decode step's length (a guess: a short one merely ends this run early).
            max_steps = min(max_steps, int(1.25 * (next_arrival - now) / self._last_decode_step_s) + 2)
        if max_steps < 2:
            return None

        contexts = [c + 1 for c in num_computed]
        seconds, parts = self.backend.decode_run(contexts, max_steps, remaining)
        self._last_decode_step_s = float(seconds[-1])
        # The clock adds the steps one after another, as step-by-step simulation does.
        ends = np.empty(max_steps + 1)
        ends[0] = now
        ends[1:] = seconds
        ends = ends.cumsum()[1:]
        # A step starting at or after the next arrival is scheduled normally.
        num_steps = min(max_steps, 1 + int(ends[:-1].searchsorted(next_arrival, side="left")))
        if num_steps < 2:
            return None

        # Blocks: step j >= 1 computes position num_computed + j, which opens a block when it is a
        # multiple of the block size; step 0's blocks were reserved by the policy. Blocks that
        # finishing requests free are not counted on, so the run never preempts.
        bs = self.block_manager.block_size
        opens = []  # (step, batch index) of every block opened, in the order they are taken
        for i, (c, rem) in enumerate(zip(num_computed, remaining)):
            for j in range(-c % bs or bs, min(num_steps, rem), bs):
                opens.append((j, i))
        opens.sort()
        free = self.block_manager.num_free_blocks
        if len(opens) > free:
            num_steps = opens[free][0]  # the step that would need one block too many
            if num_steps < 2:
                return None
            opens = [o for o in opens[:free] if o[0] < num_steps]
        if num_steps < max_steps:
            ends, seconds = ends[:num_steps], seconds[:num_steps]
            parts = {k: v[:num_steps] if isinstance(v, np.ndarray) else v for k, v in parts.items()}
        return DecodeRun(ends, seconds, parts, opens, [min(rem, num_steps) for rem in remaining])

    def _log_run(self, batch: Batch, now: float, num_waiting: int, run: DecodeRun,
                 num_used_blocks: np.ndarray) -> None:
        k = len(run.seconds)
        starts = np.empty(k)
        starts[0] = now
        starts[1:] = run.ends[:-1]
        n = len(batch)
        num_running = n
        if min(run.active_steps) < k:  # some finish before the last step
            num_running = n - np.searchsorted(sorted(run.active_steps), np.arange(k), side="right")
        self.steps.extend(k, {
            "start_s": starts, "seconds": run.seconds, "num_decode_tokens": num_running,
            "num_requests": num_running, "num_kv_blocks_used": num_used_blocks, "num_waiting": num_waiting,
        }, run.parts)  # no prefill tokens, no preemptions

    def _postprocess_run(self, batch: Batch, run: DecodeRun) -> np.ndarray:
        """Apply the run's tokens, blocks and finishes; returns the blocks in use at each step."""
        ends, k = run.ends, len(run.ends)
        reqs = batch.requests
        times = self.token_times
        finishing = []
        for i, (r, num) in enumerate(zip(reqs, run.active_steps)):
            start = r.token_offset + r.num_output_tokens
            times[start:start + num] = ends[:num]
            r.num_computed_tokens += num
            r.num_output_tokens += num
            if r.num_output_tokens == r.max_tokens:
                finishing.append((num - 1, i))
        # Hand out new blocks and free finished requests' blocks in the order step-by-step
        # simulation would: each step's new blocks in batch order, then at its end the requests
        # that finished in it, in batch order (freed blocks are the next ones taken).
        bm = self.block_manager
        used = np.full(k, bm.num_used_blocks, dtype=np.int64)  # step 0's blocks were reserved by the policy
        if run.opens:
            used += np.bincount([j for j, _ in run.opens], minlength=k).cumsum()
        freed = np.zeros(k + 1, dtype=np.int64)  # freed[j + 1]: blocks freed at the end of step j
        opens, taken = run.opens, 0
        for last_step, i in sorted(finishing) + [(k - 1, None)]:  # the last: the run's remaining blocks
            upto = taken
            while upto < len(opens) and opens[upto][0] <= last_step:
                upto += 1
            if upto > taken:
                for (_, j), block in zip(opens[taken:upto], bm.pop_free_blocks(upto - taken)):
                    reqs[j].block_table.append(block)
                taken = upto
            if i is not None:
                before = bm.num_used_blocks
                self._finish(reqs[i], float(ends[last_step]))
                freed[last_step + 1] += before - bm.num_used_blocks
        if finishing:
            used -= freed[:k].cumsum()
            self.state.running = [r for r in self.state.running if r.status is Status.RUNNING]
        self.state.step_index += k
        return used
