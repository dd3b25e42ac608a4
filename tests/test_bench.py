"""sim bench: the closed loop of vllm bench serve --max-concurrency, by hand and by property."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.app.bench import BenchSpec, run_bench
from sim.app.cli import main
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.config import CacheConfig, SchedulerConfig
from tests.helpers import ConstantBackend


def plan_for(backend=None, num_blocks=None, **kw):
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", 2048, 256), cache=CacheConfig(16, num_blocks), **kw)
    return resolve(options, backend)


def test_one_client_with_a_constant_step_by_hand():
    # C = 1, each step 0.25 s, 100-token prompts in one prefill step, 5 output tokens: a request's
    # prefill step emits its first token (TTFT 0.25 s), four decode steps follow (E2E 1.25 s), and
    # the next request is sent at the finish. (No test request: the benchmark starts at t = 0.)
    result, loop = run_bench(BenchSpec(1, 100, 5, 3, test_request=False), plan_for(ConstantBackend(0.25), api_server="off"))
    rows = result.requests
    assert [r.arrival_s for r in rows] == [0.0, 1.25, 2.5]
    assert [r.first_token_s - r.arrival_s for r in rows] == [0.25] * 3
    assert [r.finish_s - r.arrival_s for r in rows] == [1.25] * 3
    assert [(r.finish_s - r.first_token_s) / 4 for r in rows] == [0.25] * 3  # TPOT
    assert loop.max_in_flight == 1 and result.end_s == 3.75


def test_one_client_through_vllms_api_server_by_hand():
    # The same, with vLLM's API server (the default): each request reaches the engine 1 ms + 100 x 2 us
    # after its send, and the client's next send is at the finish.
    result, loop = run_bench(BenchSpec(1, 100, 5, 3, test_request=False), plan_for(ConstantBackend(0.25)))
    rows = result.requests
    server = 1e-3 + 100 * 2e-6
    assert [r.client_sent_s for r in rows] == pytest.approx([0.0, 1.25 + server, 2.5 + 2 * server])
    assert [r.arrival_s - r.client_sent_s for r in rows] == pytest.approx([server] * 3)
    assert [r.finish_s - r.client_sent_s for r in rows] == pytest.approx([1.25 + server] * 3)  # E2E from the send
    assert result.end_s == pytest.approx(3.75 + 3 * server)


@pytest.mark.slow
def test_the_cli_writes_a_run_folder_and_vllms_table(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["bench", "--concurrency", "2", "--input-len", "64", "--output-len", "4", "--num-prompts", "4",
                 "--model", "tiny", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in text
    assert "Successful requests:                     4" in text and "Maximum request concurrency:             2" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bench"] == {"concurrency": 2, "input_len": 64, "output_len": 4, "num_prompts": 4,
                                "request_rate": None}
    # vLLM's peaks count one-second buckets: the four requests, two at a time, all end within the first second.
    assert summary["completed"] == 4 and summary["peak_concurrent_requests"] == 4
    assert summary["peak_output_tokens_per_s"] == 16.0 and "Peak output token throughput (tok/s):    16.00" in text
    # No test request (vLLM's client skips it by default): no prompt is found cached, nothing ran before.
    assert summary["kv_cache"]["source"] == "derived" and summary["prefix_cache_hit_rate"] == 0.0
    assert "warmup" not in summary
    # With one (--ready-check-timeout-sec above 0) request 0 finds 3 of its prompt's 4 blocks cached (the
    # last one's tokens are computed again for the last token's logits), 48 of the benchmark's 4 x 64 tokens.
    tested = tmp_path / "t"
    assert main(["bench", "--concurrency", "2", "--input-len", "64", "--output-len", "4", "--num-prompts", "4",
                 "--model", "tiny", "--ready-check-timeout-sec", "600", "--out", str(tested), "--quiet"]) == 0
    summary = json.loads((tested / "summary.json").read_text())
    assert summary["bench"]["test_request"] is True and summary["prefix_cache_hit_rate"] == 48 / 256
    assert summary["warmup"]["requests"] == 1 and summary["warmup"]["benchmark_start_s"] > 0
    assert (out / "requests.csv").exists() and (out / "steps.parquet").exists() and (out / "report.html").exists()
    # A trace's options do not apply.
    assert main(["bench", "--concurrency", "2", "--input-len", "8", "--output-len", "2", "--num-prompts", "2",
                 "--limit", "3", "--out", str(tmp_path / "c")]) == 2
    assert "sim bench makes its own requests" in capsys.readouterr().err


def in_flight_at_most(starts, ends) -> int:
    """The most requests in flight at once, over half-open intervals [send, finish)."""
    events = sorted([(e, -1) for e in ends] + [(s, 1) for s in starts])
    return max(np.cumsum([delta for _, delta in events]), default=0)


@settings(max_examples=25, deadline=None)
@given(concurrency=st.integers(1, 6), num_prompts=st.integers(1, 20), input_len=st.integers(1, 300),
       output_len=st.integers(1, 12), rate=st.sampled_from([math.inf, 0.5, 4.0, 50.0]), seed=st.integers(0, 3),
       test_request=st.booleans(), num_warmups=st.integers(0, 3))
def test_the_closed_loop_keeps_c_in_flight_and_sends_exactly_n(concurrency, num_prompts, input_len, output_len,
                                                                rate, seed, test_request, num_warmups):
    spec = BenchSpec(concurrency, input_len, output_len, num_prompts, rate, num_warmups=num_warmups,
                     test_request=test_request)
    result, loop = run_bench(spec, plan_for(ConstantBackend(0.125), num_blocks=64, seed=seed))
    start = loop.start_s  # the benchmark's start: the last warm-up's finish (0 without any)
    warmups = loop.warmup_requests
    assert len(warmups) == num_warmups + test_request and (start > 0) == bool(warmups)
    assert all(w.finish_s is not None and w.finish_s <= start for w in warmups)
    assert start in {w.finish_s for w in warmups} | {0.0}
    rows = result.requests
    assert len(rows) == num_prompts and all(r.finish_s is not None for r in rows)  # every prompt sent, once
    assert loop.max_in_flight <= concurrency
    sends = [r.client_sent_s for r in rows]  # (the client's; each reaches the engine through the API server)
    assert all(r.arrival_s > r.client_sent_s for r in rows)
    assert in_flight_at_most(sends, [r.finish_s for r in rows]) <= concurrency
    created = [start + c for c in spec.created_s(seed)]  # from the benchmark's start, as vLLM's get_request
    assert all(s >= c for s, c in zip(sends, created))  # never sent before it is created
    assert sends == sorted(sends)  # sent in creation order
    assert [r.arrival_s for r in rows] == sorted(r.arrival_s for r in rows)  # and through the server in that order
    if math.isinf(rate):
        assert sends[:concurrency] == [start] * min(concurrency, num_prompts)  # the first wave
    else:
        last = spec.created_s(seed)[-1]
        assert abs(last - num_prompts / rate) <= 1e-12 * last  # vLLM rescales the Poisson schedule to end at N / R
    for s, c in zip(sends, created):  # a request waits only for a slot, freed by a finish
        assert s == c or s in {q.finish_s for q in rows}


def test_fast_forward_gives_the_same_bench():
    spec = BenchSpec(8, 300, 40, 24, 20.0)
    runs = [run_bench(spec, plan_for(model="Qwen3-0.6B", seed=1), fast_forward=ff)[0] for ff in (True, False)]
    assert len(runs[0].steps) == len(runs[1].steps)
    np.testing.assert_array_equal(runs[0].token_times, runs[1].token_times)


def test_fast_forward_gives_the_same_bench_with_long_prompts(monkeypatch):
    """Prompts of several budgets each: the closed loop's steps carry them forward in chunk runs
    (sim/fast_forward.py), its requests arriving meanwhile delivered by time; the answers are
    those of stepping one by one."""
    from sim.fast_forward import FastForward

    runs_taken = []
    plan_chunks = FastForward.plan_chunks

    def counting(self, batch, now, first, budget):
        run = plan_chunks(self, batch, now, first, budget)
        runs_taken.append(run is not None)
        return run

    monkeypatch.setattr(FastForward, "plan_chunks", counting)
    spec = BenchSpec(6, 9000, 30, 20, 4.0)
    # Chunk runs are taken under synchronous scheduling (sim/engine.py: asynchronously they are stepped).
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", 2048, 256, async_scheduling=False),
                            cache=CacheConfig(16, None), model="Qwen3-0.6B", seed=2)
    fast, slow = (run_bench(spec, resolve(options), fast_forward=ff)[0] for ff in (True, False))
    assert sum(runs_taken) > 10
    assert [r.arrival_s for r in fast.requests] == [r.arrival_s for r in slow.requests]
    np.testing.assert_array_equal(fast.token_times, slow.token_times)
    fc, sc = fast.steps.columns(), slow.steps.columns()
    assert fc.keys() == sc.keys() and all(np.array_equal(fc[k], sc[k], equal_nan=True) for k in fc)


def test_random_range_ratio_draws_lengths_as_vllms_random_dataset():
    """vllm/benchmarks/datasets.py RandomDataset.get_sampling_params: uniform integers in
    [floor(x (1 - r)), ceil(x (1 + r))], an output at least one token, from numpy's default_rng(seed),
    all prompt lengths then all output lengths; r = 0 keeps every length exact."""
    spec = BenchSpec(4, 1000, 3, 500, range_ratio=0.25)
    assert spec.bounds() == ((750, 1250), (2, 4))
    prompts, outputs = spec.lengths(seed=7)
    rng = np.random.default_rng(7)
    assert prompts == rng.integers(750, 1251, size=500).tolist() and outputs == rng.integers(2, 5, size=500).tolist()
    assert min(prompts) >= 750 and max(prompts) <= 1250 and set(outputs) == {2, 3, 4}
    assert spec.lengths(seed=7) == (prompts, outputs) and spec.lengths(seed=8) != (prompts, outputs)
    # floor(20 x (1 - 0.9)) is 1 in floating point (as in vLLM's), never a 0-token output
    assert BenchSpec(4, 20, 1, 3, range_ratio=0.9).bounds() == ((1, 38), (1, 2))
    # A prompt range reaching 0 tokens is refused, as vLLM's RandomDataset refuses it (it was clamped to 1).
    with pytest.raises(Exception, match=r"--random-range-ratio 0.9 with --input-len 10: the shortest prompt would be "
                                        r"floor\(10 x \(1 - 0.9\)\) = 0 tokens, which vllm bench serve refuses"):
        BenchSpec(4, 10, 1, 3, range_ratio=0.9)
    assert BenchSpec(4, 100, 5, 3).lengths(seed=1) == ([100] * 3, [5] * 3)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in spec.requests(seed=7)] == list(zip(prompts, outputs))
    with pytest.raises(Exception, match=r"--random-range-ratio must be in \[0, 1\), got 1"):
        BenchSpec(4, 100, 5, 3, range_ratio=1.0)


def test_a_range_ratio_runs_each_request_with_its_own_lengths(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["bench", "--concurrency", "2", "--input-len", "64", "--output-len", "8", "--num-prompts", "6",
                 "--random-range-ratio", "0.5", "--seed", "3", "--model", "tiny", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bench"]["random_range_ratio"] == 0.5 and summary["completed"] == 6
    import pandas as pd

    rows = pd.read_csv(out / "requests.csv").sort_values("request_id")
    prompts, outputs = BenchSpec(2, 64, 8, 6, range_ratio=0.5).lengths(seed=3)
    assert sorted(rows["prompt_tokens"]) == sorted(prompts) and sorted(rows["output_tokens"]) == sorted(outputs)
    # The longest request is what must fit: refused up front, naming the range.
    assert main(["bench", "--concurrency", "2", "--input-len", "3000", "--output-len", "8", "--num-prompts", "2",
                 "--random-range-ratio", "0.5", "--max-model-len", "4096", "--model", "tiny",
                 "--out", str(tmp_path / "c"), "--quiet"]) == 2
    assert ("the longest request (--input-len 3000, --output-len 8, --random-range-ratio 0.5: up to 4500 + 12 "
            "tokens) is 4512 tokens, more than --max-model-len 4096") in capsys.readouterr().err


def test_goodput_judges_the_ttft_from_the_send_as_the_table_shows_it(tmp_path):
    """Through vLLM's API server the TTFT a client sees starts at its send: goodput's TTFT is that one
    (the engine's, from its arrival, is a few ms shorter), as vLLM's bench serve --goodput counts it."""
    import pandas as pd

    out = tmp_path / "b"
    assert main(["bench", "--concurrency", "8", "--input-len", "512", "--output-len", "16", "--num-prompts", "40",
                 "--slo", "ttft=0.07", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = pd.read_csv(out / "requests.csv")
    good_from_send = int((rows["client_ttft_s"] <= 0.07).sum())
    assert summary["slo_attainment"] == pytest.approx(good_from_send / len(rows))
    assert good_from_send < int((rows["ttft_s"] <= 0.07).sum())  # (this case tells the two apart)


class TokenPricedBackend(ConstantBackend):
    """A step takes 1/8 s plus 1/1024 s per token it computes (exact in binary)."""

    def execute(self, batch):
        from sim.backend import StepResult

        self.batches.append(batch)
        return StepResult(0.125 + batch.num_tokens / 1024, {})


PREFILL_100, PREFILL_4, DECODE = 0.125 + 100 / 1024, 0.125 + 4 / 1024, 0.125 + 1 / 1024


def test_the_test_request_leaves_the_first_prompt_cached_by_hand(tmp_path):
    """vllm/benchmarks/serve.py `benchmark`: one test request with request 0's prompt and output runs
    first; the benchmark starts when it finishes. C = 1, three 100-token prompts, blocks of 16, 5
    output tokens, no API server. The test request prefills 100 tokens and decodes 4: it ends at
    B = PREFILL_100 + 4 DECODE. Request 0, sent at B, finds its prompt's 6 full blocks cached and
    computes only the 4 tokens after them (vLLM's lookup stops at the last token's block:
    96 <= 99); requests 1 and 2 compute all 100. Nothing of the test request is counted."""
    spec = BenchSpec(1, 100, 5, 3, test_request=True)  # (--ready-check-timeout-sec S > 0; vLLM's default 0 skips it)
    plan = plan_for(TokenPricedBackend(), api_server="off")
    result, loop = run_bench(spec, plan)
    start = PREFILL_100 + 4 * DECODE
    assert loop.start_s == start == 0.7265625 and result.start_s == start
    rows = result.requests
    assert [r.request_id for r in rows] == ["bench-0", "bench-1", "bench-2"]
    assert [r.num_prefix_hit_tokens for r in rows] == [96, 0, 0]
    assert [r.arrival_s for r in rows] == [start, start + PREFILL_4 + 4 * DECODE,
                                           start + PREFILL_4 + PREFILL_100 + 8 * DECODE]
    assert [r.first_token_s - r.arrival_s for r in rows] == [PREFILL_4, PREFILL_100, PREFILL_100]
    # The steps are the benchmark's: the first prefills request 0's 4 uncached tokens at B.
    assert len(result.steps) == 15 and result.steps.start_s[0] == start
    assert result.steps.num_prefill_tokens[0] == 4 and result.steps.num_prefill_tokens.sum() == 204
    assert result.num_prefix_hit_tokens == 96 and result.num_prefix_queried_tokens == 300  # the benchmark's admissions
    assert result.warmup == {"test_request": True, "num_warmups": 0, "requests": 1, "steps": 5, "benchmark_start_s": start}
    from sim.app.bench import write_bench

    summary = write_bench(tmp_path / "b", result, plan, spec)
    assert summary["num_requests"] == summary["completed"] == 3 and summary["num_steps"] == 15
    assert summary["duration_s"] == rows[-1].finish_s - start  # the clock starts at the benchmark's start
    assert summary["ttft"]["mean"] == pytest.approx((PREFILL_4 + 2 * PREFILL_100) / 3)
    assert summary["warmup"]["benchmark_start_s"] == start
    assert summary["prefix_cache_hit_rate"] == 96 / 300


def test_warmups_run_after_the_test_request_and_hit_its_blocks_too():
    """--num-warmups 2 at C = 1: two more copies of the test request, one after the other; each finds
    the first prompt cached (4 tokens computed), and the benchmark starts when the second ends."""
    result, loop = run_bench(BenchSpec(1, 100, 5, 3, num_warmups=2, test_request=True),
                             plan_for(TokenPricedBackend(), api_server="off"))
    start = PREFILL_100 + 4 * DECODE + 2 * (PREFILL_4 + 4 * DECODE)
    assert loop.start_s == start and [r.request_id for r in loop.warmup_requests] == ["test", "warmup-0", "warmup-1"]
    assert [r.num_prefix_hit_tokens for r in loop.warmup_requests] == [0, 96, 96]
    assert [r.num_prefix_hit_tokens for r in result.requests] == [96, 0, 0]
    assert result.requests[0].arrival_s == start and result.warmup["steps"] == 15
    # At C = 2 the two warm-ups are sent together when the test request ends, and the benchmark waits for both.
    result, loop = run_bench(BenchSpec(2, 100, 5, 3, num_warmups=2, test_request=True),
                             plan_for(TokenPricedBackend(), api_server="off"))
    test, w0, w1 = loop.warmup_requests
    assert w0.arrival_s == w1.arrival_s == test.finish_s and loop.start_s == max(w0.finish_s, w1.finish_s)
    # Without the test request the warm-ups still run, the first of them computing the whole prompt.
    result, loop = run_bench(BenchSpec(1, 100, 5, 3, num_warmups=1, test_request=False),
                             plan_for(TokenPricedBackend(), api_server="off"))
    assert [r.num_prefix_hit_tokens for r in loop.warmup_requests] == [0]
    assert result.requests[0].num_prefix_hit_tokens == 96 and loop.start_s == PREFILL_100 + 4 * DECODE


def test_without_the_test_request_request_0_is_computed_whole():
    """--ready-check-timeout-sec 0, the default (vLLM skips the test request): the benchmark starts at 0
    on an empty cache, request 0 computing its 100 tokens."""
    result, loop = run_bench(BenchSpec(1, 100, 5, 3), plan_for(TokenPricedBackend(), api_server="off"))
    rows = result.requests
    assert loop.start_s == 0.0 and not loop.warmup_requests and result.warmup is None
    assert [r.num_prefix_hit_tokens for r in rows] == [0, 0, 0] and rows[0].hash_ids is None
    assert [r.first_token_s - r.arrival_s for r in rows] == [PREFILL_100] * 3
    assert rows[0].arrival_s == 0.0 and result.steps.start_s[0] == 0.0


@settings(max_examples=15, deadline=None)
@given(concurrency=st.integers(1, 5), num_prompts=st.integers(1, 12), input_len=st.integers(1, 400),
       output_len=st.integers(1, 10), rate=st.sampled_from([math.inf, 8.0]), num_warmups=st.integers(0, 3),
       seed=st.integers(0, 3))
def test_without_prefix_caching_the_benchmark_is_the_old_one_shifted(concurrency, num_prompts, input_len, output_len,
                                                                      rate, num_warmups, seed):
    """With --no-prefix-caching the test request and warm-ups leave nothing the benchmark can use
    (every block freed, none cached), so its requests run as they did without them, every time
    shifted by the warm-up span B: the same steps, of the same seconds. Not exactly B later: the
    engine's clock adds each step's seconds to a later start, and floating-point sums round
    differently (to about 1e-15 relative)."""
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", 512, 256), model="tiny", seed=seed,
                            cache=CacheConfig(16, 400, enable_prefix_caching=False))
    plan = resolve(options)
    old, _ = run_bench(BenchSpec(concurrency, input_len, output_len, num_prompts, rate, test_request=False), plan)
    new, loop = run_bench(BenchSpec(concurrency, input_len, output_len, num_prompts, rate, num_warmups=num_warmups,
                                    test_request=True), resolve(options))
    start = loop.start_s
    assert start > 0 and new.warmup["requests"] == num_warmups + 1
    assert len(new.steps) == len(old.steps)
    np.testing.assert_array_equal(new.steps.seconds, old.steps.seconds)
    np.testing.assert_array_equal(new.steps.num_prefill_tokens, old.steps.num_prefill_tokens)
    np.testing.assert_allclose(new.steps.start_s, old.steps.start_s + start, rtol=1e-12, atol=1e-12)
    for name in ("client_sent_s", "arrival_s", "first_token_s", "finish_s"):
        np.testing.assert_allclose([getattr(r, name) for r in new.requests],
                                   [getattr(r, name) + start for r in old.requests], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(new.token_times, old.token_times + start, rtol=1e-12, atol=1e-12)
    assert new.num_preemptions == old.num_preemptions


@pytest.mark.slow
def test_the_cli_runs_warmups_and_leaves_them_out(tmp_path, capsys):
    import pandas as pd

    out = tmp_path / "b"
    assert main(["bench", "--concurrency", "2", "--input-len", "64", "--output-len", "4", "--num-prompts", "4",
                 "--num-warmups", "3", "--ready-check-timeout-sec", "60", "--model", "tiny", "--out", str(out),
                 "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    warmup = summary["warmup"]
    assert warmup["test_request"] is True and warmup["num_warmups"] == 3 and warmup["requests"] == 4
    rows = pd.read_csv(out / "requests.csv")
    steps = pd.read_parquet(out / "steps.parquet")
    assert sorted(rows["request_id"]) == [f"bench-{i}" for i in range(4)] and summary["num_requests"] == 4
    assert len(steps) == summary["num_steps"] and steps["start_s"].min() >= warmup["benchmark_start_s"]
    assert rows["client_ttft_s"].notna().all() and rows["arrival_s"].min() > warmup["benchmark_start_s"]
    assert summary["duration_s"] == pytest.approx(rows["finish_s"].max() - warmup["benchmark_start_s"])
    assert rows.set_index("request_id").loc["bench-0", "prefix_hit_tokens"] == 48
    # --ready-check-timeout-sec 0: no test request, no warm-up entry, request 0 computed whole.
    out = tmp_path / "c"
    assert main(["bench", "--concurrency", "2", "--input-len", "64", "--output-len", "4", "--num-prompts", "4",
                 "--ready-check-timeout-sec", "0", "--model", "tiny", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "warmup" not in summary and summary["prefix_cache_hit_rate"] == 0.0
    assert main(["bench", "--concurrency", "2", "--input-len", "64", "--output-len", "4", "--num-prompts", "4",
                 "--num-warmups", "-1", "--out", str(tmp_path / "d")]) == 2
    assert "--num-warmups must be a whole number from 0" in capsys.readouterr().err
