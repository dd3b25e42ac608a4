"""Routers: which replica of a cluster takes an arriving request.

A router is a scheduling decision like a policy: one class and one entry in `ROUTERS` (the CLI's
`--router NAME`), or a user's class loaded from `path/file.py:ClassName`. It decides at the
instant the request arrives and sees only what a real router could see then: a read-only
`ReplicaView` of each candidate replica (requests in flight, KV usage, how much of the request's
prompt the replica's prefix cache holds). It returns the position of its choice in the list.

Ties go to the less loaded replica (fewer requests in flight, then lower KV usage), then to the
first in the list, so every router is deterministic given its seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from policies.checked import checked_router_class, load_bounded
from sim.errors import ServesimError
from sim.plugins import load_class
from sim.request import Request


class ReplicaView(Protocol):
    """What a router may read of one replica when a request arrives."""

    @property
    def num_in_flight(self) -> int:
        """Requests routed to the replica and not yet finished (waiting, running, or in transfer)."""

    @property
    def kv_usage(self) -> float:
        """Fraction of the replica's KV blocks in use, in [0, 1]."""

    @property
    def block_size(self) -> int:
        """Tokens per KV block on this replica."""

    def num_cached_prefix_blocks(self, request: Request) -> int:
        """Leading full prompt blocks of `request` that the replica's prefix cache holds now."""


def _load(view: ReplicaView) -> tuple[int, float]:
    return view.num_in_flight, view.kv_usage


def _least_loaded(replicas: Sequence[ReplicaView], candidates: Sequence[int]) -> int:
    return min(candidates, key=lambda i: (_load(replicas[i]), i))


class Router:
    """`reads_state = False` promises that `route` reads nothing of the replicas but how many
    there are, so its answers do not depend on when it is asked: a cluster then asks it at the
    start, for every request in arrival order, and each replica's fast-forward runs end only at
    its own arrivals (sim/cluster.py). A subclass that overrides `route` makes no such promise
    unless it says so in its own class body."""

    name = ""
    reads_state = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "route" in cls.__dict__ and "reads_state" not in cls.__dict__:
            cls.reads_state = True

    def __init__(self, seed: int = 0):
        self.seed = seed

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        """The position in `replicas` (never empty) of the replica that takes `request`."""
        raise NotImplementedError


class RoundRobinRouter(Router):
    """Each replica in turn, whatever their load: after k requests every replica has had
    k // n or k // n + 1 of them."""

    name = "round-robin"
    reads_state = False

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self._num_routed = 0

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        choice = self._num_routed % len(replicas)
        self._num_routed += 1
        return choice


class RandomRouter(Router):
    """A uniformly random replica; the same seed gives the same choices."""

    name = "random"
    reads_state = False

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self._rng = random.Random(seed)

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return self._rng.randrange(len(replicas))


class LeastRequestsRouter(Router):
    """The replica with the fewest requests in flight (Envoy's and vLLM's router's
    least-request balancing)."""

    name = "least-requests"

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return _least_loaded(replicas, range(len(replicas)))


class LeastKVRouter(Router):
    """The replica with the lowest KV usage; ties to fewer requests in flight."""

    name = "least-kv"

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].kv_usage, replicas[i].num_in_flight, i))


class PowerOfTwoRouter(Router):
    """Two distinct replicas drawn at random, the less loaded of them (Mitzenmacher's "power of
    two choices": nearly least-loaded balance from two probes)."""

    name = "power-of-two"

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self._rng = random.Random(seed)

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        if len(replicas) == 1:
            return 0
        return _least_loaded(replicas, self._rng.sample(range(len(replicas)), 2))


class PrefixAwareRouter(Router):
    """The replica whose prefix cache holds the longest prefix of the request's prompt, traded
    against load. Each replica scores

        score = prefix_weight * cached_blocks / prompt_blocks
              + kv_weight     * (1 - kv_usage)
              + queue_weight  * (max_in_flight - in_flight) / (max_in_flight - min_in_flight)

    and the highest score wins (ties to the less loaded). The queue term is min-max normalised
    over the candidates and is 1 for all when they carry equal load. These are llm-d's scorers
    summed by weight with its max-score picker (gateway-api-inference-extension
    pkg/epp/scheduling/framework/plugins: prefixcachescorer/plugin.go `Score`, matched blocks /
    prompt blocks; queuescorer/queue.go `Score`; the kv-cache-utilization scorer, 1 - usage),
    with the weights of llm-d-inference-scheduler's deploy/config/epp-precise-prefix-cache-config.yaml
    (prefix 2, KV utilisation 1, queue 1). NVIDIA Dynamo's KV router trades the same two things
    as a cost, `overlap_score_weight * prefill_blocks + decode_blocks`, lowest wins (Dynamo docs,
    components/router, "Cost Calculation"): cached blocks lower the prefill term, load raises the
    decode term. With equal loads both pick the longest cached prefix.
    """

    name = "prefix-aware"

    def __init__(self, seed: int = 0, prefix_weight: float = 2.0, kv_weight: float = 1.0,
                 queue_weight: float = 1.0):
        super().__init__(seed)
        for label, weight in (("prefix", prefix_weight), ("kv", kv_weight), ("queue", queue_weight)):
            if not weight >= 0:
                raise ServesimError(f"prefix-aware router: the {label} weight must be at least 0, got {weight}")
        self.prefix_weight = prefix_weight
        self.kv_weight = kv_weight
        self.queue_weight = queue_weight

    def scores(self, request: Request, replicas: Sequence[ReplicaView]) -> list[float]:
        in_flight = [r.num_in_flight for r in replicas]
        lo, hi = min(in_flight), max(in_flight)
        out = []
        for view, q in zip(replicas, in_flight):
            num_prompt_blocks = request.num_prompt_tokens // view.block_size
            prefix = view.num_cached_prefix_blocks(request) / num_prompt_blocks if num_prompt_blocks else 0.0
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            out.append(self.prefix_weight * prefix + self.kv_weight * (1.0 - view.kv_usage)
                       + self.queue_weight * queue)
        return out

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        scores = self.scores(request, replicas)
        best = max(scores)
        return _least_loaded(replicas, [i for i, s in enumerate(scores) if s == best])


ROUTERS: dict[str, type[Router]] = {
    "round-robin": RoundRobinRouter,
    "random": RandomRouter,
    "least-requests": LeastRequestsRouter,
    "least-kv": LeastKVRouter,
    "power-of-two": PowerOfTwoRouter,
    "prefix-aware": PrefixAwareRouter,
}


def load_router(spec: str) -> type[Router]:
    """A built-in router by name, or a user's `FILE.py:Class` / `module:Class` (a `Router` subclass),
    wrapped so that its answers are checked and its errors reported as its own (policies/checked.py)."""
    if spec in ROUTERS:
        return ROUTERS[spec]
    cls = load_bounded(lambda: load_class(spec, ROUTERS, Router, "router"), spec, "router")
    return checked_router_class(cls, spec)


def make_router(spec: str, seed: int = 0) -> Router:
    return load_router(spec)(seed)
