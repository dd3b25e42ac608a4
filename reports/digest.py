"""A run in a few kilobytes: latency quantile sketches, a downsampled step timeline, and one flat row.

A one-hour trace makes ~500k steps and millions of inter-token gaps; reports and sweep tables
keep only this digest:

- quantile sketch: each latency's percentiles at `QUANTILES` (every percent, then every tenth
  of a percent above 99), enough for a CDF and exact at those percentiles;
- timeline: the steps binned by start time into at most `NUM_TIMELINE_BINS` bins, each bin
  holding the mean per step of prefill tokens, decode tokens, KV blocks used and waiting
  requests (NaN where the engine was idle the whole bin).

A row flattens a run's options, its summary metrics and its digest into one dict of scalars and
lists: the unit of sweep tables and reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from reports.metrics import METRICS
from reports.outcomes import RequestOutcomes
from sim.request import Status

if TYPE_CHECKING:
    import pandas as pd  # make_digest's requests table; a replay's digest (run_digest) needs no pandas

# Every percent, then every tenth above 99 (np.r_ and np.unique would import numpy.ma: 10 ms of start-up).
QUANTILES = np.array(sorted(set(np.round(np.concatenate([np.arange(0.0, 99.0, 1.0), np.arange(99.0, 100.0, 0.1),
                                                         [99.95, 99.99, 100.0]]), 2).tolist())))
NUM_TIMELINE_BINS = 240
EXACT_LIMIT = 200_000  # sketches of more values than this read their body from a sample
TIMELINE = ("num_prefill_tokens", "num_decode_tokens", "num_kv_blocks_used", "num_waiting")
STATS = ("mean", "p50", "p90", "p99")


def quantile_sketch(values: np.ndarray) -> list[float] | None:
    """Percentiles of `values` at QUANTILES (NaN dropped), interpolated as np.percentile does; None
    when there is nothing to sketch.

    Exact up to EXACT_LIMIT values. Above it (millions of inter-token gaps) a full sort costs
    about a second, so the tail is still exact (every value above the sample's 97th percentile is
    sorted) and the body is read from an evenly strided sample of about EXACT_LIMIT values."""
    values = np.asarray(values, dtype=np.float64)
    low = values.min() if len(values) else np.nan  # NaN if any value is
    if np.isnan(low):
        values = values[~np.isnan(values)]
        low = values.min() if len(values) else np.nan
    n = len(values)
    if n == 0:
        return None
    position = QUANTILES / 100.0 * (n - 1)
    if n <= EXACT_LIMIT:
        return _interpolate(np.sort(values), position).tolist()
    sample = np.sort(values[:: n // EXACT_LIMIT + 1])
    out = _interpolate(sample, QUANTILES / 100.0 * (len(sample) - 1))
    out[0] = low  # QUANTILES[0] is 0
    tail = np.sort(values[values >= sample[int(0.97 * (len(sample) - 1))]])
    num_below = n - len(tail)
    exact = np.floor(position) >= num_below
    out[exact] = _interpolate(tail, position[exact] - num_below)
    return out.tolist()


def _interpolate(sorted_values: np.ndarray, position: np.ndarray) -> np.ndarray:
    below = np.floor(position).astype(np.int64)
    above = np.minimum(below + 1, len(sorted_values) - 1)
    return sorted_values[below] + (sorted_values[above] - sorted_values[below]) * (position - below)


def sketch_quantile(sketch: list[float] | np.ndarray, q: float) -> float:
    """The q-quantile (0..1) read from a sketch; exact at QUANTILES, interpolated between them."""
    return float(np.interp(q * 100.0, QUANTILES, np.asarray(sketch, dtype=np.float64)))


def timeline(start_s: np.ndarray, columns: dict[str, np.ndarray], num_bins: int = NUM_TIMELINE_BINS) -> dict:
    """Steps binned by start time: the bins' left edges and each column's mean per step."""
    start_s = np.asarray(start_s, dtype=np.float64)
    if len(start_s) == 0:
        return {"start_s": [], **{name: [] for name in columns}}
    span = float(start_s[-1] - start_s[0])
    num_bins = max(1, min(num_bins, len(start_s)))
    width = span / num_bins if span > 0 else 1.0
    index = np.minimum(((start_s - start_s[0]) / width).astype(np.int64), num_bins - 1)
    counts = np.bincount(index, minlength=num_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {"start_s": (start_s[0] + width * np.arange(num_bins)).tolist()}
        for name, values in columns.items():
            sums = np.bincount(index, weights=np.asarray(values, dtype=np.float64), minlength=num_bins)
            out[name] = (sums / counts).tolist()  # NaN where no step started in the bin
    return out


def make_digest(requests: pd.DataFrame, itl: np.ndarray | None, steps: dict[str, np.ndarray]) -> dict:
    """Quantile sketches of every latency and the binned step timeline.

    `requests` is reports.metrics.requests_table (or its CSV); `itl` every inter-token gap (None
    when unknown); `steps` maps start_s and the TIMELINE columns to per-step arrays."""
    done = requests[requests["status"] == Status.FINISHED.value]
    digest: dict = {"quantiles": QUANTILES.tolist()}
    for name in METRICS:
        if name == "itl":
            digest[name] = None if itl is None else quantile_sketch(itl)
        else:
            digest[name] = quantile_sketch(done[f"{name}_s"].to_numpy())
    digest["timeline"] = timeline(steps["start_s"], {name: steps[name] for name in TIMELINE})
    return digest


def run_digest(outcomes: RequestOutcomes, step_timeline: dict) -> dict:
    """The digest of a replay from its streamed outcomes and its step timeline (`timeline` of its
    steps, or reports.timeline.StepTimeline's). Each sketch is quantile_sketch's while the metric's
    values were kept exactly, else read from the streaming sketch (within its relative accuracy)."""
    digest: dict = {"quantiles": QUANTILES.tolist()}
    sketches = {name: outcomes.itl if name == "itl" else outcomes.sketches[name] for name in METRICS}
    if outcomes.stream_interval > 1:  # the gaps between the chunks a streaming client receives (--stream-interval)
        sketches["client_itl"] = outcomes.client_itl
    for name, sketch in sketches.items():
        if not sketch.count:
            digest[name] = None
        elif sketch.is_exact:
            digest[name] = quantile_sketch(sketch.values())
        else:
            digest[name] = sketch.percentiles(QUANTILES).tolist()
    digest["timeline"] = step_timeline
    return digest


def steps_timeline(steps: dict[str, np.ndarray]) -> dict:
    """The timeline of a run's whole step columns (start_s and TIMELINE)."""
    return timeline(steps["start_s"], {name: steps[name] for name in TIMELINE})


def flat_options(options: dict) -> dict:
    """ReplayOptions.as_dict() (plus extras such as the trace) as flat columns.

    Scheduler and cache fields keep their own names (policy, max_num_batched_tokens, block_size...);
    other nested fields are prefixed with their section (slo_ttft)."""
    flat: dict = {}
    for key, value in options.items():
        if isinstance(value, dict):
            for inner, v in flat_options(value).items():  # a cluster's pools nest one level deeper
                flat[inner if key in ("scheduler", "cache") else f"{key}_{inner}"] = v
        else:
            flat[key] = value
    return flat


def summary_row(summary: dict, digest: dict | None) -> dict:
    """One flat row: options, summary metrics (ttft_p99...) and the digest (ttft_quantiles, timeline_*)."""
    row = flat_options(summary.get("options", {}))
    for key, value in summary.items():
        if key in METRICS:
            for stat in STATS:
                row[f"{key}_{stat}"] = value[stat]
        elif key == "replicas":  # a cluster's load per replica: one list per figure
            for name in value[0]:
                row[f"replica_{name}"] = [replica[name] for replica in value]
        elif isinstance(value, dict) and key not in ("options", "slo", "reject_reasons"):  # kv_transfer_s
            for stat, v in value.items():
                row[f"{key}_{stat}"] = v
        elif key not in ("options", "slo", "reject_reasons"):
            row[key] = value
    if digest is not None:
        for name in METRICS:
            row[f"{name}_quantiles"] = digest[name]
        if "client_itl" in digest:  # --stream-interval above 1
            row["client_itl_quantiles"] = digest["client_itl"]
        for name, values in digest["timeline"].items():
            row[f"timeline_{name}"] = values
    return row
