"""--stream-interval N: vLLM's API server streams a request's tokens in chunks (vllm/v1/engine/output_processor.py,
RequestState.make_request_output), and vLLM's bench records one ITL per chunk. By hand, against a literal
reading of vLLM's rule over random runs, and end to end through `sim bench`. (tests/parity/
test_stream_interval_parity.py runs vLLM's own OutputProcessor.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reports.metrics import summarize
from reports.outcomes import RequestOutcomes, outcomes_from_result, stream_chunk_times
from sim.app.bench import BenchSpec, run_bench, write_bench
from sim.app.cli import main
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.app.replay import replay, write_run
from sim.config import SLO, CacheConfig, SchedulerConfig
from sim.errors import ServesimError
from tests.helpers import ConstantBackend, make_trace
from traces import AZURE_CONV_SAMPLE


def vllm_sends(num_tokens: int, interval: int) -> list[int]:
    """The token counts at which vLLM's RequestState.make_request_output returns an output, one new token a
    step, read literally: finished, or nothing sent yet, or `interval` tokens since the last send."""
    sent, sends = 0, []
    for count in range(1, num_tokens + 1):
        if interval == 1 or count == num_tokens or sent == 0 or count - sent >= interval:
            sends.append(count)
            sent = count
    return sends


def finished_request(times: list[float], arrival_s: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(request_id="r0", arrival_s=arrival_s, num_prompt_tokens=10, max_tokens=len(times),
                           status=SimpleNamespace(value="finished"), first_scheduled_s=arrival_s,
                           first_token_s=times[0], finish_s=times[-1], num_preemptions=0, num_prefix_hit_tokens=0,
                           reject_reason=None)


# One request of 7 output tokens at these times (arrival 0), streamed 3 at a time: vLLM sends token 1 (nothing
# sent yet), tokens 2-4 once 3 have gathered, tokens 5-7 with the finish.
SEVEN = [0.5, 0.75, 1.0, 1.5, 1.75, 2.0, 3.0]


def test_seven_tokens_three_at_a_time_by_hand():
    assert vllm_sends(7, 3) == [1, 4, 7]
    assert stream_chunk_times(SEVEN, 3) == [0.5, 1.5, 3.0]
    assert stream_chunk_times(np.array(SEVEN), 3).tolist() == [0.5, 1.5, 3.0]
    # An eighth token is sent alone at the finish; one token, or an interval of 1, is as it was.
    assert stream_chunk_times([*SEVEN, 3.5], 3) == [0.5, 1.5, 3.0, 3.5] and vllm_sends(8, 3) == [1, 4, 7, 8]
    assert stream_chunk_times(SEVEN, 1) is SEVEN and stream_chunk_times([0.5], 3) == [0.5]
    assert stream_chunk_times(SEVEN, 100) == [0.5, 3.0]  # the first token, then the rest at the finish

    def outcomes(interval: int) -> RequestOutcomes:
        o = RequestOutcomes(SLO(tbt=1.2), stream_interval=interval)
        o.add(0, finished_request(SEVEN), list(SEVEN))
        o.close()
        return o

    one, three = outcomes(1), outcomes(3)
    s1, s3 = (summarize(SimpleNamespace(num_preemptions=0, end_s=3.0, steps=[], num_prefix_hit_tokens=0,
                                        num_prefix_queried_tokens=0), o, {}) for o in (one, three))
    # The client's ITL: the gaps between chunks, 1.0 and 1.5 s (vLLM's bench: one ITL per chunk received).
    assert three.client_itl.values().tolist() == [1.0, 1.5]
    assert s3["client_itl"]["mean"] == 1.25 and s3["client_itl"]["p50"] == 1.25
    assert "client_itl" not in s1
    # The engine's ITL, TTFT, TPOT and E2E are the same: the first chunk is the first token, the last chunk
    # the finish, and vLLM's TPOT divides by the tokens (its usage count), not the chunks.
    assert three.itl.values().tolist() == one.itl.values().tolist() == [0.25, 0.25, 0.5, 0.25, 0.25, 1.0]
    for name in ("ttft", "tpot", "e2e", "itl"):
        assert s3[name] == s1[name], name
    assert s3["ttft"]["mean"] == 0.5 and s3["e2e"]["mean"] == 3.0 and s3["tpot"]["mean"] == 2.5 / 6
    # A tbt limit of 1.2 s: the longest gap between tokens is 1.0 s, between chunks 1.5 s (what the client sees).
    assert (s1["slo_attainment"], s3["slo_attainment"]) == (1.0, 0.0)


def test_a_bench_of_seven_tokens_three_at_a_time_by_hand(tmp_path):
    # One client, every step 0.25 s, no API server: tokens at 0.25, 0.5, ..., 1.75 s; chunks at 0.25, 1.0, 1.75.
    options = dict(scheduler=SchedulerConfig("chunked", 2048, 256, stream_interval=3), cache=CacheConfig(16, None),
                   api_server="off")
    plan = resolve(ReplayOptions(**options), ConstantBackend(0.25))
    spec = BenchSpec(1, 100, 7, 1, test_request=False)  # (the clock starts at 0: no test request before it)
    result, _ = run_bench(spec, plan)
    assert result.tokens_of(0).tolist() == [0.25 * k for k in range(1, 8)]
    summary = write_bench(tmp_path / "b", result, plan, spec)
    assert summary["client_itl"] == {"mean": 0.75, "p50": 0.75, "p90": 0.75, "p99": 0.75}
    assert summary["itl"]["mean"] == 0.25 and summary["tpot"]["mean"] == 0.25
    assert summary["ttft"]["mean"] == 0.25 and summary["e2e"]["mean"] == 1.75
    # vLLM counts a chunk as one token: chunks at 1.0 and 1.75 s in second 1 (its tokens: 4, at 1.0 to 1.75 s)
    assert summary["peak_output_tokens_per_s"] == 2.0
    assert summary["options"]["scheduler"]["stream_interval"] == 3


def test_an_interval_below_one_is_refused():
    with pytest.raises(ServesimError, match="--stream-interval must be a whole number from 1 to 16,777,216 tokens"):
        SchedulerConfig(stream_interval=0)


# Random traces: (arrival, prompt, output) rows; runs on the roofline with a small KV cache (preemptions too).
rows = st.lists(st.tuples(st.floats(0, 2, allow_nan=False).map(lambda x: round(x, 3)), st.integers(1, 300),
                          st.integers(1, 40)), min_size=1, max_size=12)


def run_with(trace, interval: int, slo: SLO):
    options = ReplayOptions(model="tiny", scheduler=SchedulerConfig("chunked", 256, 8, stream_interval=interval),
                            cache=CacheConfig(16, 48), slo=slo)
    return resolve(options)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(rows, st.integers(2, 50), st.sampled_from([0.001, 0.01, 0.05]))
def test_only_the_clients_figures_change(trace_rows, interval, tbt):
    """Over random traces: with N > 1 the engine's run is N = 1's (every request and token time, every summary
    figure but the client's ITL and a tbt SLO's goodput), and the client's ITL is every gap between the sends
    of vLLM's rule (vllm_sends), pooled in request order. N = 1 reports no client ITL and no option."""
    trace = make_trace(trace_rows)
    slo = SLO(tbt=tbt)
    plan1, plan_n = run_with(trace, 1, slo), run_with(trace, interval, slo)
    r1, rn = replay(trace, plan1), replay(trace, plan_n)
    assert np.array_equal(r1.token_times, rn.token_times, equal_nan=True)
    o1, on = (outcomes_from_result(r, slo, stream_interval=n) for r, n in ((r1, 1), (rn, interval)))
    s1, sn = summarize(r1, o1, plan1.as_dict()), summarize(rn, on, plan_n.as_dict())
    assert "client_itl" not in s1 and "stream_interval" not in s1["options"]["scheduler"]
    assert sn["options"]["scheduler"].pop("stream_interval") == interval
    expected, longest = [], []
    for i, r in enumerate(rn.requests):
        if r.finish_s is None:
            continue
        if r.max_tokens < 2:  # no gap: a tbt limit does not constrain it
            longest.append(0.0)
            continue
        times = rn.tokens_of(i)
        gaps = np.diff(times[np.array(vllm_sends(r.max_tokens, interval)) - 1])
        expected.extend(gaps.tolist())
        longest.append(gaps.max())
    assert on.client_itl.values().tolist() == expected
    assert sn.pop("goodput") * s1["duration_s"] == pytest.approx(sum(g <= tbt for g in longest), abs=1e-9)
    sn.pop("slo_attainment"), s1.pop("goodput"), s1.pop("slo_attainment")
    assert sn.pop("client_itl")["mean"] == (pytest.approx(np.mean(expected)) if expected else None)
    assert sn == s1


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(rows)
def test_an_interval_of_one_writes_the_files_of_no_interval(tmp_path_factory, trace_rows):
    """N = 1 (given) and the option left out write the same bytes."""
    trace = make_trace(trace_rows)
    written = []
    for scheduler in (SchedulerConfig("chunked", 256, 8), SchedulerConfig("chunked", 256, 8, stream_interval=1)):
        out = tmp_path_factory.mktemp("run")
        write_run(out, replay(trace, resolve(ReplayOptions(model="tiny", scheduler=scheduler))),
                  resolve(ReplayOptions(model="tiny", scheduler=scheduler)), trace)
        written.append({p.name: p.read_bytes() for p in out.iterdir() if p.name != ".servesim-files.json"})
    assert written[0] == written[1]


@pytest.mark.slow
def test_sim_bench_streams_in_chunks(tmp_path, capsys):
    """`sim bench --stream-interval 4`: vLLM's table's ITL rows are the client's (the gaps between chunks),
    TTFT, TPOT and E2E are those of --stream-interval 1, and --stream-interval 1 writes the files of no flag."""
    args = ["bench", "--concurrency", "2", "--input-len", "64", "--output-len", "9", "--num-prompts", "4",
            "--model", "tiny"]
    summaries, tables = {}, {}
    for name, extra in (("none", []), ("one", ["--stream-interval", "1"]), ("four", ["--stream-interval", "4"])):
        assert main([*args, *extra, "--out", str(tmp_path / name)]) == 0
        tables[name] = capsys.readouterr().out
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    for file in ("summary.json", "requests.csv", "digest.json", "report.html", "steps.parquet"):
        assert (tmp_path / "none" / file).read_bytes() == (tmp_path / "one" / file).read_bytes(), file
    four, one = summaries["four"], summaries["one"]
    for name in ("ttft", "client_ttft", "tpot", "e2e", "client_e2e", "itl"):
        assert four[name] == one[name], name
    # 9 tokens, 4 at a time: sends at tokens 1, 5, 9, so two ITLs of four token gaps each per request.
    assert four["client_itl"]["mean"] == pytest.approx(4 * one["tpot"]["mean"])
    assert f"Mean ITL (ms):                           {four['client_itl']['mean'] * 1e3:<10.2f}" in tables["four"]
    assert f"Mean TPOT (ms):                          {one['tpot']['mean'] * 1e3:<10.2f}" in tables["four"]
    assert four["peak_output_tokens_per_s"] == 12.0 and one["peak_output_tokens_per_s"] == 36.0  # chunks, tokens
    assert (tmp_path / "four" / "requests.csv").read_bytes() == (tmp_path / "one" / "requests.csv").read_bytes()
    assert main([*args, "--stream-interval", "0", "--out", str(tmp_path / "zero")]) == 2
    assert "--stream-interval must be a whole number from 1" in capsys.readouterr().err


def test_the_reports_itl_cdf_shows_the_clients_chunks_beside_the_engines(tmp_path):
    """report.html's ITL panel: the engine's gaps (solid) and, with --stream-interval above 1, the
    streaming client's gaps between chunks (dotted, the digest's client_itl sketch); at 1 only the engine's."""
    from reports.digest import summary_row
    from reports.figures import cdf_figure

    figures = {}
    for n in (1, 4):
        out = tmp_path / str(n)
        assert main(["replay", str(AZURE_CONV_SAMPLE), "--limit", "30", "--stream-interval", str(n), "--out", str(out),
                     "--quiet"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        digest = json.loads((out / "digest.json").read_text())
        figures[n] = (cdf_figure([summary_row(summary, digest)], [], None), digest)
    itl_panel = {"xaxis": "x3", "yaxis": "y3"}  # the third of the four CDFs
    for n, (figure, digest) in figures.items():
        panel = [t for t in figure["data"] if all(t[k] == v for k, v in itl_panel.items())]
        dotted = [t for t in panel if t["line"].get("dash") == "dot"]
        assert len(panel) == (2 if n == 4 else 1) and len(dotted) == (1 if n == 4 else 0)
        if dotted:
            assert dotted[0]["x"] == digest["client_itl"] and "client, per chunk" in dotted[0]["name"]
