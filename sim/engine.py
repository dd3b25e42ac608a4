"""The discrete-event core: one SimPy environment, an arrivals process and an engine process.

Each engine step is three calls:

    batch  = policy.schedule(state, now)
    result = backend.execute(batch)
    yield env.timeout(result.seconds)
    postprocess(batch, result, env.now)

The engine sleeps on an event when it has nothing to do; the arrivals process wakes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import simpy

from policies.base import Policy
from sim.batch import Batch
from sim.block_manager import BlockManager
from sim.request import Request, Status
from sim.state import EngineState


@dataclass
class StepLog:
    """Per-step columns, appended as plain lists and turned into a table at the end."""

    start_s: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    num_prefill_tokens: list[int] = field(default_factory=list)
    num_decode_tokens: list[int] = field(default_factory=list)
    num_requests: list[int] = field(default_factory=list)
    num_kv_blocks_used: list[int] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    num_preemptions: list[int] = field(default_factory=list)  # preemptions made while scheduling it
    breakdown: dict[str, list[float]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.seconds)


@dataclass
class SimResult:
    requests: list[Request]
    token_times: np.ndarray  # every emitted token's time; request r's are at [r.token_offset, + output)
    steps: StepLog
    end_s: float
    num_preemptions: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int


class Engine:
    def __init__(self, requests: list[Request], policy: Policy, backend, block_manager: BlockManager,
                 max_model_len: int, progress: Callable[[float, int, int], None] | None = None):
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        self.policy = policy
        self.backend = backend
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.progress = progress
        self.state = EngineState(block_manager)
        self.steps = StepLog()
        offsets = np.zeros(len(self.requests) + 1, dtype=np.int64)
        np.cumsum([r.num_output_tokens for r in self.requests], out=offsets[1:])
        for r, offset in zip(self.requests, offsets[:-1].tolist()):
            r.token_offset = offset
        self.token_times = np.full(int(offsets[-1]), np.nan)
        self.num_finished = 0
        self._next_arrival = 0  # index into self.requests of the next request to arrive
        self._wake: simpy.Event | None = None

    def run(self) -> SimResult:
        env = simpy.Environment()
        env.process(self._arrivals(env))
        env.run(until=env.process(self._engine(env)))
        bm = self.block_manager
        return SimResult(self.requests, self.token_times, self.steps, env.now, self.state.num_preemptions,
                         bm.num_queried_tokens, bm.num_hit_tokens)

    # Arrivals.

    def _arrivals(self, env: simpy.Environment):
        for r in self.requests:
            # now + (arrival - now) can round below arrival; a second, exact, step lands on it.
            while r.arrival_s > env.now:
                yield env.timeout(r.arrival_s - env.now)
            self._admit_arrivals(env.now)
            if self._wake is not None and not self._wake.triggered:
                self._wake.succeed()

    def _admit_arrivals(self, now: float) -> None:
        """Move every request that has arrived by `now` into the waiting queue (or reject it)."""
        requests, bm = self.requests, self.block_manager
        while self._next_arrival < len(requests) and requests[self._next_arrival].arrival_s <= now:
            r = requests[self._next_arrival]
            self._next_arrival += 1
            total = r.num_prompt_tokens + r.num_output_tokens
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
                yield self._wake
                self._wake = None
                continue
            num_preempted_before = state.num_preemptions
            batch = self.policy.schedule(state, env.now)
            if not batch.request_ids:
                raise RuntimeError(
                    f"internal error: policy {self.policy.name} scheduled nothing at t={env.now:.6f}s "
                    f"with {len(state.waiting)} waiting and {len(state.running)} running")
            start = env.now
            result = self.backend.execute(batch)
            self._log_step(batch, start, result, state.num_preemptions - num_preempted_before)
            yield env.timeout(result.seconds)
            self._postprocess(batch, result, env.now)
            state.step_index += 1
            if self.progress is not None and state.step_index % 4096 == 0:
                self.progress(env.now, self.num_finished, num_requests)

    def _log_step(self, batch: Batch, start: float, result, num_preempted: int) -> None:
        s = self.steps
        num_decode = batch.num_decode_tokens
        s.start_s.append(start)
        s.seconds.append(result.seconds)
        s.num_prefill_tokens.append(batch.num_tokens - num_decode)
        s.num_decode_tokens.append(num_decode)
        s.num_requests.append(len(batch))
        s.num_kv_blocks_used.append(self.block_manager.num_used_blocks)
        s.num_waiting.append(len(self.state.waiting))
        s.num_preemptions.append(num_preempted)
        for key, value in result.breakdown.items():
            s.breakdown.setdefault(key, []).append(value)

    def _postprocess(self, batch: Batch, result, now: float) -> None:
        """Advance computed tokens; a request that caught up emits a token; finished ones free blocks."""
        sampled = result.sampled_token_ids
        logits_row = 0
        num_finished_before = self.num_finished
        for r, num_tokens, needs_logits in zip(batch.requests, batch.num_scheduled_tokens, batch.needs_logits):
            if needs_logits and sampled is not None:
                r.sampled_token_ids.append(int(sampled[logits_row]))
                logits_row += 1
            r.num_computed_tokens += num_tokens
            if r.num_computed_tokens != r.num_tokens:
                continue  # a partial prefill chunk emits nothing
            self.token_times[r.token_offset + r.num_generated_tokens] = now
            if r.num_generated_tokens == 0:
                r.first_token_s = now
            r.num_generated_tokens += 1
            if r.num_generated_tokens == r.num_output_tokens:
                r.status = Status.FINISHED
                r.finish_s = now
                self.block_manager.free(r)
                self.num_finished += 1
        if self.num_finished != num_finished_before:
            self.state.running = [r for r in self.state.running if r.status is Status.RUNNING]
