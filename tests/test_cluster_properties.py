"""Invariants of any small trace on any small cluster shape, under every router and policy:
requests and tokens conserved, blocks conserved on every replica (checked at every step, blocks
in transfer included), routers' promises, and disaggregation's order (prefill, transfer, decode;
no prefill on a decode replica but to recompute after a preemption)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import POLICIES
from policies.routers import ROUTERS
from sim.app.cluster_options import ClusterOptions
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.app.replay import make_cluster, make_requests
from sim.config import CacheConfig, SchedulerConfig
from sim.request import Status
from tests.helpers import ConstantBackend, make_trace

rows = st.lists(st.tuples(st.integers(0, 20), st.integers(1, 40), st.integers(1, 10),
                          st.sampled_from([[], [0], [0, 1], [0, 1, 2, 3], [7, 8]])), min_size=1, max_size=12)
shapes = st.one_of(st.tuples(st.integers(1, 4), st.just(0), st.just(0)),  # colocated replicas
                   st.tuples(st.just(1), st.integers(1, 2), st.integers(1, 3)))  # prefill, decode pools
configs = st.fixed_dictionaries({
    "router": st.sampled_from(sorted(ROUTERS)),
    "policy": st.sampled_from(sorted(POLICIES)),
    "block_size": st.sampled_from([1, 2, 4]),
    "num_blocks": st.integers(4, 30),
    "decode_blocks": st.integers(4, 30),
    "max_num_seqs": st.integers(1, 4),
    "extra_budget": st.integers(0, 30),
    "prefix_caching": st.booleans(),
    "seed": st.integers(0, 3),
})


def trace_of(rows):
    """Arrivals in tenths of a second; shared hash ids give shared prefixes (4-token hash blocks)."""
    hash_ids = [np.resize(np.asarray(h + [100 + i], dtype=np.int64), -(-p // 4)) for i, (_, p, _, h) in enumerate(rows)]
    return make_trace([(a / 10, p, o) for a, p, o, _ in rows], hash_ids=hash_ids, hash_block_tokens=4)


def options_of(shape, cfg) -> ReplayOptions:
    n, p, d = shape
    router = cfg["router"] if n > 1 or p else ClusterOptions.router  # one engine: a router is refused (none to pick)
    cluster = ClusterOptions(num_replicas=n, router=router, num_prefill_replicas=p, num_decode_replicas=d,
                             kv_transfer_bandwidth_gb_s=0.5 if p else None, kv_transfer_latency_s=0.1 if p else None,
                             decode_options=f"num-blocks={cfg['decode_blocks']}" if p else "")
    return ReplayOptions(
        scheduler=SchedulerConfig(cfg["policy"], cfg["max_num_seqs"] + cfg["extra_budget"], cfg["max_num_seqs"]),
        cache=CacheConfig(cfg["block_size"], cfg["num_blocks"], enable_prefix_caching=cfg["prefix_caching"]),
        model="Qwen3-0.6B", seed=cfg["seed"], cluster=cluster)


def check_blocks(cluster) -> None:
    """Every replica's blocks add up: those of its running requests, and on a prefill replica
    those of the requests whose KV is crossing the link."""
    for replica in cluster.replicas:
        engine = replica.engine
        holders = list(engine.state.running)
        if replica.role == "prefill":
            holders += [r for r in cluster.requests if r.index in replica.releases]
        engine.block_manager.check_invariants(holders)


@pytest.mark.slow  # 120 random clusters, checked at every step
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows, shape=shapes, cfg=configs)
def test_cluster_invariants(rows, shape, cfg):
    trace = trace_of(rows)
    backend = ConstantBackend(1.0)
    plan = resolve(options_of(shape, cfg), backend)
    requests = sorted(make_requests(trace), key=lambda r: (r.arrival_s, r.index))
    cluster = make_cluster(plan, requests)
    backend.on_execute = lambda batch: check_blocks(cluster)
    result = cluster.run()

    # Requests and tokens: each request ended once, with all its tokens or none.
    assert len(result.requests) == len(rows)
    for i, r in enumerate(result.requests):
        times = result.tokens_of(i)
        if r.status is Status.FINISHED:
            assert r.num_output_tokens == r.max_tokens and not np.isnan(times).any()
            assert (np.diff(times) > 0).all() and times[0] > r.arrival_s
        else:
            assert r.status is Status.REJECTED and np.isnan(times).all()
    assert sum(len(rec.steps) for rec in result.replicas) == len(result.steps)
    # Blocks: every replica ends with none in use and its books straight.
    for replica in cluster.replicas:
        bm = replica.engine.block_manager
        bm.check_invariants([])
        assert bm.num_used_blocks == 0 and replica.num_in_flight == 0

    n, p, d = shape
    pools = [cluster.replicas] if not p else [cluster.replicas[:p], cluster.replicas[p:]]
    router = options_of(shape, cfg).cluster.router
    for pool in pools:
        routed = [replica.num_routed for replica in pool]
        if router == "round-robin" and not p:  # (disaggregated, a request refused on arrival counts on neither)
            assert max(routed) - min(routed) <= 1
    if not p:
        assert sum(replica.num_routed for replica in cluster.replicas) == len(rows)
        return

    # Disaggregation: prefill, then the transfer, then decode; nothing prefilled on a decode replica
    # unless recomputing after a preemption there, and nothing decoded on a prefill replica.
    t = result.transfers
    for i, r in enumerate(result.requests):
        if r.status is not Status.FINISHED or r.max_tokens == 1:
            assert np.isnan(t["start_s"][i])
            continue
        times = result.tokens_of(i)
        assert t["start_s"][i] == r.first_token_s == times[0]
        assert t["end_s"][i] > t["start_s"][i]
        assert times[1] >= t["end_s"][i] + 1.0  # a whole decode step after the KV arrived
        assert result.replica_of[i] < p <= t["decode_replica"][i]
    for record in result.replicas:
        if record.role == "prefill":
            assert not record.steps.num_decode_tokens.any()
        elif not record.num_preemptions:
            assert not record.steps.num_prefill_tokens.any()
