"""Per-request and per-step tables and the run summary, with vLLM's serving-benchmark definitions.

- TTFT: arrival to first token. E2E: arrival to last token.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- ITL: every gap between consecutive tokens of a request, all requests pooled.
- Scheduling delay: arrival to the first step that scheduled the request.
- Throughputs divide by the duration: first arrival (or the benchmark's start) to last finish.
- Goodput: completed requests meeting every SLO, per second of duration.
Percentiles interpolate linearly (numpy's default, as vLLM's benchmark does).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sim.config import SLO
from sim.engine import SimResult
from sim.request import Status
from sim.step_log import STEP_COLUMNS

METRICS = ("ttft", "tpot", "itl", "e2e", "scheduling_delay")


def requests_table(result: SimResult) -> pd.DataFrame:
    rows = result.requests
    frame = pd.DataFrame({
        "request_id": [r.request_id for r in rows],
        "arrival_s": [r.arrival_s for r in rows],
        "prompt_tokens": [r.num_prompt_tokens for r in rows],
        "output_tokens": [r.max_tokens for r in rows],
        "status": [r.status.value for r in rows],
        "first_scheduled_s": [r.first_scheduled_s for r in rows],
        "first_token_s": [r.first_token_s for r in rows],
        "finish_s": [r.finish_s for r in rows],
        "num_preemptions": [r.num_preemptions for r in rows],
        "prefix_hit_tokens": [r.num_prefix_hit_tokens for r in rows],
        "reject_reason": [r.reject_reason or "" for r in rows],
    })
    frame["ttft_s"] = frame["first_token_s"] - frame["arrival_s"]
    frame["e2e_s"] = frame["finish_s"] - frame["arrival_s"]
    multi = frame["output_tokens"] > 1
    frame["tpot_s"] = ((frame["e2e_s"] - frame["ttft_s"]) / (frame["output_tokens"] - 1)).where(multi)
    frame["scheduling_delay_s"] = frame["first_scheduled_s"] - frame["arrival_s"]
    return frame


def inter_token_latencies(result: SimResult) -> np.ndarray:
    """Every gap between consecutive tokens of finished requests. Each request's token times are
    a contiguous run of `token_times`; a gap that crosses from one request to the next is dropped,
    and the requests that emitted nothing (rejected) have only missing times."""
    gaps = np.diff(result.token_times)
    crossing = result.token_offsets[1:] - 1
    keep = np.ones(len(gaps), dtype=bool)
    keep[crossing[crossing >= 0]] = False
    gaps = gaps[keep]
    return gaps[~np.isnan(gaps)]


def longest_token_gaps(result: SimResult) -> np.ndarray:
    """Each request's longest gap between consecutive tokens (NaN with fewer than two tokens), in
    request order: what a time-between-tokens SLO holds a request to."""
    num_tokens = np.array([r.max_tokens for r in result.requests], dtype=np.int64)
    longest = np.full(len(num_tokens), np.nan)
    multi = np.flatnonzero(num_tokens > 1)
    if not len(multi):
        return longest
    gaps = np.diff(result.token_times)
    starts = np.asarray(result.token_offsets[:len(num_tokens)], dtype=np.int64)[multi]
    ends = starts + num_tokens[multi] - 1
    marks = np.zeros(len(gaps) + 1, dtype=np.int64)
    np.add.at(marks, starts, 1)
    np.add.at(marks, ends, -1)
    inside = np.cumsum(marks)[:-1] > 0
    masked = np.where(inside, gaps, -np.inf)
    with np.errstate(invalid="ignore"):
        reduced = np.fmax.reduceat(masked, starts)  # each from its start up to the next start
    longest[multi] = np.where(np.isfinite(reduced), reduced, np.nan)  # a rejected request has no times
    return longest


def steps_table(result: SimResult) -> pd.DataFrame:
    columns = result.steps.columns()
    frame = pd.DataFrame({"step": np.arange(len(result.steps))})
    for name, values in columns.items():
        frame[name if name in STEP_COLUMNS else f"{name}_s"] = values
    return frame


def write_numeric_csv(frame: pd.DataFrame, path, chunk_rows: int = 65536) -> None:
    """`frame.to_csv(path, index=False)` for a table of numbers, byte for byte, about twice as
    fast (the steps table of an hour's replay has half a million rows): each value is written as
    Python's repr, as pandas does. Tables with a missing value or text go through pandas."""
    columns = [frame[name].to_numpy() for name in frame.columns]
    if any(c.dtype.kind not in "iuf" or (c.dtype.kind == "f" and np.isnan(c).any()) for c in columns):
        frame.to_csv(path, index=False)
        return
    with open(path, "w", newline="") as f:
        f.write(",".join(frame.columns) + "\n")
        for start in range(0, len(frame), chunk_rows):
            texts = [map(repr, c[start:start + chunk_rows].tolist()) for c in columns]
            f.writelines(",".join(row) + "\n" for row in zip(*texts))


def _stats(values: np.ndarray) -> dict[str, float | None]:
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(result: SimResult, requests: pd.DataFrame, slo: SLO, options: dict, start_s: float | None = None) -> dict:
    """`start_s`: when the duration starts (a benchmark's start, as vLLM's bench times it); None: the
    first arrival."""
    done = requests[requests["status"] == Status.FINISHED.value]
    rejected = requests[requests["status"] == Status.REJECTED.value]
    start = float(requests["arrival_s"].min()) if start_s is None else start_s
    duration = float(done["finish_s"].max() - start) if len(done) else 0.0
    output_tokens = int(done["output_tokens"].sum())
    prompt_tokens = int(done["prompt_tokens"].sum())

    def per_s(x: float) -> float | None:
        return x / duration if duration > 0 else None

    summary: dict = {
        "num_requests": int(len(requests)),
        "completed": int(len(done)),
        "rejected": int(len(rejected)),
        "preemptions": int(result.num_preemptions),
        "duration_s": duration,
        "simulated_s": float(result.end_s),
        "num_steps": int(len(result.steps)),
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(prompt_tokens + output_tokens),
        # vLLM's PrefixCacheStats: cached tokens over looked-up tokens, at first admissions only.
        "prefix_cache_hit_rate": (result.num_prefix_hit_tokens / result.num_prefix_queried_tokens
                                  if result.num_prefix_queried_tokens else 0.0),
    }
    summary["ttft"] = _stats(done["ttft_s"].to_numpy())
    summary["tpot"] = _stats(done["tpot_s"].to_numpy())
    summary["itl"] = _stats(inter_token_latencies(result))
    summary["e2e"] = _stats(done["e2e_s"].to_numpy())
    summary["scheduling_delay"] = _stats(done["scheduling_delay_s"].to_numpy())
    if slo.is_set:
        good = np.ones(len(done), dtype=bool)
        columns = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "delay": "scheduling_delay_s"}
        for name, limit in slo.limits().items():
            if name == "tbt":
                values = longest_token_gaps(result)[done.index.to_numpy()]
            else:
                values = done[columns[name]].to_numpy()
            good &= np.isnan(values) | (values <= limit)  # TPOT and TBT are undefined for one-token outputs
        summary["slo"] = slo.limits()
        summary["goodput"] = per_s(int(good.sum()))
        summary["slo_attainment"] = float(good.mean()) if len(done) else None
    if len(rejected):
        summary["reject_reasons"] = {k: int(v) for k, v in
                                     rejected["reject_reason"].str.replace(r"\d+", "N", regex=True).value_counts().items()}
    summary["options"] = options
    return summary


def latency_unit(values) -> tuple[str, float]:
    """ms for a table of latencies, or s once one reaches 100 s (an hour reads 3600.0 s, not 3600000.0 ms)."""
    finite = [abs(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return ("s", 1.0) if finite and max(finite) >= 100 else ("ms", 1e3)


def format_summary(summary: dict) -> str:
    """A short table for the terminal."""
    names = ("ttft", "tpot", "itl", "e2e", "scheduling_delay")
    unit, scale = latency_unit([summary[n][q] for n in names for q in ("mean", "p50", "p90", "p99")])

    def ms(x: float | None) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:10.1f}"

    lines = [
        f"requests {summary['completed']} completed, {summary['rejected']} rejected, "
        f"{summary['preemptions']} preemptions, {summary['num_steps']} steps",
        f"duration {summary['duration_s']:.1f} s   throughput {summary['request_throughput'] or 0:.2f} req/s, "
        f"{summary['output_throughput'] or 0:.0f} output tok/s, {summary['total_token_throughput'] or 0:.0f} tok/s",
    ]
    if summary.get("prefix_cache_hit_rate"):
        lines.append(f"prefix cache hit rate {summary['prefix_cache_hit_rate']:.1%}")
    if "goodput" in summary:
        lines.append(f"goodput {summary['goodput'] or 0:.2f} req/s ({(summary['slo_attainment'] or 0):.1%} within SLO "
                     + ", ".join(f"{k}<={v}s" for k, v in summary["slo"].items()) + ")")
    lines.append(f"{f'metric ({unit})':<18}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in names:
        s = summary[name]
        lines.append(f"{name:<18}{ms(s['mean'])}{ms(s['p50'])}{ms(s['p90'])}{ms(s['p99'])}")
    return "\n".join(lines)
