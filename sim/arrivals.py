"""Workloads: what sends requests to an engine, and when.

`TraceArrivals` is an open loop: each request arrives at its trace time, whatever the engine
does. A workload hands the engine every request that has arrived by the start of each step
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


def simulate(engine: Engine, workload: TraceArrivals):
    """Run one engine fed by `workload` to the end."""
    env = simpy.Environment()
    env.process(workload.process(env))
    env.run(until=env.process(engine.run(env)))
    bm = engine.block_manager
    return SimResult(workload.requests, engine.token_times, engine.steps, env.now, engine.state.num_preemptions,
                     bm.num_queried_tokens, bm.num_hit_tokens)
