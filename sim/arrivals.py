"""Workloads: what sends requests to an engine, and when.

`TraceArrivals` is an open loop: each request arrives at its trace time, whatever the engine
does. `ClosedLoop` is `vllm bench serve --max-concurrency C`: at most C requests in flight, the
next sent when one ends. A workload hands the engine every request that has arrived by the start of each step
(`deliver`), wakes the engine when it sleeps with nothing to do, and hears of every request that
ends (`on_done`), so that a closed-loop workload can send the next one: the `Workload` protocol
(sim/workload.py), which both implement. They share the process that wakes an idle engine
(`_WakesEngine`).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable
from typing import cast

import numpy as np
import simpy

from sim.engine import Engine, SimResult, delay_to
from sim.request import Request
from sim.workload import Workload


def through_api_servers(sent_s: np.ndarray, seconds: np.ndarray, servers: int = 1) -> np.ndarray:
    """When requests sent at `sent_s` (ascending) reach the engine through `servers` API servers
    that each handle one request at a time, `seconds[i]` for request i, in send order, each request
    taken by the server free first (vLLM's API server is one asyncio process: it handles a request
    until it hands it to the engine core; vllm/entrypoints/cli/serve.py starts one per data-parallel
    rank from vLLM 0.15). One server: arrival[i] = max(arrival[i - 1], sent[i]) + seconds[i],
    written as a running maximum (arrival[i] = C[i] + max over j <= i of sent[j] - C[j - 1], C the
    cumulative seconds)."""
    sent_s = np.asarray(sent_s, dtype=np.float64)
    seconds = np.asarray(seconds, dtype=np.float64)
    if servers < 1:
        raise ValueError(f"at least one API server, got {servers}")
    if servers == 1 or len(sent_s) <= 1:
        total = np.cumsum(seconds)
        return total + np.maximum.accumulate(sent_s - (total - seconds))
    pool = ApiServers(None, servers)
    return np.array([pool.handle(sent, cost) for sent, cost in zip(sent_s.tolist(), seconds.tolist())])


class ApiServers:
    """vLLM's API servers in a closed loop (`through_api_servers`, one request at a time): a
    request sent at `at` waits for the server free first and reaches the engine `seconds(request)`
    after it starts there. `take` records the send (`client_sent_s`, where the client's TTFT
    starts) and the arrival (`arrival_s`)."""

    def __init__(self, seconds: Callable[[Request], float] | None, count: int = 1):
        if count < 1:
            raise ValueError(f"at least one API server, got {count}")
        self.seconds = seconds
        self._free = [0.0] * count  # each server's next free instant, a heap

    def handle(self, at: float, seconds: float) -> float:
        """A request sent at `at` that takes a server `seconds`: when it is done with it."""
        done = max(self._free[0], at) + seconds
        heapq.heapreplace(self._free, done)
        return done

    def take(self, request: Request, at: float) -> float:
        assert self.seconds is not None
        request.client_sent_s = at
        request.arrival_s = done = self.handle(at, self.seconds(request))
        return done


def queue_by_arrival(queue: list[Request], request: Request) -> None:
    """Put `request` in `queue` (ascending arrival_s) after those arriving no later: in send order
    where one server keeps it (an append), else where its arrival falls."""
    if not queue or queue[-1].arrival_s <= request.arrival_s:
        queue.append(request)
    else:
        bisect.insort_right(queue, request, key=lambda r: r.arrival_s)


class RequestStream:
    """Requests made one by one as they arrive: `arrival_s` [n] ascending, `make(i)` builds the
    i-th. A replay of millions of requests then holds only the requests in flight."""

    def __init__(self, arrival_s: np.ndarray, make: Callable[[int], Request]):
        self.arrival_s = arrival_s
        self.make = make

    def __len__(self) -> int:
        return len(self.arrival_s)


WINDOW = 1 << 16  # arrival times of a RequestStream read as Python floats this many at a time


class _WakesEngine:
    """What a lone engine's workloads share: attaching to the engine, and the SimPy process that
    wakes it when it is idle and the next request arrives (a busy engine takes the requests that
    arrived by each step's start itself, so this sleeps while it is busy)."""

    reacts_to_finishes: bool
    delivers_by_time = True  # deliver(t) hands over exactly the requests arrived by t, whenever it is called
    # Nothing else in the simulation acts while the engine is busy (this sleeps meanwhile), so the
    # engine may keep its own clock through a busy period (Engine.run).
    busy_engine_alone = True

    def __init__(self, engine: Engine):
        self.engine = engine
        engine.attach(cast(Workload, self))  # (each subclass is one)
        self._engine_idle: simpy.Event | None = None  # what the process waits on while the engine is busy

    def engine_idle(self) -> None:
        if self._engine_idle is not None and not self._engine_idle.triggered:
            self._engine_idle.succeed()

    def process(self, env: simpy.Environment):
        """Wake the engine when it is idle and the next request arrives (one that no finish causes)."""
        engine, workload = self.engine, cast(Workload, self)  # (each subclass is one)
        while not workload.is_exhausted:
            if not engine.is_idle:
                self._engine_idle = env.event()
                yield self._engine_idle
                continue
            arrival_s = workload.next_arrival_s
            while arrival_s > env.now:
                yield env.timeout(delay_to(env.now, arrival_s))
            if not engine.is_idle:  # it woke by itself meanwhile (its policy's retry time, Policy.retry_s)
                continue
            yield engine.wake()  # let the engine take the request before looking again


class TraceArrivals(_WakesEngine):
    """Requests enter at their arrival times (sorted by time, then trace order): a list of
    requests, or a RequestStream. `on_done(position, request)`, if given, hears of every request
    that ends (finished or rejected) with its place in arrival order."""

    reacts_to_finishes = False  # an open loop sends nothing when a request ends

    def __init__(self, requests: list[Request] | RequestStream, engine: Engine,
                 on_done: Callable[[int, Request], None] | None = None):
        super().__init__(engine)
        if isinstance(requests, RequestStream):
            self.requests = None  # not kept
            self._arrival_s, self._make = requests.arrival_s, requests.make
            self._window = self._arrival_s[:WINDOW].tolist()
        else:
            self.requests = requests
            self._make = requests.__getitem__
            self._window = [r.arrival_s for r in requests]
        self._num_requests = len(requests)
        self._window_start = 0  # the request whose arrival time is _window[0]
        self._listener = on_done
        self._positions: dict[Request, int] = {}  # requests in the engine -> their place, for the listener
        self._next = 0  # the next request to arrive
        self.next_arrival_s = self._arrival(0) if self._num_requests else math.inf  # its arrival time

    @property
    def is_exhausted(self) -> bool:
        return self._next == self._num_requests

    def _arrival(self, i: int) -> float:
        j = i - self._window_start
        if j >= len(self._window):  # a RequestStream's next window
            self._window_start = i
            self._window = self._arrival_s[i:i + WINDOW].tolist()
            j = 0
        return self._window[j]

    @property
    def next_observation_s(self) -> float:
        """The next instant at which something outside the engine reads its state (a cluster's
        router does, at every arrival); fast-forward ends its runs before it. Nothing reads a
        lone engine."""
        return math.inf

    def deliver(self, now: float) -> None:
        """Hand the engine every request that has arrived by `now`."""
        if self.next_arrival_s > now:  # most steps: nothing has
            return
        submit, make, positions = self.engine.submit, self._make, self._positions
        while self._next < self._num_requests and self._arrival(self._next) <= now:
            r = make(self._next)
            if self._listener is not None:
                positions[r] = self._next
            self._next += 1
            submit(r)
        self.next_arrival_s = self._arrival(self._next) if self._next < self._num_requests else math.inf

    def on_done(self, request: Request, now: float | None) -> None:
        """A request finished at `now` (None: it was rejected)."""
        if self._listener is not None:
            self._listener(self._positions.pop(request), request)


class ClosedLoop(_WakesEngine):
    """vLLM's benchmark client with --max-concurrency (vllm/benchmarks/serve.py, `benchmark` and
    `get_request`): request i is created at `created_s[i]` (all at 0 for an infinite request rate,
    else on a Poisson schedule) and waits, in creation order, for one of `concurrency` slots; it is
    sent when it has a slot. A slot is freed when a request finishes (or is rejected). `requests`
    are in creation order; their `arrival_s` is set when they are sent, so TTFT and E2E count from
    the send, as vLLM's client measures them (its time waiting for a slot is not part of them).
    With `servers` (ApiServers), vLLM's API servers stand between the client and the engine: a
    request arrives at the engine when one has handled it (`client_sent_s` keeps the send, where the
    client's TTFT starts: reports.outcomes.ttft_parts).

    `warmups`: what the client sends before the benchmark, in stages, each stage's requests all
    created when the stage starts and sent at most `concurrency` at a time, the next stage started
    at the instant the last request of the one before ended: vLLM's test request (a stage of one)
    and its --num-warmups copies of it (serve.py `benchmark`: `wait_for_endpoint`, then the warm-up
    tasks under a semaphore of --max-concurrency, gathered). The benchmark's requests are the last
    stage: their `created_s` count from its start, `start_s` (0 without warm-ups), as vLLM's
    `get_request` counts from the benchmark's start. `start_counts` keeps the engine's counters
    (preemptions, prefix-cache queries and hits) at that instant, so the benchmark's own can be told
    apart (sim/app/bench.py)."""

    reacts_to_finishes = True  # a finish sends the next request
    # (delivers_by_time and busy_engine_alone as TraceArrivals: sends that finishes cause are delivered by time)

    def __init__(self, requests: list[Request], created_s: list[float], concurrency: int, engine: Engine,
                 servers: ApiServers | None = None, warmups: list[list[Request]] | None = None):
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        super().__init__(engine)
        self.requests, self.concurrency = requests, concurrency
        self.servers = servers
        self.num_in_flight = 0
        self.max_in_flight = 0
        self._stages = [stage for stage in (warmups or []) if stage]
        self.warmup_requests = [r for stage in self._stages for r in stage]
        self._benchmark_created_s = created_s
        self.start_s = 0.0  # when the benchmark started: the last warm-up's end (0 without warm-ups)
        self.start_counts = (0, 0, 0)  # the engine's preemptions, prefix-cache queried and hit tokens then
        # The stage being sent: its requests and their creation times.
        self._queue: list[Request] = requests
        self.created_s = created_s
        if self._stages:
            self._begin(self._stages.pop(0), 0.0)
        self._next = 0  # the next request of the stage to send
        self._sent: list[Request] = []  # sent, not yet handed to the engine (in send order)
        # Sent at the instant of the output that caused it, straight to the engine (no API server's time
        # between): vLLM's API server counted that output before the client had it (Engine.submit's `after_outputs`).
        self._after_outputs: set[int] = set()
        self._now = 0.0  # the latest time the engine told us of

    def _begin(self, stage: list[Request], at: float) -> None:
        """Start a warm-up stage at `at`: all of its requests created then."""
        self._queue, self.created_s = stage, [at] * len(stage)

    def _begin_next_stage(self, at: float) -> None:
        """The stage before ended at `at` (its last request ended then): start the next one."""
        self._next = 0
        if self._stages:
            self._begin(self._stages.pop(0), at)
            return
        self._queue = self.requests
        self.created_s = [at + c for c in self._benchmark_created_s]
        self.start_s = at
        bm = self.engine.block_manager
        self.start_counts = (self.engine.state.num_preemptions, bm.num_queried_tokens, bm.num_hit_tokens)
        self.max_in_flight = 0  # the benchmark's own

    @property
    def in_warmup(self) -> bool:
        return self._queue is not self.requests

    def _send(self, at: float, after_outputs: bool = False) -> None:
        r = self._queue[self._next]
        self._next += 1
        if self.servers is None:
            r.arrival_s = at
            if after_outputs:
                self._after_outputs.add(id(r))
            queue_by_arrival(self._sent, r)  # (sent at a rejection's instant, before others not yet delivered)
        else:
            self.servers.take(r, at)
            queue_by_arrival(self._sent, r)
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)

    def _send_created(self, now: float, after_outputs: bool = False) -> None:
        """Send, at their creation times, the requests created by `now` that found a free slot
        (`after_outputs`: those created at `now` were sent on the outputs then, a stage's start)."""
        while (self._next < len(self._queue) and self.num_in_flight < self.concurrency
               and self.created_s[self._next] <= now):
            at = self.created_s[self._next]
            self._send(at, after_outputs and at == now)

    @property
    def is_exhausted(self) -> bool:
        return not self.in_warmup and self._next == len(self.requests) and not self._sent

    @property
    def next_arrival_s(self) -> float:
        """The next arrival that no finish causes: a sent request not yet delivered, or the next
        creation while a slot is free."""
        if self._sent:
            return self._sent[0].arrival_s
        if self._next < len(self._queue) and self.num_in_flight < self.concurrency:
            return self.created_s[self._next]
        return math.inf

    next_observation_s = math.inf  # nothing outside reads a lone engine (TraceArrivals.next_observation_s)

    def deliver(self, now: float) -> None:
        self._now = now
        self._send_created(now)
        while self._sent and self._sent[0].arrival_s <= now:
            r = self._sent.pop(0)
            self.engine.submit(r, id(r) in self._after_outputs)  # a rejection frees its slot at once (on_done)
            self._after_outputs.discard(id(r))

    def on_done(self, request: Request, now: float | None) -> None:
        """Free the request's slot; the oldest created request waiting for one is sent now. A
        rejected request (`now` None) is answered at its arrival (the API server's check: an HTTP
        503, or 400 for a request too long), which the engine may take only at its next step.
        The last request of a warm-up stage to end starts the next stage (or the benchmark) now.
        What is sent now sees the outputs at this instant (the finish: the client had it after the
        API server counted it), or not where they came after the rejected request's own arrival."""
        # (a rejection is answered at the arrival: it saw the outputs then only if it was sent on them)
        after_outputs = now is not None or id(request) in self._after_outputs
        now = request.arrival_s if now is None else now
        self._send_created(now)
        self.num_in_flight -= 1
        if self._next < len(self._queue) and self.created_s[self._next] <= now:
            self._send(now, after_outputs)
        elif self.in_warmup and not self.num_in_flight and self._next == len(self._queue):
            self._begin_next_stage(now)
            self._send_created(now, after_outputs)


def simulate(engine: Engine, workload: TraceArrivals | ClosedLoop):
    """Run one engine fed by `workload` to the end."""
    env = simpy.Environment()
    env.process(workload.process(env))
    env.run(until=env.process(engine.run(env)))
    bm = engine.block_manager
    return SimResult(workload.requests, engine.token_times, engine.steps, env.now, engine.state.num_preemptions,
                     bm.num_queried_tokens, bm.num_hit_tokens)
