"""`vllm bench serve`'s result table, from a run's summary (vllm/benchmarks/serve.py, `benchmark`:
the same rows, labels and number formats; E2E latency's section is printed too, which vLLM
prints with --percentile-metrics ttft,tpot,itl,e2el)."""

from __future__ import annotations

SECTIONS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
            ("itl", "ITL", "Inter-token Latency"), ("e2e", "E2EL", "End-to-end Latency"))


def peak_concurrency(starts, ends) -> int:
    """The most requests in flight at once, over half-open intervals [start, end) (a finish
    at the instant of a send frees its slot first), as vLLM's `calculate_metrics` counts them."""
    events = sorted([(float(e), -1) for e in ends] + [(float(s), 1) for s in starts])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def format_bench_table(summary: dict, max_concurrency: int | None, request_rate: float | None) -> str:
    """`summary` as `reports.metrics.summarize` writes it, with `peak_concurrent_requests`."""
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
              row("Request throughput (req/s):", float(summary["request_throughput"] or 0.0)),
              row("Output token throughput (tok/s):", float(summary["output_throughput"] or 0.0)),
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
