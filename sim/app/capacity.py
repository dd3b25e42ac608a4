"""Capacity: the highest request rate (a scale of the trace's arrival rate) that meets the SLOs.

Sarathi-Serve's definition by default: the P99 time between tokens (TBT, every inter-token
gap) within the SLO and the median scheduling delay at most 2 s; which latencies, their limits
and both quantiles are options.

One search per configuration (policy x budget x ...), all advancing together one probe per
round so that a round's probes run in parallel:

    bracket: start at scale 1; double while it passes, halve while it fails
    bisect:  between the highest passing and the lowest failing scale, until they are within
             the relative tolerance

It assumes that meeting the SLOs is monotone in the rate. Probes are ordinary sweep rows, kept
in DIR/probes.parquet, so a search resumes (or reruns with another SLO) without replaying any
probe twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from sim.config import parse_slo
from sim.errors import ServesimError

# SLO keys (sim.config.SLO_KEYS, the same as replay's --slo): the metric each limits.
SLO_METRICS = {"tbt": "itl", "ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "delay": "scheduling_delay"}


@dataclass(frozen=True)
class CapacitySLO:
    """Limits in seconds (None: not constrained); latencies at `quantile`, the scheduling delay at
    `delay_quantile`."""

    tbt: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    delay: float | None = 2.0
    quantile: float = 0.99
    delay_quantile: float = 0.5

    def __post_init__(self) -> None:
        for key in SLO_METRICS:
            value = getattr(self, key)
            if value is not None and not (value > 0 and not math.isnan(value)):
                raise ServesimError(f"--slo {key} must be a positive number of seconds, got {value}")
        for name, value in (("--quantile", self.quantile), ("--delay-quantile", self.delay_quantile)):
            if not 0 < value <= 1:
                raise ServesimError(f"{name} must be in (0, 1], got {value}")
        if all(getattr(self, key) is None for key in SLO_METRICS):
            raise ServesimError("--slo constrains nothing; give at least one limit, e.g. tbt=0.1")

    @classmethod
    def parse(cls, text: str | None, quantile: float = 0.99, delay_quantile: float = 0.5) -> "CapacitySLO":
        """'tbt=0.1,delay=2' (seconds); delay=none drops the scheduling-delay limit."""
        if not text or not text.strip():
            raise ServesimError("sim capacity needs --slo, e.g. --slo tbt=0.1 (P99 time between tokens "
                                "<= 100 ms; the median scheduling delay <= 2 s is added by default)")
        return cls(**parse_slo(text), quantile=quantile, delay_quantile=delay_quantile)

    def limits(self) -> dict[str, tuple[float, float]]:
        """key -> (limit in seconds, quantile), for the limits that are set."""
        return {key: (getattr(self, key), self.delay_quantile if key == "delay" else self.quantile)
                for key in SLO_METRICS if getattr(self, key) is not None}

    def describe(self) -> str:
        return ", ".join(f"p{q * 100:g} {key} <= {limit:g} s" for key, (limit, q) in self.limits().items())

    def measure(self, row: dict) -> dict[str, float | None]:
        """Each limited latency of a sweep row at its quantile (None when the run has no such latency). TBT is
        the client's where vLLM's API server streams tokens N at a time (--stream-interval above 1): every gap
        between the chunks it receives (`client_itl`), as replay's goodput judges a tbt limit."""
        from reports.digest import sketch_quantile

        measured = {}
        for key, (_, q) in self.limits().items():
            chunks = row.get("client_itl_quantiles") if key == "tbt" else None
            sketch = chunks if isinstance(chunks, (list, np.ndarray)) else row.get(f"{SLO_METRICS[key]}_quantiles")
            measured[key] = None if sketch is None else sketch_quantile(sketch, q)
        return measured

    def is_met(self, row: dict) -> bool:
        """A run meets the SLOs when it completed requests and every measured latency is within its limit;
        a latency with no values (TBT of one-token outputs) constrains nothing."""
        if row.get("status") != "ok" or not row.get("completed"):
            return False
        measured = self.measure(row)
        return all(value is None or value <= self.limits()[key][0] for key, value in measured.items())


BURST_S = 1e-6  # a trace compressed into a microsecond arrives as one burst: far below any step's time
UNBOUNDED = "unbounded: the whole trace at once meets the SLO"


def burst_scale(duration_s: float) -> float:
    """The rate scale past which a trace spanning `duration_s` arrives within BURST_S: every higher
    scale replays the same burst of all its requests (a trace whose requests arrive together: 1)."""
    return max(duration_s / BURST_S, 1.0) if math.isfinite(duration_s) and duration_s > 0 else 1.0


@dataclass
class RateSearch:
    """Bracket, then bisect, the rate scale at which a monotone pass/fail test flips."""

    min_scale: float = 1 / 64
    max_scale: float = 64.0
    tolerance: float = 0.02  # stop when (lowest failing - highest passing) <= tolerance * highest passing
    start: float = 1.0
    passed: float | None = None  # highest scale that met the SLOs
    failed: float | None = None  # lowest scale that did not
    probes: list[tuple[float, bool]] = field(default_factory=list)
    error: str | None = None  # a probe failed to run: the search stops
    # The scale past which the whole trace arrives within BURST_S (`burst_scale`): every higher
    # scale replays the same burst, so once it passes there, no queue can be built within the bounds.
    burst_scale: float = math.inf

    def __post_init__(self) -> None:
        if not 0 < self.min_scale <= self.max_scale or not math.isfinite(self.max_scale):
            raise ServesimError(f"--min-rate-scale ({self.min_scale}) must be positive and at most "
                                f"--max-rate-scale ({self.max_scale})")
        if not 0 < self.tolerance < 1:
            raise ServesimError(f"--tolerance must be in (0, 1), got {self.tolerance}")

    def next_scale(self) -> float | None:
        """The next scale to probe, or None when the search is over."""
        if self.error is not None:
            return None
        if self.passed is None and self.failed is None:
            return min(max(self.start, self.min_scale), self.max_scale)
        if self.failed is None:
            if self.passed >= self.max_scale or self.passed >= self.burst_scale:
                return None
            return min(self.passed * 2, self.max_scale)
        if self.passed is None:
            return None if self.failed <= self.min_scale else max(self.failed / 2, self.min_scale)
        if self.failed - self.passed <= self.tolerance * self.passed:
            return None
        return (self.passed + self.failed) / 2

    def record(self, scale: float, is_met: bool) -> None:
        self.probes.append((scale, is_met))
        if is_met:
            self.passed = scale if self.passed is None else max(self.passed, scale)
        else:
            self.failed = scale if self.failed is None else min(self.failed, scale)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "error"
        if self.failed is None:
            if self.passed is not None and self.passed >= self.burst_scale and self.passed < self.max_scale:
                return UNBOUNDED
            return "at or above --max-rate-scale"
        if self.passed is None:
            return "below --min-rate-scale"
        return "ok"


def find_capacity(is_met: Callable[[float], bool], search: RateSearch) -> RateSearch:
    """Run one search to the end with a pass/fail test of the rate scale (for tests and scripts)."""
    while (scale := search.next_scale()) is not None:
        search.record(scale, is_met(scale))
    return search


def search_all(configs: list, make_probe: Callable, run_probes: Callable, is_met: Callable[[dict], bool],
               make_search: Callable[[], RateSearch],
               on_round: Callable[[int, int], None] | None = None) -> list[tuple[RateSearch, dict[float, dict]]]:
    """Search every configuration at once, one probe per open search per round.

    make_probe(config, scale) -> a sweep Point; run_probes(points) -> {point key: row};
    is_met(row) -> bool. Returns, per config, its search and its probe rows by scale."""
    searches = [make_search() for _ in configs]
    rows: list[dict[float, dict]] = [{} for _ in configs]
    round_index = 0
    while True:
        wanted = [(i, scale) for i, search in enumerate(searches) if (scale := search.next_scale()) is not None]
        if not wanted:
            return list(zip(searches, rows))
        points = [make_probe(configs[i], scale) for i, scale in wanted]
        results = run_probes(points)
        for (i, scale), point in zip(wanted, points):
            row = results[point.key]
            rows[i][scale] = row
            if row["status"] != "ok":  # a probe that could not run ends that search; its error is reported
                searches[i].error = f"rate scale {scale:g}: {row['error']}"
                continue
            searches[i].record(scale, is_met(row))
        round_index += 1
        if on_round is not None:
            on_round(round_index, sum(search.next_scale() is not None for search in searches))
