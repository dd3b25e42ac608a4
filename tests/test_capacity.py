"""Capacity search: the bracket-and-bisect search, the SLO criterion, and a known answer end to end."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest

from reports.digest import QUANTILES
from sim.app.capacity import CapacitySLO, RateSearch, find_capacity
from sim.app.cli import main
from sim.errors import ServesimError

pytest.importorskip("pyarrow")


@pytest.mark.parametrize("threshold", [0.3, 1.0, 3.7, 20.0])
def test_search_brackets_then_bisects_to_the_threshold(threshold):
    search = find_capacity(lambda scale: scale <= threshold, RateSearch(tolerance=0.01))
    assert search.status == "ok"
    assert search.passed <= threshold < search.failed
    assert search.failed - search.passed <= 0.01 * search.passed
    assert search.probes[0] == (1.0, threshold >= 1.0)  # it starts at the trace's own rate
    assert len(search.probes) <= 14


def test_search_stops_at_its_bounds():
    above = find_capacity(lambda scale: True, RateSearch(min_scale=0.25, max_scale=8))
    assert above.passed == 8 and above.failed is None and above.status == "at or above --max-rate-scale"
    assert [scale for scale, _ in above.probes] == [1, 2, 4, 8]
    below = find_capacity(lambda scale: False, RateSearch(min_scale=0.25, max_scale=8))
    assert below.passed is None and below.status == "below --min-rate-scale"
    assert [scale for scale, _ in below.probes] == [1, 0.5, 0.25]


def test_sarathi_serve_definition_is_the_default():
    slo = CapacitySLO.parse("tbt=0.1")
    assert slo.limits() == {"tbt": (0.1, 0.99), "delay": (2.0, 0.5)}
    assert CapacitySLO.parse("itl=0.1,delay=none", quantile=0.9).limits() == {"tbt": (0.1, 0.9)}
    assert CapacitySLO.parse("ttft=1,scheduling_delay=5", delay_quantile=0.99).limits() == {
        "ttft": (1.0, 0.99), "delay": (5.0, 0.99)}


def _row(itl: np.ndarray, delay: np.ndarray) -> dict:
    def sketch(values):
        return np.percentile(values, QUANTILES).tolist()

    return {"status": "ok", "completed": 10, "itl_quantiles": sketch(itl), "scheduling_delay_quantiles": sketch(delay)}


def test_criterion_reads_the_quantiles():
    slo = CapacitySLO.parse("tbt=0.1")
    itl = np.linspace(0.0, 0.2, 1001)  # p99 = 0.198
    assert not slo.is_met(_row(itl, np.zeros(10)))
    assert slo.is_met(_row(itl / 2, np.zeros(10)))  # p99 = 0.099
    assert slo.measure(_row(itl, np.zeros(10)))["tbt"] == pytest.approx(0.198)
    delay = np.array([0.0] * 5 + [3.0] * 5)  # median 1.5 s
    assert slo.is_met(_row(itl / 2, delay))
    assert not slo.is_met(_row(itl / 2, delay + 1))  # median 2.5 s
    assert not slo.is_met({"status": "error", "completed": None})
    one_token = {"status": "ok", "completed": 5, "itl_quantiles": None, "scheduling_delay_quantiles": [0.0] * len(QUANTILES)}
    assert slo.is_met(one_token)  # no gap between tokens: nothing violates the TBT limit


@pytest.mark.parametrize("text, fragment", [
    (None, "sim capacity needs --slo"),
    ("tbt", "cannot read 'tbt'"),
    ("latency=1", "cannot read 'latency=1'"),
    ("tbt=fast", "tbt value 'fast' is not a number"),
    ("tbt=-1", "--slo tbt must be a number from 1e-06 to 1e+09 s, got -1"),
    ("delay=none", "constrains nothing"),
])
def test_bad_slos(text, fragment):
    with pytest.raises(ServesimError, match=re.escape(fragment)):
        CapacitySLO.parse(text)


def test_bad_quantiles_and_bounds():
    with pytest.raises(ServesimError, match="--quantile must be in"):
        CapacitySLO.parse("tbt=0.1", quantile=99)
    with pytest.raises(ServesimError, match="--min-rate-scale"):
        RateSearch(min_scale=4, max_scale=2)
    with pytest.raises(ServesimError, match="--tolerance"):
        RateSearch(tolerance=0)


def _service_seconds(prompt_tokens: int) -> float:
    """The time of one step that prefills one whole prompt (the cost model is deterministic)."""
    from sim.app.plan import resolve
    from sim.app.replay import ReplayOptions, replay
    from sim.config import CacheConfig, SchedulerConfig
    from tests.helpers import make_trace

    options = ReplayOptions(scheduler=SchedulerConfig("chunked", prompt_tokens, 1),
                            cache=CacheConfig(enable_prefix_caching=False))
    result = replay(make_trace([(0.0, prompt_tokens, 1)]), resolve(options))
    assert len(result.steps) == 1
    return float(result.requests[0].first_token_s)


def test_capacity_of_a_single_server_queue_is_the_known_answer(tmp_path, capsys):
    """101 one-token requests of 1024 prompt tokens, one at a time (max_num_seqs 1, budget 1024):
    a D/D/1 queue with service time s. Arrivals every a = d / x seconds; when a < s, request i
    waits i (s - a), so the median (i = 50) delay is 50 (s - d / x). With the limit D = s the
    highest passing scale is x* = d / (s - s / 50) = (50 / 49) (d / s); here d = 2 s."""
    s = _service_seconds(1024)
    d = 2 * s
    rows = "\n".join(f"{i * d!r},1024,1" for i in range(101))
    trace = tmp_path / "queue.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n" + rows + "\n")
    out = tmp_path / "capacity"
    assert main(["capacity", str(trace), "--policy", "chunked,prefill-first", "--max-num-batched-tokens", "1024",
                 "--max-num-seqs", "1", "--no-prefix-caching", "--slo", f"delay={s!r}", "--tolerance", "0.01",
                 "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    capacity = pd.read_csv(out / "capacity.csv")
    expected = 50 / 49 * d / s
    assert list(capacity["policy"]) == ["chunked", "prefill-first"]
    for _, row in capacity.iterrows():
        assert row["status"] == "ok"
        assert row["capacity_rate_scale"] <= expected < row["lowest_failing_rate_scale"]
        assert row["lowest_failing_rate_scale"] - row["capacity_rate_scale"] <= 0.01 * row["capacity_rate_scale"]
        # The rate is the scale times the trace's own: 101 requests over 100 d seconds.
        assert row["capacity_request_rate"] == pytest.approx(row["capacity_rate_scale"] * 101 / (100 * d))
        assert row["delay_at_capacity"] <= s
    html = (out / "report.html").read_text()
    assert "Capacity per policy and budget" in html and "Latency CDFs at capacity" in html

    # Rerun with a tighter SLO: the probes already run are reused, and --resume is required.
    assert main(["capacity", str(trace), "--policy", "chunked,prefill-first", "--max-num-batched-tokens", "1024",
                 "--max-num-seqs", "1", "--no-prefix-caching", "--slo", f"delay={s / 2!r}",
                 "--out", str(out), "--jobs", "1", "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["capacity", str(trace), "--policy", "chunked,prefill-first", "--max-num-batched-tokens", "1024",
                 "--max-num-seqs", "1", "--no-prefix-caching", "--slo", f"delay={s / 2!r}", "--tolerance", "0.01",
                 "--out", str(out), "--jobs", "1", "--quiet", "--resume"]) == 0
    tighter = pd.read_csv(out / "capacity.csv")
    # Limit s/2: x* = d / (s - s / 100) = (100 / 99) (d / s).
    assert (tighter["capacity_rate_scale"] <= 100 / 99 * d / s).all()
    assert (100 / 99 * d / s < tighter["lowest_failing_rate_scale"]).all()


def test_served_share_tells_a_growing_queue_from_a_trace_that_drains():
    """Finished requests over the busy time (less the mean request's own span) over the arrival rate:
    about 1 when the server keeps up; the figures of the Azure sample's first 300 requests at 4x and
    7.625x the rate (probes.parquet), whose whole-trace replays hold and miss a 0.5 s p99 TTFT."""
    from sim.app.capacity_cli import SERVED_SHARE, served_share

    kept_up = {"completed": 300, "duration_s": 25.716783, "e2e_mean": 3.567502, "request_rate": 14.280767}
    falling_behind = {"completed": 300, "duration_s": 18.1038, "e2e_mean": 5.173316, "request_rate": 27.222711}
    assert served_share(kept_up) == pytest.approx(0.948, abs=1e-3) and served_share(kept_up) > SERVED_SHARE
    assert served_share(falling_behind) == pytest.approx(0.852, abs=1e-3) and served_share(falling_behind) < SERVED_SHARE
    assert served_share({"completed": 0, "duration_s": 0.0, "e2e_mean": None, "request_rate": 1.0}) is None
