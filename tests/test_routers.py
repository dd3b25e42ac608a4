"""Routers over random replica views: the invariants each promises, one worked prefix-aware
score, and user routers loaded from a file."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.routers import ROUTERS, PrefixAwareRouter, Router, make_router
from sim.errors import ServesimError
from sim.request import Request


@dataclass(frozen=True)
class View:
    num_in_flight: int
    kv_usage: float
    num_cached: int
    block_size: int = 16

    def num_cached_prefix_blocks(self, request: Request) -> int:
        return self.num_cached


PROMPT_BLOCKS = 20
REQUEST = Request(0, "0", 0.0, PROMPT_BLOCKS * 16 + 5, 4)

views = st.builds(View, st.integers(0, 30), st.floats(0, 1), st.integers(0, PROMPT_BLOCKS))
clusters = st.lists(views, min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(ROUTERS)), seed=st.integers(0, 2**32), shapes=st.lists(clusters, min_size=1, max_size=20))
def test_every_router_picks_a_replica_in_the_list(name, seed, shapes):
    router = make_router(name, seed)
    for replicas in shapes:
        assert 0 <= router.route(REQUEST, replicas) < len(replicas)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), loads=st.lists(clusters, min_size=1, max_size=40))
def test_round_robin_is_balanced_within_one(n, loads):
    router = make_router("round-robin")
    counts = [0] * n
    for replicas in loads:
        replicas = (replicas * n)[:n]  # whatever the loads, n replicas
        counts[router.route(REQUEST, replicas)] += 1
        assert max(counts) - min(counts) <= 1


@settings(max_examples=100, deadline=None)
@given(replicas=clusters)
def test_least_requests_never_picks_a_busier_replica(replicas):
    choice = make_router("least-requests").route(REQUEST, replicas)
    assert replicas[choice].num_in_flight == min(r.num_in_flight for r in replicas)


@settings(max_examples=100, deadline=None)
@given(replicas=clusters)
def test_least_kv_picks_the_lowest_kv_usage(replicas):
    choice = make_router("least-kv").route(REQUEST, replicas)
    assert replicas[choice].kv_usage == min(r.kv_usage for r in replicas)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32), replicas=st.lists(views, min_size=2, max_size=9))
def test_power_of_two_never_picks_the_only_busiest_replica(seed, replicas):
    choice = make_router("power-of-two", seed).route(REQUEST, replicas)
    others = [r for i, r in enumerate(replicas) if i != choice]
    chosen = replicas[choice]
    assert any((r.num_in_flight, r.kv_usage) >= (chosen.num_in_flight, chosen.kv_usage) for r in others)


@settings(max_examples=100, deadline=None)
@given(in_flight=st.integers(0, 30), kv_usage=st.floats(0, 1), cached=st.lists(st.integers(0, PROMPT_BLOCKS), min_size=1, max_size=9))
def test_prefix_aware_picks_the_longest_cached_prefix_when_loads_are_equal(in_flight, kv_usage, cached):
    replicas = [View(in_flight, kv_usage, c) for c in cached]
    choice = make_router("prefix-aware").route(REQUEST, replicas)
    assert choice == cached.index(max(cached))  # the longest; among equals the first


@settings(max_examples=100, deadline=None)
@given(replicas=clusters)
def test_prefix_aware_ties_go_to_the_less_loaded(replicas):
    replicas = [View(r.num_in_flight, r.kv_usage, 3) for r in replicas]
    router = PrefixAwareRouter(prefix_weight=1.0, kv_weight=0.0, queue_weight=0.0)  # every score equal
    choice = router.route(REQUEST, replicas)
    assert (replicas[choice].num_in_flight, replicas[choice].kv_usage) == \
           min((r.num_in_flight, r.kv_usage) for r in replicas)


def test_prefix_aware_trades_prefix_against_load():
    # 20 prompt blocks. In flight 6, 2, 4: queue terms 0, 1, 0.5.
    #   A: 2 * 16/20 + (1 - 0.9) + 0   = 1.7
    #   B: 2 * 0/20  + (1 - 0.2) + 1   = 1.8
    #   C: 2 * 10/20 + (1 - 0.5) + 0.5 = 2.0  <- wins over A's longer prefix and B's lighter load
    replicas = [View(6, 0.9, 16), View(2, 0.2, 0), View(4, 0.5, 10)]
    router = make_router("prefix-aware")
    assert router.scores(REQUEST, replicas) == pytest.approx([1.7, 1.8, 2.0], abs=1e-12)
    assert router.route(REQUEST, replicas) == 2


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["random", "power-of-two"]), seed=st.integers(0, 2**32),
       shapes=st.lists(clusters, min_size=1, max_size=30))
def test_random_routers_repeat_their_choices_for_a_seed(name, seed, shapes):
    first, second = make_router(name, seed), make_router(name, seed)
    assert [first.route(REQUEST, r) for r in shapes] == [second.route(REQUEST, r) for r in shapes]


def test_random_seeds_give_different_choices():
    replicas = [View(0, 0.0, 0)] * 8
    runs = []
    for seed in (1, 2):
        router = make_router("random", seed)
        runs.append([router.route(REQUEST, replicas) for _ in range(20)])
    assert runs[0] != runs[1]
    firsts = {make_router("random", seed).route(REQUEST, replicas) for seed in range(50)}
    assert firsts == set(range(8))  # every replica is some seed's first choice


def test_a_user_router_loads_from_a_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(
        "from policies.routers import Router\n\n\n"
        "class Last(Router):\n"
        "    def route(self, request, replicas):\n"
        "        return len(replicas) - 1\n"
        "\n\nclass NotARouter:\n    pass\n")
    router = make_router(f"{path}:Last", seed=7)
    assert isinstance(router, Router) and router.seed == 7
    assert router.route(REQUEST, [View(0, 0.0, 0)] * 3) == 2
    with pytest.raises(ServesimError, match="not a subclass of policies.routers.Router"):
        make_router(f"{path}:NotARouter")
    with pytest.raises(ServesimError, match="has no class 'Missing'"):
        make_router(f"{path}:Missing")
    with pytest.raises(ServesimError, match="--router: no such file"):
        make_router(f"{tmp_path / 'absent.py'}:Last")
    with pytest.raises(ServesimError, match="unknown router 'nearest'"):
        make_router("nearest")


def test_a_user_router_file_that_fails_to_import_is_named(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise ValueError('no')\n")
    with pytest.raises(ServesimError, match="--router: .*broken.py failed to load: ValueError: no"):
        make_router(f"{path}:X")


def test_prefix_aware_refuses_a_negative_weight():
    with pytest.raises(ServesimError, match="the kv weight must be at least 0"):
        PrefixAwareRouter(kv_weight=-1.0)


def test_only_routers_that_read_no_state_say_so():
    from policies.routers import RoundRobinRouter

    assert {name for name, cls in ROUTERS.items() if not cls.reads_state} == {"round-robin", "random"}

    class Busy(RoundRobinRouter):  # reads the views: inherits no promise
        def route(self, request, replicas):
            return min(range(len(replicas)), key=lambda i: replicas[i].num_in_flight)

    class Shifted(RoundRobinRouter):  # says it still reads nothing
        reads_state = False

        def route(self, request, replicas):
            return (super().route(request, replicas) + 1) % len(replicas)

    assert Busy.reads_state and not Shifted.reads_state
