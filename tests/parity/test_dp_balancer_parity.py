"""servesim's DP load balancer (sim/data_parallel.py DPLoadBalancer) against vLLM 0.33's and 0.34's own
DPLBAsyncMPClient.get_core_engine_for_request (vllm/v1/engine/core_client.py), called on a stand-in
client that holds only the fields it reads: the same snapshots, in-flight counts and request
order give the same ranks, the same local waiting increments and the same scan start.

Skipped where vLLM is not installed (the `parity` extra: see the README).
"""

from __future__ import annotations

import os
import random
from collections import Counter
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is first imported
core_client = pytest.importorskip("vllm.v1.engine.core_client", reason="vLLM is not installed (pip install '.[parity]')")

from sim.data_parallel import DPLoadBalancer  # noqa: E402


class Rank:
    def __init__(self) -> None:
        self.num_in_flight = 0


@pytest.mark.parametrize("seed", range(20))
def test_same_choices_as_vllm(seed):
    rng = random.Random(seed)
    dp = rng.choice([2, 3, 4, 8])
    engines = [f"engine-{i}".encode() for i in range(dp)]
    client = SimpleNamespace(reqs_in_flight={}, streaming_reqs=set(), engine_inflight=Counter(), core_engines=engines,
                             lb_engines=[[0, 0, 0.0] for _ in range(dp)], eng_start_index=0, client_count=1)
    ours = DPLoadBalancer(dp)
    ranks = [Rank() for _ in range(dp)]
    in_flight: dict[str, int] = {}
    for n in range(200):
        event = rng.random()
        if event < 0.15:  # a coordinator snapshot replaces both clients' counts
            snapshot = [[rng.randint(0, 6), rng.randint(0, 10), rng.choice([0.0, 0.3, 0.6, 0.9, 1.0])]
                        for _ in range(dp)]
            client.lb_engines = [list(c) for c in snapshot]
            ours.lb_engines = [list(c) for c in snapshot]
        elif event < 0.35 and in_flight:  # a request finishes (process_engine_outputs)
            request_id = rng.choice(sorted(in_flight))
            rank = in_flight.pop(request_id)
            engine = client.reqs_in_flight.pop(request_id)
            client.engine_inflight[engine] -= 1
            ranks[rank].num_in_flight -= 1
        request = SimpleNamespace(request_id=str(n), resumable=False, data_parallel_rank=None, pooling_params=None)
        chosen = core_client.DPLBAsyncMPClient.get_core_engine_for_request(client, request)
        rank = ours.route(None, ranks)
        assert engines[rank] == chosen
        ranks[rank].num_in_flight += 1
        in_flight[str(n)] = rank
        assert ours.lb_engines == client.lb_engines and ours.eng_start_index == client.eng_start_index
