"""Per-request and per-step tables and the run summary, with vLLM's serving-benchmark definitions.

- TTFT: arrival to first token. E2E: arrival to last token.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- ITL: every gap between consecutive tokens of a request, all requests pooled (the engine's). With vLLM's
  --stream-interval N > 1, `client_itl`: every gap between the chunks a streaming client receives
  (reports.outcomes.stream_chunk_times), as vLLM's bench records ITL; TTFT, TPOT and E2E are the same.
- Scheduling delay: arrival to the first step that scheduled the request.
- Throughputs divide by the duration: first arrival (or the benchmark's start) to last finish.
- Goodput: completed requests meeting every SLO, per second of duration.
Percentiles interpolate linearly (numpy's default, as vLLM's benchmark does); they come from the
streaming sketches of reports.quantiles, exact while a metric has at most EXACT_LIMIT values.

The summary is built from streamed outcomes (reports.outcomes); the whole-table helpers below
(requests_table, steps_table, inter_token_latencies, longest_token_gaps) serve in-memory results
(tests, sim compare, sim bench). pandas is imported only by those.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from reports import cluster
from reports.outcomes import TTFT_PART_LABELS, TTFT_PARTS, RequestOutcomes, ttft_parts
from sim.cluster import ClusterResult
from sim.engine import SimResult
from sim.step_log import STEP_COLUMNS

METRICS = ("ttft", "tpot", "itl", "e2e", "scheduling_delay")


def requests_table(result: SimResult):
    """Every request of an in-memory result as a DataFrame (the columns of reports.outcomes)."""
    import pandas as pd

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
    parts = ttft_parts(frame["arrival_s"].to_numpy(np.float64), frame["first_scheduled_s"].to_numpy(np.float64),
                       np.array([_time(r, "first_step_start_s") for r in rows], dtype=np.float64),
                       frame["first_token_s"].to_numpy(np.float64),
                       np.array([_time(r, "client_sent_s") for r in rows], dtype=np.float64),
                       frame["ttft_s"].to_numpy(np.float64))
    for name, values in parts.items():
        frame[name] = values
    if is_cluster(result):
        for name, values in cluster.request_columns(result).items():
            frame[name] = values
    return frame


def _time(request, name: str) -> float:
    """A request's timestamp that the engine may not record (NaN when absent or None)."""
    value = getattr(request, name, None)
    return math.nan if value is None else value


def is_cluster(result: SimResult) -> bool:
    """A run of more than one replica (one replica's files are a lone engine's)."""
    return isinstance(result, ClusterResult) and len(result.replicas) > 1


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


def steps_table(result: SimResult):
    import pandas as pd

    return pd.DataFrame(steps_columns(result))


def steps_columns(result: SimResult) -> dict[str, np.ndarray]:
    """The steps table of an in-memory result as columns (see step_table_columns); a cluster's
    steps say which replica ran each."""
    columns = step_table_columns(result.steps.columns())
    if is_cluster(result):
        columns = {"step": columns.pop("step"), "replica": result.steps.replica, **columns}
    return columns


def step_table_columns(log_columns: dict[str, np.ndarray], first_step: int = 0) -> dict[str, np.ndarray]:
    """Steps from the step log as the steps table's columns: step, STEP_COLUMNS, then the backend's
    breakdown keys with `_s`."""
    num_steps = len(log_columns["start_s"])
    columns = {"step": np.arange(first_step, first_step + num_steps)}
    for name, values in log_columns.items():
        columns[name if name in STEP_COLUMNS or name == "dp_rank" else f"{name}_s"] = values  # (a DP group's rank)
    return columns


def write_numeric_csv(frame, path, chunk_rows: int = 65536) -> None:
    """`frame.to_csv(path, index=False)`, byte for byte, about twice as fast for a table of numbers
    (see reports.run_tables)."""
    from reports.run_tables import write_table

    path = Path(path)
    write_table(path.parent, path.name.removesuffix(".csv"), {name: frame[name].to_numpy() for name in frame.columns},
                "csv", chunk_rows)


def _stats(values: np.ndarray) -> dict[str, float | None]:
    """Mean and exact percentiles of a small array (the KV transfers of a cluster run)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(result: SimResult, outcomes: RequestOutcomes, options: dict, start_s: float | None = None) -> dict:
    """The run summary from the engine's totals (`result`) and the streamed request outcomes.
    Percentiles are exact while each metric has at most reports.quantiles.EXACT_LIMIT values.
    `start_s`: when the duration starts (a benchmark's start, as vLLM's bench times it); None: the
    first arrival."""
    duration = outcomes.duration_s(start_s)

    def per_s(x: float) -> float | None:
        return x / duration if duration > 0 else None

    completed = outcomes.num_completed
    summary: dict = {
        "num_requests": outcomes.num_requests,
        "completed": completed,
        "rejected": outcomes.num_rejected,
        "preemptions": int(result.num_preemptions),
        "duration_s": duration,
        "simulated_s": float(result.end_s),
        "num_steps": len(result.steps),
        "total_prompt_tokens": outcomes.total_prompt_tokens,
        "total_output_tokens": outcomes.total_output_tokens,
        "request_throughput": per_s(completed),
        "output_throughput": per_s(outcomes.total_output_tokens),
        "total_token_throughput": per_s(outcomes.total_prompt_tokens + outcomes.total_output_tokens),
        # vLLM's PrefixCacheStats: cached tokens over looked-up tokens, at first admissions only.
        "prefix_cache_hit_rate": (result.num_prefix_hit_tokens / result.num_prefix_queried_tokens
                                  if result.num_prefix_queried_tokens else 0.0),
    }
    for name in METRICS:
        summary[name] = (outcomes.itl if name == "itl" else outcomes.sketches[name]).stats()
    # TTFT in parts (reports.outcomes.ttft_parts); the API server's share only where a client is modelled.
    for name in TTFT_PARTS:
        sketch = outcomes.ttft_part_sketches[name]
        if sketch.count or name != "ttft_api_server":
            summary[name] = sketch.stats()
    for name, sketch in outcomes.client_sketches.items():  # from the client's send: TTFT (the parts' sum), E2E
        if sketch.count:
            summary[name] = sketch.stats()
    if outcomes.stream_interval > 1:  # the gaps between the chunks a streaming client receives (--stream-interval)
        summary["client_itl"] = outcomes.client_itl.stats()
    slo = outcomes.slo
    if slo.is_set:
        summary["slo"] = slo.limits()
        summary["goodput"] = per_s(outcomes.num_good)
        summary["slo_attainment"] = outcomes.num_good / completed if completed else None
    if outcomes.num_rejected:
        summary["reject_reasons"] = outcomes.reject_reason_counts()
    if is_cluster(result):
        summary.update(cluster.summary(result, _stats))
    summary["options"] = options
    return summary


def latency_unit(values) -> tuple[str, float]:
    """ms for a table of latencies, or s once one reaches 100 s (an hour reads 3600.0 s, not 3600000.0 ms)."""
    finite = [abs(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return ("s", 1.0) if finite and max(finite) >= 100 else ("ms", 1e3)


def latency_digits(unit: str) -> int:
    """Decimals of a latency shown in `unit` (latency_unit's): seconds to the millisecond (a TPOT of
    0.061 s beside an hour-long E2E is not 0.1), milliseconds to a tenth."""
    return 3 if unit == "s" else 1


def format_summary(summary: dict) -> str:
    """A short table for the terminal."""
    names = ("ttft", "tpot", "itl", "e2e", "scheduling_delay")
    unit, scale = latency_unit([summary[n][q] for n in names for q in ("mean", "p50", "p90", "p99")])

    def rate(x: float | None, spec: str) -> str:  # None (nothing completed: summary.json's null) as "-", not 0
        return "-" if x is None else format(x, spec)

    digits = latency_digits(unit)

    def ms(x: float | None) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:10.{digits}f}"

    lines = [
        f"requests {summary['completed']} completed, {summary['rejected']} rejected, "
        f"{summary['preemptions']} preemptions, {summary['num_steps']} steps",
        f"duration {summary['duration_s']:.1f} s   throughput {rate(summary['request_throughput'], '.2f')} req/s, "
        f"{rate(summary['output_throughput'], '.0f')} output tok/s, {rate(summary['total_token_throughput'], '.0f')} tok/s",
    ]
    for reason, count in summary.get("reject_reasons", {}).items():  # (N: the figures vary by request)
        lines.append(f"  rejected {count}: {reason}")
    if summary.get("prefix_cache_hit_rate"):
        lines.append(f"prefix cache hit rate {summary['prefix_cache_hit_rate']:.1%}")
    if "goodput" in summary:
        lines.append(f"goodput {summary['goodput'] or 0:.2f} req/s ({(summary['slo_attainment'] or 0):.1%} within SLO "
                     + ", ".join(f"{k}<={v}s" for k, v in summary["slo"].items()) + ")")
    lines.extend(cluster.format_replicas(summary))
    lines.append(f"{f'metric ({unit})':<18}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    def row(label: str, s: dict) -> str:
        return f"{label:<18}{ms(s['mean'])}{ms(s['p50'])}{ms(s['p90'])}{ms(s['p99'])}"

    for name in names:
        lines.append(row(name, summary[name]))
        if f"client_{name}" in summary:  # an API server is modelled: from the client's send too; ITL: per chunk
            label = "itl per chunk" if name == "itl" else f"{name} from send"
            lines.append(row(label, summary[f"client_{name}"]))
        if name == "ttft":  # (its parts add up to the TTFT from the send where there is one)
            for part in TTFT_PARTS:
                if part in summary and summary[part]["mean"] is not None:
                    lines.append(row("  " + TTFT_PART_LABELS[part], summary[part]))
    return "\n".join(lines)
