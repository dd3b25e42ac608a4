"""What an engine asks of whatever sends it requests (a workload): the `Workload` protocol.

A workload hands the engine the requests that have arrived by the start of each step
(`deliver`), says when it has nothing more to send (`is_exhausted`), hears when the engine falls
asleep (`engine_idle`) and of every request that ends (`on_done`). Fast-forward (sim/fast_forward.py)
reads when the next request may arrive (`next_arrival_s`) and when something outside next reads the
engine (`next_observation_s`), and three facts about how the workload behaves. The engine holds its
workload as this type (`Engine.attach`); the workloads are sim/arrivals.py's `TraceArrivals` and
`ClosedLoop`, and a cluster's replicas (sim/cluster.py, sim/disagg.py).
"""

from __future__ import annotations

from typing import Protocol

from sim.request import Request


class Workload(Protocol):
    @property
    def reacts_to_finishes(self) -> bool:
        """Whether a finish may make a request arrive at once (a closed loop's next send), or let in
        one the workload holds (a decode replica's transferred requests, waiting for blocks): then a
        run of steps ends at the first finish, and asynchronously the step after it is taken alone
        (Engine.run), as the finish's blocks are freed only after that step is scheduled."""
        ...

    @property
    def delivers_by_time(self) -> bool:
        """Whether `deliver(t)` hands over exactly the requests that arrived by t, whenever it is
        called (so a run may deliver them after the fact, step by step)."""
        ...

    @property
    def busy_engine_alone(self) -> bool:
        """Whether nothing else in the simulation acts while the engine is busy, so the engine may
        keep its own clock through a busy period (Engine.run)."""
        ...

    @property
    def is_exhausted(self) -> bool:
        """Nothing more will be sent."""
        ...

    @property
    def next_arrival_s(self) -> float:
        """When the next request that no finish causes arrives (inf: none)."""
        ...

    @property
    def next_observation_s(self) -> float:
        """When something outside the engine next reads its state (a cluster's router; inf: never)."""
        ...

    def deliver(self, now: float) -> None:
        """Submit to the engine every request that has arrived by `now` (Engine.submit)."""
        ...

    def engine_idle(self) -> None:
        """The engine fell asleep; it waits for `Engine.wake`."""
        ...

    def on_done(self, request: Request, now: float | None) -> None:
        """A request finished at `now`, or was rejected (`now` None)."""
        ...
