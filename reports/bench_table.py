"""`vllm bench serve`'s result table, from a run's summary (vllm/benchmarks/serve.py, `benchmark`:
the same rows, labels and number formats; E2E latency's section is printed too, which vLLM
prints with --percentile-metrics ttft,tpot,itl,e2el)."""

from __future__ import annotations

import numpy as np

SECTIONS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
            ("itl", "ITL", "Inter-token Latency"), ("e2e", "E2EL", "End-to-end Latency"))


def per_second_peaks(starts, ends, token_times) -> tuple[float, int]:
    """vLLM's peaks, as `calculate_metrics` counts them (vllm/benchmarks/serve.py, 0.33 and 0.34):
    one-second buckets from the first send; the most output tokens emitted in one bucket, and the
    most requests active in one bucket, a request counting in every bucket from its send's to its
    end's, both included (so a closed loop's peak may exceed its concurrency, as vLLM's does).
    `starts` and `ends` are the successful requests' sends and ends, `token_times` all their
    tokens' times. Returns (peak output tokens per second, peak concurrent requests)."""
    starts, ends = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    if not starts.size:
        return 0.0, 0
    first = starts.min()
    buckets = int(np.ceil(ends.max() - first)) + 1
    tokens = np.asarray(token_times, dtype=float)
    # int() of a non-negative number: its floor; vLLM drops a time outside [0, buckets), none here.
    tokens_per_s = np.bincount((tokens - first).astype(np.int64), minlength=buckets)[:buckets]
    active = np.zeros(buckets + 1, dtype=np.int64)
    np.add.at(active, (starts - first).astype(np.int64), 1)
    np.add.at(active, (ends - first).astype(np.int64) + 1, -1)
    return float(tokens_per_s.max()), int(np.cumsum(active)[:buckets].max())


def format_bench_table(summary: dict, max_concurrency: int | None, request_rate: float | None) -> str:
    """`summary` as `reports.metrics.summarize` writes it, with `peak_output_tokens_per_s` and
    `peak_concurrent_requests`; `goodput` where SLOs were given (vLLM's --goodput)."""
    def row(label: str, value) -> str:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        return f"{label:<40} {text}"

    def ms(value) -> float:
        return 0.0 if value is None else value * 1e3  # vLLM prints 0 for an empty metric

    lines = [f"{' Serving Benchmark Result ':=^50}",
             row("Successful requests:", summary["completed"]),
             row("Failed requests:", summary["rejected"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate is not None:
        lines.append(row("Request rate configured (RPS):", float(request_rate)))
    lines += [row("Benchmark duration (s):", float(summary["duration_s"])),
              row("Total input tokens:", summary["total_prompt_tokens"]),
              row("Total generated tokens:", summary["total_output_tokens"]),
              row("Request throughput (req/s):", float(summary["request_throughput"] or 0.0))]
    if "goodput" in summary:
        lines.append(row("Request goodput (req/s):", float(summary["goodput"] or 0.0)))
    lines += [row("Output token throughput (tok/s):", float(summary["output_throughput"] or 0.0)),
              row("Peak output token throughput (tok/s):", float(summary["peak_output_tokens_per_s"])),
              row("Peak concurrent requests:", float(summary["peak_concurrent_requests"])),
              row("Total token throughput (tok/s):", float(summary["total_token_throughput"] or 0.0))]
    for key, name, header in SECTIONS:
        stats = summary.get(f"client_{key}", summary[key])  # from the client's send, through an API server
        lines += [f"{header:-^50}",
                  row(f"Mean {name} (ms):", ms(stats["mean"])),
                  row(f"Median {name} (ms):", ms(stats["p50"])),
                  row(f"P99 {name} (ms):", ms(stats["p99"]))]
    lines.append("=" * 50)
    return "\n".join(lines)
