"""What a trace looks like: size, span, rate, burstiness, lengths and prefix sharing.

Definitions: the mean rate is rows divided by the span (last minus first arrival); percentiles
interpolate linearly (numpy's default).
"""

from __future__ import annotations

import numpy as np

from traces.trace import Trace


def prefix_sharing_ratio(trace: Trace) -> float | None:
    """The share of prompt tokens an unbounded prefix cache would hold, at hash-block granularity.

    A request's leading hash block j counts as shared when an earlier request had the same ids in
    blocks 0..j; the count stops at its first unshared block. None when the trace has no hash ids.
    """
    if trace.hash_ids is None:
        return None
    block_tokens = trace.hash_block_tokens
    seen: set[int] = set()
    num_shared = 0
    for ids, prompt in zip(trace.hash_ids, trace.prompt_tokens.tolist()):
        num_blocks = -(-prompt // block_tokens)
        chain, is_shared = 0, True
        for j, block_id in enumerate(ids[:num_blocks].tolist()):
            chain = hash((chain, block_id))
            if is_shared and chain in seen:
                num_shared += min(block_tokens, prompt - j * block_tokens)
            else:
                is_shared = False
                seen.add(chain)
    total = int(trace.prompt_tokens.sum())
    return num_shared / total if total else 0.0


def _lengths(values: np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": int(values.max())}


def trace_stats(trace: Trace) -> dict:
    gaps = np.diff(trace.arrival_s)
    span = trace.duration_s
    return {
        "source": trace.source,
        "format": trace.format,
        "requests": len(trace),
        "span_s": span,
        "mean_rate": len(trace) / span if span > 0 else None,
        "interarrival_cv": float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else None,
        "prompt_tokens": _lengths(trace.prompt_tokens),
        "output_tokens": _lengths(trace.output_tokens),
        "prefix_sharing_ratio": prefix_sharing_ratio(trace),
        "hash_block_tokens": trace.hash_block_tokens if trace.hash_ids is not None else None,
        "dropped": dict(trace.dropped),
        **({} if trace.measured is None else {"measured": _measured(trace.measured)}),
    }


def _measured(measured: dict[str, np.ndarray]) -> dict[str, dict]:
    """A measured run's own latencies (a vLLM bench result's TTFT and TPOT), in ms, where measured."""
    out = {}
    for name, values in measured.items():
        finite = values[np.isfinite(values)] * 1e3
        if len(finite):
            p50, p90, p99 = np.percentile(finite, [50, 90, 99])
            out[name.removesuffix("_s")] = {"requests": len(finite), "mean": float(finite.mean()), "p50": float(p50),
                                            "p90": float(p90), "p99": float(p99), "max": float(finite.max())}
    return out


def format_stats(stats: dict) -> str:
    def number(value, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = [
        f"file              {stats['source']} ({stats['format']})",
        f"requests          {stats['requests']:,}",
        f"span              {stats['span_s']:,.1f} s ({stats['span_s'] / 60:,.1f} min)",
        f"mean rate         {number(stats['mean_rate'], '.3f')} requests/s",
        f"inter-arrival CV  {number(stats['interarrival_cv'], '.3f')}  (1 for Poisson arrivals)",
        f"{'tokens':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    for name in ("prompt_tokens", "output_tokens"):
        s = stats[name]
        lines.append(f"  {name.split('_')[0]:<14}{s['mean']:>10.1f}{s['p50']:>10.1f}{s['p90']:>10.1f}"
                     f"{s['p99']:>10.1f}{s['max']:>10}")
    ratio = stats["prefix_sharing_ratio"]
    if ratio is None:
        lines.append("prefix sharing    n/a (the trace has no hash ids)")
    else:
        lines.append(f"prefix sharing    {ratio:.1%} of prompt tokens (hash blocks of "
                     f"{stats['hash_block_tokens']} tokens, unbounded cache)")
    for reason, n in stats["dropped"].items():
        lines.append(f"dropped           {n:,} with {reason}")
    if stats.get("measured"):
        lines.append(f"{'measured (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
        for name, m in stats["measured"].items():
            lines.append(f"  {name:<14}{m['mean']:>10.1f}{m['p50']:>10.1f}{m['p90']:>10.1f}{m['p99']:>10.1f}"
                         f"{m['max']:>10.1f}")
    return "\n".join(lines)
