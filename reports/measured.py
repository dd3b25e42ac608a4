"""A replay of a measured run beside the run's own measurements, request for request.

Where the trace is a measured run (a vLLM bench result, traces/vllm_bench.py, or an AIPerf export,
traces/aiperf.py: each request's TTFT and TPOT as the client measured them), `sim replay` writes `measured.json` into its run folder:
the requests both finished in the replay and measured (joined on request_id), and per metric the
measured and predicted mean, median and p99, the mean signed error of the means, and the mean and
median of the per-request absolute percentage errors. The measured TTFT and E2E are the client's
(from its send); the replay's are taken from the send too where it modelled vLLM's API server
(`--api-server`, on by default for a vLLM bench result or an AIPerf export: requests.csv's `client_ttft_s`, and E2E
plus the API server's share), else from the engine's arrival. The network's time is in the
measurement alone (docs/traces.md). Where the server reported its own TTFT per request (vLLM's
`server_ttfts`), that is compared with the replay's engine TTFT (`server_ttft`).
"""

from __future__ import annotations

import numpy as np

# a measured metric -> the replay's requests.csv column it is compared with
METRICS = {"ttft_s": "ttft_s", "tpot_s": "tpot_s", "e2e_s": "e2e_s", "server_ttft_s": "ttft_s"}
FROM_SEND = ("ttft_s", "e2e_s")  # measured metrics that start at the client's send


def predicted(requests, name: str) -> np.ndarray:
    """The replay's figure for measured metric `name`: from the client's send where it starts there
    and the replay modelled the API server (`ttft_api_server_s` given), else the engine's."""
    values = requests[METRICS[name]].to_numpy(dtype=np.float64)
    if name not in FROM_SEND or "ttft_api_server_s" not in requests:
        return values
    api = requests["ttft_api_server_s"].to_numpy(dtype=np.float64)
    return np.where(np.isnan(api), values, values + api)


def compare_measured(requests, measured: dict[str, np.ndarray], request_ids: list[str]) -> dict:
    """`requests`: the replay's requests table (a pandas frame, requests.csv's columns);
    `measured`: the trace's measurements by metric, in the order of `request_ids`."""
    ids = requests["request_id"].astype(str).to_numpy()
    finished = requests["status"].to_numpy() == "finished"
    position = {rid: i for i, rid in enumerate(request_ids)}
    rows = [(k, position[rid]) for k, rid in enumerate(ids) if finished[k] and rid in position]
    # (a request the replay changed, e.g. truncated, has no measurement to compare: not counted)
    rows = [(k, i) for k, i in rows if any(np.isfinite(values[i]) for values in measured.values())]
    from_send = "ttft_api_server_s" in requests and bool(np.isfinite(requests["ttft_api_server_s"].to_numpy(np.float64)).any())
    out: dict = {"requests": len(rows), "predicted_from": "send" if from_send else "arrival", "metrics": {}}
    if not rows:
        return out
    replay_rows, trace_rows = (np.array(c, dtype=np.int64) for c in zip(*rows))
    for name in METRICS:
        if name not in measured:
            continue
        figures = predicted(requests, name)[replay_rows]
        truth = measured[name][trace_rows]
        both = np.isfinite(figures) & np.isfinite(truth) & (truth > 0)
        if not both.any():
            continue
        p, m = figures[both], truth[both]
        ape = np.abs(p / m - 1) * 100
        out["metrics"][name.removesuffix("_s")] = {
            "requests": int(both.sum()),
            "measured_mean_ms": float(m.mean() * 1e3), "predicted_mean_ms": float(p.mean() * 1e3),
            "measured_p50_ms": float(np.median(m) * 1e3), "predicted_p50_ms": float(np.median(p) * 1e3),
            "measured_p99_ms": float(np.quantile(m, 0.99) * 1e3),
            "predicted_p99_ms": float(np.quantile(p, 0.99) * 1e3),
            "mean_error_pct": float((p.mean() / m.mean() - 1) * 100),
            "mape_pct": float(ape.mean()), "median_ape_pct": float(np.median(ape)),
        }
    return out


def format_measured(comparison: dict) -> str:
    """The comparison as the terminal shows it."""
    lines = [f"against the trace's own measurements ({comparison['requests']} requests): measured / predicted"]
    for name, m in comparison["metrics"].items():
        lines.append(f"  {name:<11} mean {m['measured_mean_ms']:8.1f} / {m['predicted_mean_ms']:8.1f} ms "
                     f"({m['mean_error_pct']:+.1f}%)   p50 {m['measured_p50_ms']:8.1f} / {m['predicted_p50_ms']:8.1f}"
                     f"   p99 {m['measured_p99_ms']:8.1f} / {m['predicted_p99_ms']:8.1f}"
                     f"   per-request MAPE {m['mape_pct']:.1f}%")
    return "\n".join(lines)
