"""A cluster: replicas (engines) in one SimPy environment, fed by one arrivals process through a
router.

    trace ──> arrivals ──router──> replica 0: inbox -> engine (its own policy, KV cache, step log)
                             ├───> replica 1: inbox -> engine
                             └───> ...

The router decides at each arrival's instant from what a real router could see then: each
`Replica` is the router's `ReplicaView` (policies/routers.py): requests in flight, KV usage, the
leading prompt blocks its prefix cache holds. The arrivals process's events are SimPy URGENT
events, so the router sees every replica as the instant begins, before any step that ends at
that instant is applied; the routed request waits in the replica's inbox until the engine's next
step starts (an idle engine is woken at once), exactly as a lone engine takes its arrivals. With
one replica this is exactly a lone engine: the same steps, tokens and files.

Prefill/decode disaggregation (sim/disagg.py) adds a second pool and a KV link; the router then
picks a prefill and a decode replica for each request when it arrives.

Fast-forward runs per replica (sim/fast_forward.py). A replica's run ends before the next arrival
routed anywhere (each of its steps ends before it, so the router reads what step-by-step
simulation would show), and before the next transfer that reaches it. Routers that read no state
(round-robin, random) are asked at the start instead, in arrival order (they answer the same):
then a replica's runs end only at its own arrivals.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable

import numpy as np
import simpy
from simpy.events import URGENT

from sim.engine import Engine, SimResult, TokenTimes, delay_to
from sim.request import Request
from sim.step_log import StepLog


class Instant(simpy.events.Event):
    """A timeout that fires before every ordinary event of its instant (built as SimPy builds
    its own `Timeout`, simpy/events.py, with URGENT instead of NORMAL priority)."""

    def __init__(self, env: simpy.Environment, delay: float):
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, URGENT, delay)


class Replica:
    """One engine of a cluster: what the router sees of it, and the workload its engine takes
    requests from (the interface of sim/arrivals.py's TraceArrivals)."""

    role = "colocated"
    reacts_to_finishes = False
    delivers_by_time = False  # deliver hands over whatever was routed here by then
    busy_engine_alone = False  # the router reads every replica at each arrival

    def __init__(self, cluster: "Cluster", index: int, engine: Engine):
        self.cluster = cluster
        self.index = index  # its number in the cluster (steps tables, summary)
        self.engine = engine
        engine.attach(self)
        self.inbox: deque[Request] = deque()  # routed, not yet taken by the engine
        self.num_in_flight = 0  # routed here and not finished (or passed on)
        self.num_routed = 0
        self.pool_size = 1  # replicas the router chooses among, this one included
        self.ahead: deque[float] = deque()  # routed ahead of time (sim/cluster.py docstring): their arrival times

    # What the router sees (policies.routers.ReplicaView).

    @property
    def kv_usage(self) -> float:
        bm = self.engine.block_manager
        return bm.num_used_blocks / bm.num_blocks

    @property
    def block_size(self) -> int:
        return self.engine.block_manager.block_size

    def num_cached_prefix_blocks(self, request: Request) -> int:
        return self.engine.block_manager.num_cached_blocks(request)

    # Requests in.

    def take_route(self) -> None:
        """An arrival was routed here: its route, when known ahead, is used up."""
        if self.cluster.routes_ahead:
            self.ahead.popleft()

    def push(self, r: Request) -> None:
        """The router sent `r` here."""
        self.take_route()
        self.num_routed += 1
        self.inbox.append(r)
        self.num_in_flight += 1
        self.wake()

    def wake(self) -> None:
        if self.engine.is_idle:
            self.engine.wake()

    # The engine's workload.

    @property
    def is_exhausted(self) -> bool:
        return self.cluster.arrivals_done and not self.inbox

    @property
    def next_routed_s(self) -> float:
        """The next arrival that may come here: any arrival, or when routes are known ahead, the
        next one routed here."""
        if self.cluster.routes_ahead:
            return self.ahead[0] if self.ahead else math.inf
        return self.cluster.next_arrival_s

    @property
    def next_arrival_s(self) -> float:
        inbox = self.inbox  # one not yet delivered (asynchronously the engine asks up to its last step's start)
        return inbox[0].arrival_s if inbox else self.next_routed_s

    @property
    def next_observation_s(self) -> float:
        # The router reads this replica at every arrival, unless it reads nothing or has no choice.
        return self.cluster.next_arrival_s if self.pool_size > 1 and not self.cluster.routes_ahead else math.inf

    def deliver(self, now: float) -> None:
        inbox, submit = self.inbox, self.engine.submit
        while inbox and inbox[0].arrival_s <= now:  # asynchronously the engine asks up to its last step's start
            submit(inbox.popleft())

    def engine_idle(self) -> None:
        """Nothing waits on an idle engine: the arrivals process wakes it when it routes a request here."""

    def on_done(self, request: Request, now: float | None) -> None:
        self.num_in_flight -= 1
        self.cluster.on_done(request, now)


class ReplicaRecord:
    """What a replica leaves for the reports: its role, steps, KV cache size and counters."""

    def __init__(self, replica: Replica):
        engine = replica.engine
        bm = engine.block_manager
        self.index = replica.index
        self.role = replica.role
        self.steps = engine.steps
        self.num_blocks = bm.num_blocks
        self.num_requests = replica.num_routed
        self.num_preemptions = engine.state.num_preemptions
        self.num_prefix_queried_tokens = bm.num_queried_tokens
        self.num_prefix_hit_tokens = bm.num_hit_tokens


class ClusterSteps:
    """Every replica's steps in one table, in order of start time (ties by replica), with the
    replica that ran each step: what `SimResult.steps` offers, plus `replica`."""

    def __init__(self, logs: list[StepLog]):
        columns = [log.columns() for log in logs]
        keys = list(dict.fromkeys(k for c in columns for k in c))
        starts = np.concatenate([c["start_s"] for c in columns])
        replica = np.concatenate([np.full(len(log), i, dtype=np.int32) for i, log in enumerate(logs)])
        order = np.lexsort((replica, starts))
        self.replica = replica[order]
        self._columns = {}
        for k in keys:
            parts = [c[k] if k in c else np.full(len(log), np.nan) for c, log in zip(columns, logs)]
            self._columns[k] = np.concatenate(parts)[order]
        self._num_steps = len(starts)
        self.breakdown_keys = list(dict.fromkeys(k for log in logs for k in log.breakdown_keys))

    def __len__(self) -> int:
        return self._num_steps

    def columns(self) -> dict[str, np.ndarray]:
        return dict(self._columns)

    def __getattr__(self, name: str) -> np.ndarray:
        columns = self.__dict__.get("_columns", {})
        if name in columns:
            return columns[name]
        raise AttributeError(name)


class ClusterResult(SimResult):
    """A cluster's run: the requests and tokens of all replicas, every replica's steps (with the
    replica that ran each), and per replica its record; per request (in `requests` order) the
    replica that took it (the prefill replica, when disaggregated), and the KV transfers."""

    def __init__(self, requests: list[Request], token_times: TokenTimes, replicas: list[ReplicaRecord],
                 end_s: float, replica_of: np.ndarray, transfers: "dict | None"):
        logs = [record.steps for record in replicas]
        super().__init__(requests, token_times, ClusterSteps(logs), end_s,
                         sum(record.num_preemptions for record in replicas),
                         sum(record.num_prefix_queried_tokens for record in replicas),
                         sum(record.num_prefix_hit_tokens for record in replicas))
        self.replicas = replicas
        self.replica_of = replica_of  # [requests] the replica each request was routed to
        # When disaggregated: decode_replica, start_s, end_s, bytes per request ([requests] arrays;
        # NaN / no transfer for requests that finished on their prefill replica or were rejected).
        self.transfers = transfers

    @property
    def is_disaggregated(self) -> bool:
        return self.transfers is not None


class Cluster:
    """Colocated replicas behind a router. `replicas` are built by `add_replica` (each with its
    engine); `run()` replays the requests and returns a `ClusterResult`."""

    def __init__(self, requests: list[Request], token_times: TokenTimes, router,
                 progress: Callable[[float, int], None] | None = None):
        self.requests = requests  # arrival order
        self.token_times = token_times
        self.router = router
        self.progress = progress
        self.replicas: list[Replica] = []
        self.env = simpy.Environment()
        self.arrivals_done = not requests
        self.routes_ahead = False  # every router reads no state: each request's replica is known at the start
        self._ahead: list[tuple] = []  # per request (arrival order), its replicas when routed ahead
        self.num_done = 0
        self._next = 0
        self._position = {r.index: i for i, r in enumerate(requests)}
        self.replica_of = np.zeros(len(requests), dtype=np.int32)

    def add_replica(self, engine: Engine, replica_class: type[Replica] = Replica) -> Replica:
        replica = replica_class(self, len(self.replicas), engine)
        self.replicas.append(replica)
        if self.progress is not None:
            engine.progress = lambda now, _: self.progress(now, self.num_done)
        return replica

    def position(self, r: Request) -> int:
        return self._position[r.index]

    @property
    def next_arrival_s(self) -> float:
        return self.requests[self._next].arrival_s if self._next < len(self.requests) else math.inf

    # Routing.

    def pools(self) -> list[list[Replica]]:
        return [self.replicas]

    def routers(self) -> list:
        return [self.router]

    def choose(self, r: Request) -> tuple:
        """The replica(s) the router picks for `r`, one per pool."""
        return (self.replicas[self.router.route(r, self.replicas)],)

    def route(self, r: Request) -> None:
        """`r` arrives: send it where the router says (or said, when routes are known ahead)."""
        self.place(r, self._ahead[self.position(r)] if self.routes_ahead else self.choose(r))

    def place(self, r: Request, choice: tuple) -> None:
        (target,) = choice
        self.replica_of[self.position(r)] = target.index
        target.push(r)

    def _route_ahead(self) -> None:
        """Routers that read no replica state (round-robin, random) choose the same whenever they
        are asked, so ask them at the start, in arrival order: each replica then knows which
        arrivals are its own, and its fast-forward runs end only at those."""
        self.routes_ahead = True
        self._ahead = [self.choose(r) for r in self.requests]
        for r, choice in zip(self.requests, self._ahead):
            for replica in choice:
                replica.ahead.append(r.arrival_s)

    def _arrivals(self, env: simpy.Environment):
        requests = self.requests
        while self._next < len(requests):
            arrival_s = requests[self._next].arrival_s
            while arrival_s > env.now:
                yield Instant(env, delay_to(env.now, arrival_s))
            while self._next < len(requests) and requests[self._next].arrival_s <= env.now:
                r = requests[self._next]
                self._next += 1
                self.route(r)
        self.arrivals_done = True
        for replica in self.replicas:  # let the idle ones see that nothing more comes
            if replica.is_exhausted:
                replica.wake()

    def on_done(self, request: Request, now: float | None) -> None:
        self.num_done += 1

    # The run.

    def run(self) -> ClusterResult:
        env = self.env
        for pool in self.pools():
            for replica in pool:
                replica.pool_size = len(pool)
        if not any(router.reads_state for router in self.routers()):
            self._route_ahead()
        env.process(self._arrivals(env))
        engines = [env.process(replica.engine.run(env)) for replica in self.replicas]
        env.run(until=env.all_of(engines))
        return ClusterResult(self.requests, self.token_times, [ReplicaRecord(r) for r in self.replicas], env.now,
                             self.replica_of, self.transfers())

    def transfers(self) -> dict | None:
        return None

