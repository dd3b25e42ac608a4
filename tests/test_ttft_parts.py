"""TTFT in parts (reports/outcomes.py: ttft_parts; docs/async-scheduling.md): the API server's share, queueing,
the wait for the GPU and the prefill, from each request's timestamps. The parts add up to the TTFT exactly;
requests.csv, summary.json, the terminal summary and the report carry them. Requests are built by hand."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reports.html import ttft_parts_figure
from reports.metrics import format_summary, summarize
from reports.outcomes import REQUEST_COLUMNS, TTFT_PARTS, RequestOutcomes, ttft_parts
from reports.run_tables import TableWriter
from sim.request import Request, Status


class TimedRequest(Request):
    """A request with the timestamps the engine will record (first_step_start_s, client_sent_s)."""


def request(index, arrival, scheduled, start, first_token, finish, sent=None, tokens=4):
    r = TimedRequest(index, f"r{index}", arrival, 10, tokens)
    r.status, r.first_scheduled_s, r.first_token_s, r.finish_s = Status.FINISHED, scheduled, first_token, finish
    r.first_step_start_s, r.client_sent_s = start, sent
    return r


def parts_of(arrival, scheduled, start, first_token, sent):
    arr = lambda x: np.array([math.nan if x is None else x], dtype=np.float64)  # noqa: E731
    return {k: float(v[0]) for k, v in ttft_parts(arr(arrival), arr(scheduled), arr(start), arr(first_token),
                                                  arr(sent)).items()}


def test_worked_example_through_an_api_server():
    # Sent at 0.5, reaches the engine at 1.0, first scheduled at 1.5, its step starts on the GPU at 1.75,
    # first token at 2.25: API server 0.5, queue 0.5, wait 0.25, prefill 0.5; client TTFT 1.75.
    p = parts_of(1.0, 1.5, 1.75, 2.25, 0.5)
    assert p == {"ttft_api_server_s": 0.5, "ttft_queue_s": 0.5, "ttft_async_wait_s": 0.25, "ttft_prefill_s": 0.5,
                 "client_ttft_s": 1.75}


def test_worked_example_without_client_or_step_start():
    # No API server: its share and the client TTFT are NaN. No step start recorded (today's engine, or
    # synchronous scheduling without host time): the wait is 0 and the prefill runs from the first scheduling.
    p = parts_of(2.0, 3.0, None, 3.5, None)
    assert math.isnan(p["ttft_api_server_s"]) and math.isnan(p["client_ttft_s"])
    assert (p["ttft_queue_s"], p["ttft_async_wait_s"], p["ttft_prefill_s"]) == (1.0, 0.0, 0.5)


def test_unfinished_request_has_no_parts_beyond_its_times():
    p = parts_of(2.0, None, None, None, None)
    assert all(math.isnan(v) for v in p.values())


times = st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False)
gaps = st.one_of(st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False),
                 st.builds(math.ldexp, st.floats(0.5, 1.0), st.integers(-60, 20)))  # magnitudes far apart


@pytest.mark.slow
@settings(max_examples=1000)
@given(st.lists(st.tuples(times, gaps, gaps, gaps, gaps, st.booleans(), st.booleans()), min_size=1, max_size=20))
def test_parts_add_up_to_ttft_exactly(rows):
    sent = np.array([t for t, *_ in rows])
    arrival = sent + np.array([a for _, a, *_ in rows])
    scheduled = arrival + np.array([q for _, _, q, *_ in rows])
    start = scheduled + np.array([w for _, _, _, w, *_ in rows])
    first_token = start + np.array([p for _, _, _, _, p, *_ in rows])
    through_server = np.array([c for *_, c, _ in rows])
    has_start = np.array([s for *_, s in rows])
    client_sent = np.where(through_server, sent, np.nan)
    step_start = np.where(has_start, start, np.nan)
    parts = ttft_parts(arrival, scheduled, step_start, first_token, client_sent)
    ttft = first_token - arrival
    for i in range(len(rows)):
        api = parts["ttft_api_server_s"][i]
        total = parts["client_ttft_s"][i] if through_server[i] else ttft[i]
        lead = api if through_server[i] else 0.0
        assert ((lead + parts["ttft_queue_s"][i]) + parts["ttft_async_wait_s"][i]) + parts["ttft_prefill_s"][i] == total
        # Each part is its own difference of timestamps, to within a few units in the last place of the total
        # (exactly, but where the rounding of the sum must be absorbed: parts of very different magnitudes).
        ulp = 4 * np.spacing(total)
        wait = (start[i] if has_start[i] else scheduled[i]) - scheduled[i]
        assert abs(parts["ttft_queue_s"][i] - (scheduled[i] - arrival[i])) <= ulp
        assert abs(parts["ttft_async_wait_s"][i] - wait) <= ulp
        if through_server[i]:
            assert abs(api - (arrival[i] - sent[i])) <= ulp and parts["client_ttft_s"][i] == first_token[i] - sent[i]
        else:
            assert math.isnan(api)


def test_requests_csv_summary_and_report(tmp_path):
    requests = [request(0, 1.0, 1.5, 1.75, 2.25, 3.0, sent=0.5),
                request(1, 2.0, 2.0, 2.5, 3.5, 4.0, sent=1.0),
                request(2, 3.0, 4.0, None, 4.5, 5.0)]  # no client, no step start
    outcomes = RequestOutcomes(writer=TableWriter(tmp_path / "requests.csv", "csv"))
    for position in (1, 0, 2):  # out of order, as requests finish
        r = requests[position]
        outcomes.add(position, r, [r.first_token_s, r.finish_s])
    outcomes.close()
    table = pd.read_csv(tmp_path / "requests.csv")
    assert list(table.columns) == list(REQUEST_COLUMNS)
    assert table["ttft_api_server_s"].tolist()[:2] == [0.5, 1.0] and math.isnan(table["ttft_api_server_s"][2])
    assert table["ttft_queue_s"].tolist() == [0.5, 0.0, 1.0]
    assert table["ttft_async_wait_s"].tolist() == [0.25, 0.5, 0.0]
    assert table["ttft_prefill_s"].tolist() == [0.5, 1.0, 0.5]
    assert table["client_ttft_s"].tolist()[:2] == [1.75, 2.5]
    assert table["ttft_s"].tolist() == [1.25, 1.5, 1.5]

    result = SimpleNamespace(num_preemptions=0, end_s=5.0, steps=[], num_prefix_hit_tokens=0,
                             num_prefix_queried_tokens=0)
    summary = json.loads(json.dumps(summarize(result, outcomes, {})))
    assert summary["ttft_api_server"]["mean"] == pytest.approx(0.75)  # the two requests through the server
    assert summary["ttft_queue"]["mean"] == pytest.approx(0.5)
    assert summary["ttft_async_wait"]["mean"] == pytest.approx(0.25)
    assert summary["ttft_prefill"]["mean"] == pytest.approx(2.0 / 3)
    text = format_summary(summary)
    assert "  queueing" in text and "  wait for the GPU" in text and "  prefill" in text and "  API server" in text

    row = {f"{name}_mean": summary[name]["mean"] for name in TTFT_PARTS}
    figure = ttft_parts_figure(row)
    assert [bar["name"] for bar in figure["data"]] == ["API server", "queueing", "wait for the GPU", "prefill"]
    assert [bar["x"][0] for bar in figure["data"]] == pytest.approx([750.0, 500.0, 250.0, 2000.0 / 3])
    assert figure["layout"]["barmode"] == "stack"


def test_no_api_server_leaves_its_share_out_of_the_summary(tmp_path):
    outcomes = RequestOutcomes()
    outcomes.add(0, request(0, 1.0, 1.5, None, 2.0, 3.0), [2.0, 3.0])
    outcomes.close()
    result = SimpleNamespace(num_preemptions=0, end_s=3.0, steps=[], num_prefix_hit_tokens=0,
                             num_prefix_queried_tokens=0)
    summary = summarize(result, outcomes, {})
    assert "ttft_api_server" not in summary
    assert summary["ttft_queue"]["mean"] == 0.5 and summary["ttft_prefill"]["mean"] == 0.5
    assert ttft_parts_figure({}) is None


def test_parts_of_far_apart_magnitudes_still_add_up():
    """Here total - (queue + wait) does not make the sum exact (its rounding lands off the total): the parts
    move by a few units in the last place until it does."""
    arrival, scheduled, start, first_token = 215867486.67816693, 215867486.67816705, 215883469.27431187, 573711340.158832
    queue, wait = scheduled - arrival, start - scheduled
    ttft = first_token - arrival
    assert (queue + wait) + (ttft - (queue + wait)) != ttft  # the plain subtraction is off
    p = parts_of(arrival, scheduled, start, first_token, None)
    assert (p["ttft_queue_s"] + p["ttft_async_wait_s"]) + p["ttft_prefill_s"] == ttft
    assert abs(p["ttft_queue_s"] - queue) <= 4 * np.spacing(ttft) and abs(p["ttft_async_wait_s"] - wait) <= 4 * np.spacing(ttft)


# vLLM's API server in front of a replay's engine (sim/arrivals.py through_api_servers; `--api-server`).

def test_worked_example_of_the_api_servers_queue():
    from sim.arrivals import through_api_servers

    sent = np.array([0.0, 0.0, 0.0, 1.0, 1.0])
    cost = np.array([0.1, 0.2, 0.3, 0.1, 0.1])
    # One server: each waits for the one before it (0.1, 0.1 + 0.2, 0.3 + 0.3), then idle until 1.0.
    assert through_api_servers(sent, cost).tolist() == pytest.approx([0.1, 0.3, 0.6, 1.1, 1.2])
    # Two: the first two at once, the third on the server free first (at 0.1).
    assert through_api_servers(sent, cost, 2).tolist() == pytest.approx([0.1, 0.2, 0.4, 1.1, 1.1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 0.5)), min_size=1, max_size=40), st.integers(1, 4))
def test_api_servers_serve_in_send_order_each_one_at_a_time(rows, servers):
    """As a plain simulation of the servers: a request reaches the engine no sooner than its send plus
    its own time; with one server, exactly the later of its send and the one before's arrival, plus its
    time; more servers never deliver a request later."""
    from sim.arrivals import through_api_servers

    sent = np.sort(np.array([r[0] for r in rows]))
    cost = np.array([r[1] for r in rows])
    arrival = through_api_servers(sent, cost, servers)
    assert (arrival >= sent + cost - 1e-9).all()
    free, expected = [0.0] * servers, []
    for s, c in zip(sent.tolist(), cost.tolist()):
        k = min(range(servers), key=lambda j: free[j])
        free[k] = max(free[k], s) + c
        expected.append(free[k])
    assert arrival.tolist() == pytest.approx(expected, abs=1e-9)
    assert (through_api_servers(sent, cost, servers + 1) <= arrival + 1e-9).all()


@pytest.mark.parametrize("dp, version, servers", [(1, None, 1), (4, None, 4), (4, "0.15.0", 4), (4, "0.14.1", 1),
                                                  (2, "0.12.0", 1)])
def test_one_api_server_per_data_parallel_rank_from_vllm_0_15(dp, version, servers):
    from sim.app.options import ReplayOptions
    from sim.app.replay import api_server_count

    assert api_server_count(ReplayOptions(dp=dp, vllm_version=version)) == servers


def test_a_clusters_replicas_each_bring_their_api_server():
    from sim.app.cluster_options import ClusterOptions
    from sim.app.options import ReplayOptions
    from sim.app.replay import api_server_count

    assert api_server_count(ReplayOptions(cluster=ClusterOptions(num_replicas=3))) == 3
    disaggregated = ClusterOptions(num_prefill_replicas=2, num_decode_replicas=5)
    assert api_server_count(ReplayOptions(cluster=disaggregated)) == 2


def test_api_server_applies_to_a_clients_sends_only_unless_asked():
    from sim.app.options import ReplayOptions
    from sim.app.replay import with_api_server
    from traces.trace import Trace

    trace = Trace(np.array([0.0, 0.0]), np.array([500, 1000]), np.array([4, 4]), format="azure")
    assert with_api_server(trace, ReplayOptions()) is trace  # an Azure trace's times are the engine's arrivals
    on = with_api_server(trace, ReplayOptions(api_server="on"))
    assert on.client_sent_s.tolist() == [0.0, 0.0]
    assert on.arrival_s.tolist() == pytest.approx([2e-3, 2e-3 + 3e-3])  # 1 ms + 2 us a token, one after the other
    assert with_api_server(on, ReplayOptions(api_server="on")) is on  # applied once
    bench = Trace(np.array([0.0]), np.array([100]), np.array([4]), format="vllm-bench")
    assert with_api_server(bench, ReplayOptions(api_server="off")) is bench
    assert with_api_server(bench, ReplayOptions()).arrival_s.tolist() == pytest.approx([1.2e-3])
