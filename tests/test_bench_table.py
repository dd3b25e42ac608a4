"""vllm bench serve's result table and its per-second peaks."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from reports.bench_table import format_bench_table, per_second_peaks


def test_per_second_peaks_worked_example():
    # Sends at 0.0, 0.5 and 1.2 s, ends at 1.1, 2.0 and 3.5 s: buckets [0, 1), [1, 2), [2, 3), [3, 4), [4, 5)
    # (ceil(3.5 - 0) + 1 = 5). Active: bucket 0 the first two; bucket 1 all three (the first ends at 1.1, the
    # third starts at 1.2: a bucket counts both); bucket 2 the second (ends at 2.0) and third; buckets 3 the third.
    tokens = [0.2, 0.4, 0.9, 1.1, 0.6, 1.0, 1.5, 2.0, 1.3, 3.5]
    assert per_second_peaks([0.0, 0.5, 1.2], [1.1, 2.0, 3.5], tokens) == (4.0, 3)  # bucket 1: 1.1, 1.0, 1.5, 1.3
    assert per_second_peaks([], [], []) == (0.0, 0)


def reference_peaks(starts, ends, token_times):
    """vLLM's loops (vllm/benchmarks/serve.py, calculate_metrics), as written there."""
    first = min(starts)
    n = int(np.ceil(max(ends) - first)) + 1
    tokens, active = np.zeros(n), np.zeros(n)
    for t in token_times:
        if 0 <= int(t - first) < n:
            tokens[int(t - first)] += 1
    for s, e in zip(starts, ends):
        for second in range(int(s - first), int(e - first) + 1):
            active[second] += 1
    return float(np.max(tokens)), int(np.max(active))


@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 20), st.lists(st.floats(0, 1), max_size=5)),
                min_size=1, max_size=30))
def test_per_second_peaks_are_vllms_loops(requests):
    starts = [s for s, _, _ in requests]
    ends = [s + d for s, d, _ in requests]
    tokens = [s + f * d for s, d, fs in requests for f in fs]
    assert per_second_peaks(starts, ends, tokens) == reference_peaks(starts, ends, tokens)


def test_table_rows_and_formats_are_vllms():
    stats = {"mean": 0.0125, "p50": 0.01, "p90": 0.02, "p99": 0.03}
    summary = {"completed": 4, "rejected": 0, "duration_s": 2.0, "total_prompt_tokens": 400,
               "total_output_tokens": 40, "request_throughput": 2.0, "output_throughput": 20.0,
               "total_token_throughput": 220.0, "peak_output_tokens_per_s": 24.0, "peak_concurrent_requests": 2,
               "ttft": stats, "tpot": stats, "itl": stats, "e2e": {"mean": None, "p50": None, "p99": None}}
    lines = format_bench_table(summary, 2, None).splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     4         "
    assert "Maximum request concurrency:             2         " in lines
    assert not any(line.startswith("Request rate configured") for line in lines)  # an infinite rate
    assert "Benchmark duration (s):                  2.00      " in lines
    assert "Peak concurrent requests:                2.00      " in lines
    assert lines[lines.index("Output token throughput (tok/s):         20.00     ") + 1] == \
        "Peak output token throughput (tok/s):    24.00     "
    assert not any(line.startswith("Request goodput") for line in lines)  # no SLOs given
    assert "---------------Time to First Token----------------" in lines
    assert "Mean TTFT (ms):                          12.50     " in lines
    assert "P99 ITL (ms):                            30.00     " in lines
    assert "Mean E2EL (ms):                          0.00      " in lines
    assert lines[-1] == "=" * 50 and len(lines) == 29
    assert "Request rate configured (RPS):           4.00      " in format_bench_table(summary, 2, 4).splitlines()


def test_goodput_row_follows_request_throughput_where_slos_were_given():
    stats = {"mean": 0.01, "p50": 0.01, "p99": 0.01}
    summary = {"completed": 4, "rejected": 0, "duration_s": 2.0, "total_prompt_tokens": 400,
               "total_output_tokens": 40, "request_throughput": 2.0, "goodput": 1.5, "output_throughput": 20.0,
               "total_token_throughput": 220.0, "peak_output_tokens_per_s": 24.0, "peak_concurrent_requests": 2,
               "ttft": stats, "tpot": stats, "itl": stats, "e2e": stats}
    lines = format_bench_table(summary, 2, None).splitlines()
    i = lines.index("Request throughput (req/s):              2.00      ")
    assert lines[i + 1] == "Request goodput (req/s):                 1.50      "
