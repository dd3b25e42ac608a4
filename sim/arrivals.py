"""Workloads: what sends requests to an engine, and when.

`TraceArrivals` is an open loop: each request arrives at its trace time, whatever the engine
does. `ClosedLoop` is `vllm bench serve --max-concurrency C`: at most C requests in flight, the
next sent when one ends. A workload hands the engine every request that has arrived by the start of each step
(`deliver`), wakes the engine when it sleeps with nothing to do, and hears of every request that
ends (`on_done`), so that a closed-loop workload can send the next one. Fast-forward reads
`next_arrival_s` and `reacts_to_finishes` to know where a run of decode steps must stop.
"""

from __future__ import annotations

import math

import simpy

from sim.engine import Engine, SimResult, delay_to
from sim.request import Request


class TraceArrivals:
    """Requests enter at their arrival times (sorted by time, then trace order)."""

    reacts_to_finishes = False  # an open loop sends nothing when a request ends

    def __init__(self, requests: list[Request], engine: Engine):
        self.requests = requests
        self.engine = engine
        engine.workload = self
        self._next = 0  # index into self.requests of the next request to arrive
        self._engine_idle: simpy.Event | None = None  # what the arrivals process waits on meanwhile

    @property
    def is_exhausted(self) -> bool:
        return self._next == len(self.requests)

    @property
    def next_arrival_s(self) -> float:
        return self.requests[self._next].arrival_s if self._next < len(self.requests) else math.inf

    def deliver(self, now: float) -> None:
        """Hand the engine every request that has arrived by `now`."""
        requests, submit = self.requests, self.engine.submit
        while self._next < len(requests) and requests[self._next].arrival_s <= now:
            submit(requests[self._next])
            self._next += 1

    def engine_idle(self, engine: Engine) -> None:
        if self._engine_idle is not None and not self._engine_idle.triggered:
            self._engine_idle.succeed()

    def on_done(self, request: Request, now: float | None) -> None:
        """A request finished at `now` (None: it was rejected)."""

    def process(self, env: simpy.Environment):
        """Wake the engine when it is idle and the next request arrives. A busy engine takes the
        requests that arrived by each step's start itself, so this sleeps while it is busy."""
        engine = self.engine
        while not self.is_exhausted:
            if not engine.is_idle:
                self._engine_idle = env.event()
                yield self._engine_idle
                continue
            arrival_s = self.next_arrival_s
            while arrival_s > env.now:
                yield env.timeout(delay_to(env.now, arrival_s))
            yield engine.wake()  # let the engine take the request before looking again


class ClosedLoop:
    """vLLM's benchmark client with --max-concurrency (vllm/benchmarks/serve.py, `benchmark` and
    `get_request`): request i is created at `created_s[i]` (all at 0 for an infinite request rate,
    else on a Poisson schedule) and waits, in creation order, for one of `concurrency` slots; it is
    sent, and arrives at the engine, when it has a slot. A slot is freed when a request finishes
    (or is rejected). `requests` are in creation order; their `arrival_s` is set when they are
    sent, so TTFT and E2E count from the send, as vLLM's client measures them (its time waiting for
    a slot is not part of them)."""

    reacts_to_finishes = True  # a finish sends the next request

    def __init__(self, requests: list[Request], created_s: list[float], concurrency: int, engine: Engine):
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.requests, self.created_s, self.concurrency = requests, created_s, concurrency
        self.engine = engine
        engine.workload = self
        self.num_in_flight = 0
        self.max_in_flight = 0
        self._next = 0  # the next request to send
        self._sent: list[Request] = []  # sent, not yet handed to the engine (in send order)
        self._now = 0.0  # the latest time the engine told us of
        self._engine_idle: simpy.Event | None = None

    def _send(self, at: float) -> None:
        r = self.requests[self._next]
        self._next += 1
        r.arrival_s = at
        self._sent.append(r)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)

    def _catch_up(self, now: float) -> None:
        """Send, at their creation times, the requests created by `now` that found a free slot."""
        while (self._next < len(self.requests) and self.num_in_flight < self.concurrency
               and self.created_s[self._next] <= now):
            self._send(self.created_s[self._next])

    @property
    def is_exhausted(self) -> bool:
        return self._next == len(self.requests) and not self._sent

    @property
    def next_arrival_s(self) -> float:
        """The next arrival that no finish causes: a sent request not yet delivered, or the next
        creation while a slot is free."""
        if self._sent:
            return self._sent[0].arrival_s
        if self._next < len(self.requests) and self.num_in_flight < self.concurrency:
            return self.created_s[self._next]
        return math.inf

    def deliver(self, now: float) -> None:
        self._now = now
        self._catch_up(now)
        while self._sent and self._sent[0].arrival_s <= now:
            self.engine.submit(self._sent.pop(0))  # a rejection frees its slot at once (on_done)

    def engine_idle(self, engine: Engine) -> None:
        if self._engine_idle is not None and not self._engine_idle.triggered:
            self._engine_idle.succeed()

    def on_done(self, request: Request, now: float | None) -> None:
        """Free the request's slot; the oldest created request waiting for one is sent now."""
        now = self._now if now is None else now
        self._catch_up(now)
        self.num_in_flight -= 1
        if self._next < len(self.requests) and self.created_s[self._next] <= now:
            self._send(now)

    def process(self, env: simpy.Environment):
        """Wake the idle engine at the next send that no finish causes."""
        engine = self.engine
        while not self.is_exhausted:
            if not engine.is_idle:
                self._engine_idle = env.event()
                yield self._engine_idle
                continue
            arrival_s = self.next_arrival_s
            while arrival_s > env.now:
                yield env.timeout(delay_to(env.now, arrival_s))
            yield engine.wake()


def simulate(engine: Engine, workload: TraceArrivals | ClosedLoop):
    """Run one engine fed by `workload` to the end."""
    env = simpy.Environment()
    env.process(workload.process(env))
    env.run(until=env.process(engine.run(env)))
    bm = engine.block_manager
    return SimResult(workload.requests, engine.token_times, engine.steps, env.now, engine.state.num_preemptions,
                     bm.num_queried_tokens, bm.num_hit_tokens)
