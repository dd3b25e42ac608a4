"""What a cluster's run adds to the tables and the summary: which replica took each request and
ran each step, the load per replica, and the KV transfers of a disaggregated run.

Per replica (summary.json `replicas`):

- requests: routed to it (a disaggregated request counts on its prefill and its decode replica);
- steps, preemptions;
- prefix_cache_hit_rate: prompt tokens found in its cache / prompt tokens looked up, at admissions;
- mean_kv_usage: KV blocks in use / its blocks, averaged over its steps weighted by their seconds
  (the usage while it is busy);
- busy_fraction: the seconds its steps take / the simulated time.

KV transfers (disaggregated runs): `num_kv_transfers`, `kv_transfer_bytes` (all of them),
`kv_transfer_s` (latency + bytes / bandwidth of each: mean and percentiles).
"""

from __future__ import annotations

import numpy as np

from sim.cluster import ClusterResult


def request_columns(result: ClusterResult) -> dict[str, np.ndarray]:
    """Extra requests.csv columns, in `result.requests` order."""
    if not result.is_disaggregated:
        return {"replica": result.replica_of}
    t = result.transfers
    return {"prefill_replica": result.replica_of, "decode_replica": t["decode_replica"],
            "kv_transfer_start_s": t["start_s"], "kv_transfer_end_s": t["end_s"], "kv_transfer_bytes": t["bytes"]}


def replica_rows(result: ClusterResult) -> list[dict]:
    rows = []
    for record in result.replicas:
        steps = record.steps
        seconds = steps.seconds
        busy_s = float(seconds.sum())
        used = steps.num_kv_blocks_used.astype(np.float64)
        rows.append({
            "replica": record.index,
            "role": record.role,
            "requests": record.num_requests,
            "steps": len(steps),
            "preemptions": record.num_preemptions,
            "prefix_cache_hit_rate": (record.num_prefix_hit_tokens / record.num_prefix_queried_tokens
                                      if record.num_prefix_queried_tokens else 0.0),
            "mean_kv_usage": float((seconds * used).sum() / (busy_s * record.num_blocks)) if busy_s > 0 else 0.0,
            "busy_fraction": busy_s / result.end_s if result.end_s > 0 else 0.0,
        })
    return rows


def summary(result: ClusterResult, stats) -> dict:
    """The summary's cluster keys; `stats` is reports.metrics' mean-and-percentiles function."""
    out: dict = {"replicas": replica_rows(result)}
    if result.is_disaggregated:
        t = result.transfers
        done = ~np.isnan(t["start_s"])
        out["num_kv_transfers"] = int(done.sum())
        out["kv_transfer_bytes"] = int(t["bytes"][done].sum())
        out["kv_transfer_s"] = stats(t["end_s"][done] - t["start_s"][done])
    return out


def format_replicas(summary: dict) -> list[str]:
    """Terminal lines: the load per replica and the transfers."""
    rows = summary.get("replicas")
    if not rows:
        return []
    lines = [f"{'replica':>8}{'role':>11}{'requests':>10}{'steps':>10}{'busy':>8}{'KV used':>9}{'hit rate':>10}"]
    for row in rows:
        lines.append(f"{row['replica']:>8}{row['role']:>11}{row['requests']:>10}{row['steps']:>10}"
                     f"{row['busy_fraction']:>8.1%}{row['mean_kv_usage']:>9.1%}{row['prefix_cache_hit_rate']:>10.1%}")
    if "kv_transfer_s" in summary:
        s = summary["kv_transfer_s"]
        mean = "-" if s["mean"] is None else f"{s['mean'] * 1e3:.2f}"
        p99 = "-" if s["p99"] is None else f"{s['p99'] * 1e3:.2f}"
        lines.append(f"KV transfers {summary['num_kv_transfers']}, {summary['kv_transfer_bytes'] / 1e9:.2f} GB, "
                     f"mean {mean} ms, p99 {p99} ms")
    return lines
