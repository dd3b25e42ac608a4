"""AIPerf's profile_export.jsonl as a trace (traces/aiperf.py): each record a request sent at its
request_start_ns, its prediction beside AIPerf's measurement; every bad record named by file and line."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.errors import ServesimError
from traces import read_trace

T0 = 1759813207532900363  # nanoseconds since 1970, as AIPerf writes request_start_ns


def record(start_ns: int, isl: int, osl: int, ttft_ms: float | None = 40.0, e2e_ms: float | None = 140.0, *,
           phase: str = "profiling", turn: int = 0, error: dict | None = None, **metrics) -> dict:
    """One AIPerf record (MetricRecordInfo) as profile_export.jsonl writes it."""
    values = {"input_sequence_length": {"value": isl, "unit": "tokens"},
              "output_sequence_length": {"value": osl, "unit": "tokens"}}
    if ttft_ms is not None:
        values["time_to_first_token"] = {"value": ttft_ms, "unit": "ms"}
    if e2e_ms is not None:
        values["request_latency"] = {"value": e2e_ms, "unit": "ms"}
        if ttft_ms is not None and osl > 1:
            values["inter_token_latency"] = {"value": (e2e_ms - ttft_ms) / (osl - 1), "unit": "ms"}
    values.update(metrics)
    return {"metadata": {"session_num": 0, "x_request_id": "id", "conversation_id": "c", "turn_index": turn,
                         "request_start_ns": start_ns, "request_ack_ns": None, "request_end_ns": start_ns + 10**8,
                         "worker_id": "worker_1", "record_processor_id": "rp_1", "benchmark_phase": phase,
                         "was_cancelled": error is not None and error.get("code") == 499, "cancellation_time_ns": None},
            "metrics": {"error_isl": {"value": isl, "unit": "tokens"}} if error else values,
            "error": error}


def export(path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


RECORDS = [  # in finishing order, as AIPerf writes them
    record(T0 + 100_000_000, 300, 11, 40.0, 140.0),
    record(T0, 550, 21, 50.0, 250.0),
    record(T0 + 200_000_000, 550, 5, error={"code": 499, "type": "RequestCancellationError", "message": "cancelled"}),
    record(T0 + 250_000_000, 120, 1, 30.0, 30.0),
]


def test_an_aiperf_export_is_its_requests_sent_when_the_client_sent_them(tmp_path):
    path = tmp_path / "profile_export.jsonl"
    export(path, RECORDS)
    trace = read_trace(path)
    assert trace.format == "aiperf" and read_trace(path, "aiperf").format == "aiperf"
    assert trace.arrival_s.tolist() == pytest.approx([0.0, 0.1, 0.25])  # sent in this order, nanoseconds exact
    assert trace.prompt_tokens.tolist() == [550, 300, 120] and trace.output_tokens.tolist() == [21, 11, 1]
    assert trace.request_ids == ["2", "1", "4"]  # each record's line
    assert trace.dropped == {"an error (the record's error)": 1}
    assert any("profile_export.jsonl:3: dropped 1 request with an error (the record's error)" in w for w in trace.warnings)
    m = trace.measured
    assert m["ttft_s"].tolist() == pytest.approx([0.05, 0.04, 0.03])
    assert m["e2e_s"].tolist() == pytest.approx([0.25, 0.14, 0.03])
    # TPOT as AIPerf's inter_token_latency (and vLLM's TPOT): (E2E - TTFT) / (OSL - 1); none for one token
    assert m["tpot_s"][:2].tolist() == pytest.approx([0.2 / 20, 0.1 / 10]) and np.isnan(m["tpot_s"][2])


def test_times_in_other_units_are_read_in_them(tmp_path):
    path = tmp_path / "profile_export.jsonl"
    export(path, [record(T0, 100, 3, time_to_first_token={"value": 0.04, "unit": "s"},
                         request_latency={"value": 60_000, "unit": "us"})])
    m = read_trace(path).measured
    assert m["ttft_s"].tolist() == pytest.approx([0.04]) and m["e2e_s"].tolist() == pytest.approx([0.06])


def test_warm_up_records_load_the_server_but_are_not_compared_and_later_turns_are_named(tmp_path):
    path = tmp_path / "profile_export.jsonl"
    export(path, [record(T0, 100, 3, phase="warmup"), record(T0 + 10**9, 200, 3, turn=1),
                  record(T0 + 2 * 10**9, 100, 3)])
    trace = read_trace(path)
    assert len(trace) == 3 and np.isnan(trace.measured["ttft_s"][0]) and np.isfinite(trace.measured["ttft_s"][1:]).all()
    text = "\n".join(trace.warnings)
    assert "profile_export.jsonl:1: 1 record(s) of another benchmark phase than profiling" in text
    assert "profile_export.jsonl:2: 1 record(s) are later turns of multi-turn conversations" in text


@pytest.mark.parametrize("change, message", [
    (lambda r: r["metadata"].pop("request_start_ns"), ":1: missing field 'metadata.request_start_ns'"),
    (lambda r: r["metadata"].update(request_start_ns=1.5e18), ":1: metadata.request_start_ns must be a whole number"),
    (lambda r: r["metadata"].update(request_start_ns=True), ":1: metadata.request_start_ns must be a whole number"),
    (lambda r: r["metadata"].update(request_start_ns=-1), ":1: metadata.request_start_ns must be a whole number"),
    (lambda r: r.pop("metadata"), ":1: missing field 'metadata' (an AIPerf record has metadata, metrics)"),
    (lambda r: r.update(metadata=[1]), ":1: metadata must be a JSON object, got [1]"),
    (lambda r: r.update(metrics=None), ":1: metrics must be a JSON object for a request without an error"),
    (lambda r: r["metrics"].pop("input_sequence_length"), ":1: missing metric 'input_sequence_length'"),
    (lambda r: r["metrics"].update(input_sequence_length=5), ":1: input_sequence_length must be an object with a value"),
    (lambda r: r["metrics"]["output_sequence_length"].update(value=2.5), ":1: output_sequence_length must be a whole"),
    (lambda r: r["metrics"]["output_sequence_length"].update(value=-3), ":1: output_sequence_length must not be neg"),
    (lambda r: r["metrics"]["output_sequence_length"].update(unit="chars"), ":1: output_sequence_length is in "
                                                                             '"chars", expected tokens'),
    (lambda r: r["metrics"]["time_to_first_token"].update(unit="min"), ':1: time_to_first_token is in "min"; expected'),
    (lambda r: r["metrics"]["time_to_first_token"].update(value="4"), ":1: time_to_first_token must be a number"),
    (lambda r: r["metrics"]["time_to_first_token"].update(value=0), ":1: time_to_first_token is 0 for a request that"),
    (lambda r: r["metrics"]["time_to_first_token"].update(value=500.0), ":1: time_to_first_token 500 ms is past its "
                                                                          "request_latency 140 ms"),
])
def test_a_record_aiperf_could_not_have_written_is_refused_naming_the_line(tmp_path, change, message):
    first = record(T0, 100, 3)
    change(first)
    path = tmp_path / "profile_export.jsonl"
    export(path, [first, record(T0 + 1, 100, 3)])
    with pytest.raises(ServesimError, match=re.escape(str(path) + message)):
        read_trace(path, "aiperf")


def test_a_line_that_is_not_a_record_is_named(tmp_path):
    path = tmp_path / "profile_export.jsonl"
    path.write_text(json.dumps(record(T0, 100, 3)) + "\n[1, 2]\n")
    with pytest.raises(ServesimError, match=re.escape(f"{path}:2: expected an AIPerf record")):
        read_trace(path)
    path.write_text(json.dumps(record(T0, 100, 3)) + "\n{not json\n")
    with pytest.raises(ServesimError, match=re.escape(f"{path}:2: not valid JSON")):
        read_trace(path)
    path.write_text(json.dumps(record(T0, 100, 3)) + "\n" + json.dumps(record(T0, 100, 3))[:50] + "\n")
    with pytest.raises(ServesimError, match=re.escape(f"{path}:2: not valid JSON (Unterminated string starting at "
                                                      "column 49)")):
        read_trace(path)  # (Python's message ends in "at": not "at at column")
    path.write_text(json.dumps(record(T0, 100, 3)).replace('"error": null', '"error": null, "error": null') + "\n")
    with pytest.raises(ServesimError, match=re.escape(f"{path}:1: ")):
        read_trace(path, "aiperf")
    export(path, [record(T0, 100, 3, error={"code": 500, "type": "HTTPError", "message": "x"})])
    with pytest.raises(ServesimError, match="no requests left to replay"):
        read_trace(path)


LEAF = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**64), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=3))
METRIC = st.one_of(LEAF, st.fixed_dictionaries({"value": LEAF}, optional={"unit": st.one_of(st.sampled_from(
    ["ms", "s", "ns", "tokens", "x"]), LEAF, st.lists(LEAF, max_size=2), st.dictionaries(st.text(max_size=2), LEAF))}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries(
    {"metadata": st.one_of(LEAF, st.dictionaries(st.sampled_from(["request_start_ns", "benchmark_phase", "turn_index",
                                                                  "was_cancelled"]), LEAF))},
    optional={"metrics": st.one_of(LEAF, st.dictionaries(st.sampled_from(
        ["input_sequence_length", "output_sequence_length", "time_to_first_token", "request_latency"]), METRIC)),
        "error": st.one_of(st.none(), st.text(max_size=2))}))
def test_any_record_reads_or_is_refused_by_name_never_a_traceback(tmp_path, rec):
    path = tmp_path / "profile_export.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    try:
        trace = read_trace(path, "aiperf")
    except ServesimError as e:
        assert str(e).startswith(str(path))
        return
    assert len(trace) == 1 and trace.prompt_tokens[0] > 0 and trace.output_tokens[0] > 0


def test_sim_replay_of_an_aiperf_export_puts_each_requests_prediction_beside_its_measurement(tmp_path, capsys):
    import pandas as pd

    from sim.app.cli import main

    path = tmp_path / "profile_export.jsonl"
    export(path, RECORDS)
    assert main(["replay", str(path), "--out", str(tmp_path / "run")]) == 0
    requests = pd.read_csv(tmp_path / "run" / "requests.csv", dtype={"request_id": str}).set_index("request_id")
    assert sorted(requests.index) == ["1", "2", "4"] and (requests["status"] == "finished").all()
    comparison = json.loads((tmp_path / "run" / "measured.json").read_text())
    assert comparison["requests"] == 3 and comparison["predicted_from"] == "send"  # AIPerf's times are its sends
    ttft = comparison["metrics"]["ttft"]
    assert ttft["measured_mean_ms"] == pytest.approx((50 + 40 + 30) / 3)
    assert ttft["predicted_mean_ms"] == pytest.approx(1e3 * requests["client_ttft_s"].mean())
    assert comparison["metrics"]["tpot"]["requests"] == 2  # the one-token request has no TPOT
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["options"]["api_server"]["why"] == "auto: the times of the aiperf trace are its client's sends"
    assert "against the trace's own measurements (3 requests)" in capsys.readouterr().out


# Hostile inputs found in review: each read right or refused in one line naming the file and line.

def test_a_whole_number_longer_than_python_reads_is_named_not_a_traceback(tmp_path, capsys):
    from sim.app.cli import main

    path = tmp_path / "profile_export.jsonl"
    path.write_text(json.dumps(record(T0, 100, 3)) + "\n"
                    + '{"metadata": {"request_start_ns": ' + "9" * 5000 + '}, "metrics": {}, "error": null}\n')
    assert main(["trace", "stats", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"sim: error: {path}:2: not valid JSON (a whole number of more than 4,300 digits at column 35)\n"
    # (shared with the other JSON formats: a Mooncake line, a vLLM bench result)
    mooncake = tmp_path / "t.jsonl"
    mooncake.write_text('{"timestamp": ' + "1" * 4400 + ', "input_length": 1, "output_length": 1}\n')
    with pytest.raises(ServesimError, match=re.escape(f"{mooncake}:1: not valid JSON (a whole number of more than")):
        read_trace(mooncake)


@pytest.mark.parametrize("unit", [["ms"], {"ms": 1}, None, 3])
def test_a_time_unit_that_is_not_text_is_named(tmp_path, unit):
    path = tmp_path / "profile_export.jsonl"
    export(path, [record(T0, 100, 3, time_to_first_token={"value": 4, "unit": unit})])
    with pytest.raises(ServesimError, match=re.escape(f"{path}:1: time_to_first_token is in {json.dumps(unit)}; "
                                                      "expected one of ns, us, ms, s, sec")):
        read_trace(path)


@pytest.mark.parametrize("metric, message", [
    ({"time_to_first_token": {"value": 1.7e308, "unit": "sec"}, "request_latency": {"value": 1.7e308, "unit": "sec"}},
     ":1: time_to_first_token 1.7e+308 sec is more than 1e+09 s, longer than any trace spans"),
    ({"request_latency": {"value": 2e9, "unit": "s"}}, ":1: request_latency 2e+09 s is more than 1e+09 s"),
    ({"time_to_first_token": {"value": 5e-324, "unit": "s"}}, ":1: time_to_first_token 4.94066e-324 s is under half a "
                                                              "nanosecond"),
    ({"time_to_first_token": {"value": 1e-320, "unit": "ns"}}, ":1: time_to_first_token 9.99989e-321 ns is under half"),
])
def test_a_latency_no_client_measures_is_refused_not_compared_as_infinity(tmp_path, metric, message):
    path = tmp_path / "profile_export.jsonl"
    export(path, [record(T0, 100, 3, **metric), record(T0 + 1, 100, 3)])
    with pytest.raises(ServesimError, match=re.escape(str(path) + message)):
        read_trace(path)
    # a nanosecond is measured, and a vLLM bench result is held to the same range
    export(path, [record(T0, 100, 3, time_to_first_token={"value": 1, "unit": "ns"})])
    assert read_trace(path).measured["ttft_s"].tolist() == [1e-9]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"start_times": [0.0], "input_lens": [10], "output_lens": [3], "ttfts": [1e300],
                                 "latencies": [1e300]}))
    with pytest.raises(ServesimError, match=re.escape(f"{bench}: request 0: latencies 1e+300 s is more than 1e+09 s")):
        read_trace(bench)


def test_a_ttft_and_e2e_of_one_time_in_two_units_are_one_time(tmp_path):
    path = tmp_path / "profile_export.jsonl"  # 1.3 ms * 1e-3 is 0.0013000000000000002 s, past 0.0013 s
    export(path, [record(T0, 100, 1, time_to_first_token={"value": 1.3, "unit": "ms"},
                         request_latency={"value": 0.0013, "unit": "s"}),
                  record(T0 + 1, 100, 3, time_to_first_token={"value": 0.9, "unit": "ms"},
                         request_latency={"value": 900, "unit": "us"})])
    m = read_trace(path).measured
    assert m["ttft_s"].tolist() == pytest.approx([0.0013, 0.0009]) and np.isnan(m["tpot_s"][0])
    assert m["tpot_s"][1] == 0.0  # (not a negative TPOT from the last bits)
    export(path, [record(T0, 100, 3, time_to_first_token={"value": 1.31, "unit": "ms"},
                         request_latency={"value": 0.0013, "unit": "s"})])
    with pytest.raises(ServesimError, match=re.escape(f"{path}:1: time_to_first_token 1.31 ms is past its")):
        read_trace(path)


def test_a_dropped_warm_up_or_later_turn_record_is_not_counted_as_replayed(tmp_path):
    path = tmp_path / "profile_export.jsonl"
    export(path, [record(T0, 100, 0, phase="warmup"), record(T0 + 1, 0, 3, turn=2), record(T0 + 2, 100, 3, phase="warmup"),
                  record(T0 + 3, 100, 3)])
    trace = read_trace(path)
    assert len(trace) == 2 and trace.dropped == {"0 output_sequence_length": 1, "0 input_sequence_length": 1}
    text = "\n".join(trace.warnings)
    assert "profile_export.jsonl:3: 1 record(s) of another benchmark phase than profiling" in text
    assert "later turns" not in text


def test_a_vllm_bench_result_that_mentions_metadata_and_metrics_is_not_taken_for_aiperf(tmp_path):
    bench = {"num_prompts": 2, "start_times": [0.0, 0.5], "input_lens": [10, 20], "output_lens": [2, 3],
             "ttfts": [0.01, 0.02], "latencies": [0.1, 0.2]}
    path = tmp_path / "result.json"
    path.write_text(json.dumps({**bench, "generated_texts": ["metadata", "metrics"]}) + "\n")
    assert read_trace(path).format == "vllm-bench"
    path.write_text(json.dumps({**bench, "metadata": "run 7", "metrics": "ttft,tpot"}) + "\n")  # --metadata k=v
    assert read_trace(path).format == "vllm-bench"
    # and an AIPerf record that says "timestamp" inside (an HTTP header of its trace_data) is one
    rec = {**record(T0, 100, 3), "trace_data": {"trace_type": "aiohttp", "response_headers": {"timestamp": "1"}}}
    path = tmp_path / "profile_export.jsonl"
    export(path, [rec])
    assert read_trace(path).format == "aiperf"
    # a line naming the fields that is not JSON is still the AIPerf reader's to name
    path.write_text('{"metadata": {}, "metrics": {\n')
    with pytest.raises(ServesimError, match=re.escape(f"{path}:1: not valid JSON")):
        read_trace(path)
