"""vllm bench serve's result table and its peak concurrency."""

from reports.bench_table import format_bench_table, peak_concurrency


def test_peak_concurrency_counts_half_open_intervals():
    assert peak_concurrency([0, 0, 1], [1, 2, 3]) == 2  # the third starts as the first ends
    assert peak_concurrency([], []) == 0


def test_table_rows_and_formats_are_vllms():
    stats = {"mean": 0.0125, "p50": 0.01, "p90": 0.02, "p99": 0.03}
    summary = {"completed": 4, "rejected": 0, "duration_s": 2.0, "total_prompt_tokens": 400,
               "total_output_tokens": 40, "request_throughput": 2.0, "output_throughput": 20.0,
               "total_token_throughput": 220.0, "peak_concurrent_requests": 2,
               "ttft": stats, "tpot": stats, "itl": stats, "e2e": {"mean": None, "p50": None, "p99": None}}
    lines = format_bench_table(summary, 2, None).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     4         "
    assert "Maximum request concurrency:             2         " in lines
    assert not any(line.startswith("Request rate configured") for line in lines)  # an infinite rate
    assert "Benchmark duration (s):                  2.00      " in lines
    assert "Peak concurrent requests:                2.00      " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "Mean TTFT (ms):                          12.50     " in lines
    assert "P99 ITL (ms):                            30.00     " in lines
    assert "Mean E2EL (ms):                          0.00      " in lines
    assert lines[-1] == "=" * 50 and len(lines) == 28
    assert "Request rate configured (RPS):           4.00      " in format_bench_table(summary, 2, 4).splitlines()
