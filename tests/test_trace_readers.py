"""Trace readers: real cuts of the published files, hand-written edge cases, bad input per format."""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.errors import ServesimError
from traces import AZURE_CONV_SAMPLE, MOONCAKE_SAMPLE, read_trace
from traces.trace import Trace

DATA = Path(__file__).parent / "data" / "traces"
AZURE_CODE_CUT = DATA / "azure_code_2023_first100.csv"
BURSTGPT = DATA / "burstgpt_handmade.csv"
VIDUR = DATA / "vidur_handmade.csv"


def same_requests(a: Trace, b: Trace) -> None:
    assert np.array_equal(a.arrival_s, b.arrival_s)
    assert np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert np.array_equal(a.output_tokens, b.output_tokens)
    assert a.request_ids == b.request_ids
    assert (a.hash_ids is None) == (b.hash_ids is None)
    if a.hash_ids is not None:
        assert len(a.hash_ids) == len(b.hash_ids)
        assert all(np.array_equal(x, y) for x, y in zip(a.hash_ids, b.hash_ids))
        assert a.hash_block_tokens == b.hash_block_tokens
    assert (a.priority is None) == (b.priority is None)
    if a.priority is not None:
        assert np.array_equal(a.priority, b.priority)


# Real cuts of the published files.

def test_azure_conv_sample():
    t = read_trace(AZURE_CONV_SAMPLE)
    assert t.format == "azure" and len(t) == 1445 and t.hash_ids is None and not t.warnings
    # 2023-11-16 18:15:46.6805900, 18:15:50.9951690, 18:15:51.2224670
    assert t.arrival_s[:3].tolist() == pytest.approx([0.0, 4.314579, 4.541877], abs=1e-9)
    assert t.prompt_tokens[:3].tolist() == [374, 396, 879]
    assert t.output_tokens[:3].tolist() == [44, 109, 55]
    assert t.duration_s == pytest.approx(299.884, abs=1e-3)


def test_azure_code_cut_crlf_without_final_newline():
    raw = AZURE_CODE_CUT.read_bytes()
    assert raw.count(b"\r\n") == 100 and not raw.endswith(b"\n")
    t = read_trace(AZURE_CODE_CUT)
    assert len(t) == 100
    # First line 18:17:03.9799600 4808/10, second 18:17:04.0319600 3180/8, last 18:20:16.1421010 523/9.
    assert t.arrival_s[1] == pytest.approx(0.052, abs=1e-9)
    assert t.arrival_s[-1] == pytest.approx(192.162141, abs=1e-9)
    assert (t.prompt_tokens[0], t.output_tokens[0], t.prompt_tokens[-1], t.output_tokens[-1]) == (4808, 10, 523, 9)


def test_mooncake_cut_keeps_hash_ids():
    t = read_trace(MOONCAKE_SAMPLE)
    lines = [json.loads(line) for line in MOONCAKE_SAMPLE.read_text().splitlines()]
    assert t.format == "mooncake" and len(t) == len(lines) == 200 and t.hash_block_tokens == 512
    assert t.arrival_s.tolist() == [(r["timestamp"] - 973362) / 1000 for r in lines]
    assert t.prompt_tokens.tolist() == [r["input_length"] for r in lines]
    assert t.output_tokens.tolist() == [r["output_length"] for r in lines]
    assert [h.tolist() for h in t.hash_ids] == [r["hash_ids"] for r in lines]
    assert all(len(h) == math.ceil(p / 512) for h, p in zip(t.hash_ids, t.prompt_tokens))


def test_burstgpt_drops_and_counts_failed_requests():
    t = read_trace(BURSTGPT)
    assert t.format == "burstgpt"
    assert t.arrival_s.tolist() == [0, 40, 41, 126, 195]  # seconds, from the first kept request (5 s)
    assert t.prompt_tokens.tolist() == [472, 1087, 417, 1650, 95]
    assert t.output_tokens.tolist() == [18, 230, 276, 402, 61]
    assert t.dropped == {"0 Response tokens (failed)": 2, "0 Request tokens": 1}
    assert f"{BURSTGPT}:5: dropped 2 requests with 0 Response tokens (failed)" in t.warnings


def test_burstgpt_model_filter():
    t = read_trace(BURSTGPT, model_filter="GPT-4")
    assert t.prompt_tokens.tolist() == [417, 1650] and t.arrival_s.tolist() == [0, 85]
    assert t.dropped == {"model other than GPT-4": 5, "0 Response tokens (failed)": 1}
    with pytest.raises(ServesimError, match=r"no request of model 'Claude'; the trace has ChatGPT, GPT-4"):
        read_trace(BURSTGPT, model_filter="Claude")
    with pytest.raises(ServesimError, match="--model-filter applies to BurstGPT traces only"):
        read_trace(VIDUR, model_filter="GPT-4")


def test_vidur_splitwise_csv():
    t = read_trace(VIDUR)
    assert t.format == "vidur"
    assert t.arrival_s.tolist() == [0.0, 4.314579, 4.541877, 5.8926549999999995, 7.745497]
    assert t.prompt_tokens.tolist() == [374, 396, 879, 91, 1313]
    assert t.output_tokens.tolist() == [44, 109, 55, 16, 142]
    assert read_trace(VIDUR, "splitwise").format == "vidur"


def test_azure_2024_timestamps_with_time_zone(tmp_path):
    path = tmp_path / "week.csv.gz"  # hand-made in the 2024 layout: same columns, UTC stamps
    with gzip.open(path, "wt") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.008010+00:00,4808,10\n"
                "2024-05-10 00:00:01.5+00:00,3180,8\n2024-05-10 00:01:00+00:00,1,1\n")
    t = read_trace(path, "azure2024")
    assert t.arrival_s.tolist() == pytest.approx([0.0, 1.49199, 59.99199], abs=1e-9)
    assert t.prompt_tokens.tolist() == [4808, 3180, 1]


@pytest.mark.parametrize("path", [AZURE_CONV_SAMPLE, MOONCAKE_SAMPLE, BURSTGPT, VIDUR])
def test_gzip_files_read_directly(tmp_path, path):
    packed = tmp_path / (path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes()))
    same_requests(read_trace(packed), read_trace(path))


@pytest.mark.parametrize("path,chunk_rows", [
    (AZURE_CONV_SAMPLE, 250), (AZURE_CODE_CUT, 1), (AZURE_CODE_CUT, 7), (MOONCAKE_SAMPLE, 1), (MOONCAKE_SAMPLE, 64),
    (BURSTGPT, 1), (BURSTGPT, 3), (VIDUR, 2)])
def test_chunked_reading_gives_the_same_requests(path, chunk_rows):
    whole = read_trace(path)
    chunked = read_trace(path, chunk_rows=chunk_rows)
    same_requests(chunked, whole)
    assert chunked.dropped == whole.dropped and chunked.warnings == whole.warnings


def test_chunked_reading_of_out_of_order_rows_and_hashes(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,request_id,hash_ids,hash_block_tokens\n"
                    "0,20,1,a,1 2,16\n3,20,1,b,1 3,16\n\n1,5,1,c,9,16\n2,40,2,d,1 2 4,16\n")
    whole = read_trace(path)
    assert whole.request_ids == ["a", "c", "d", "b"]
    assert [h.tolist() for h in whole.hash_ids] == [[1, 2], [9], [1, 2, 4], [1, 3]]
    assert whole.warnings == [f"{path}:5: arrivals are out of order; sorted them by arrival time"]
    for rows in (1, 2):
        chunked = read_trace(path, chunk_rows=rows)
        same_requests(chunked, whole)
        assert chunked.warnings == whole.warnings


# Tolerance: BOM, CRLF, blank lines, no final newline.

CLEAN = {
    "canonical": "arrival_s,prompt_tokens,output_tokens,request_id\n0,10,2,a\n1.5,20,3,b\n2.25,30,4,c\n",
    "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,2\n"
             "2023-11-16 18:15:48.1805900,20,3\n2023-11-16 18:15:48.9305900,30,4\n",
    "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                "10,ChatGPT,10,2,12,Conversation log\n11.5,ChatGPT,20,3,23,API log\n12.25,GPT-4,30,4,34,API log\n",
    "vidur": "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,2\n1.5,20,3\n2.25,30,4\n",
    "mooncake": '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
                '{"timestamp": 1500, "input_length": 20, "output_length": 3, "hash_ids": [0]}\n'
                '{"timestamp": 2250, "input_length": 30, "output_length": 4, "hash_ids": [1]}\n',
}


def messy(text: str) -> bytes:
    """A byte-order mark, CRLF line ends, blank lines (also before the header) and no final newline."""
    lines = text.rstrip("\n").split("\n")
    lines = ["", lines[0], "  ", lines[1], "", "", *lines[2:]]
    return b"\xef\xbb\xbf" + "\r\n".join(lines).encode()


@pytest.mark.parametrize("fmt", list(CLEAN))
def test_messy_files_read_like_clean_ones(tmp_path, fmt):
    clean, dirty = tmp_path / f"clean.{fmt}", tmp_path / f"dirty.{fmt}"
    clean.write_text(CLEAN[fmt])
    dirty.write_bytes(messy(CLEAN[fmt]))
    a, b = read_trace(clean), read_trace(dirty)
    assert a.format == b.format == fmt
    same_requests(a, b)
    assert a.arrival_s.tolist() == [0.0, 1.5, 2.25] and a.prompt_tokens.tolist() == [10, 20, 30]


def test_jsonl_extension_and_format_names(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(CLEAN["mooncake"])
    assert read_trace(path).format == "mooncake"
    assert read_trace(path, "MOONCAKE").format == "mooncake"
    with pytest.raises(ServesimError, match="unknown trace format 'parquet'; choose one of canonical, azure"):
        read_trace(path, "parquet")


# Bad input: one line, naming file:line or the value.

BAD = [
    ("canonical", "arrival_s,prompt_tokens\n0,10\n", "{p}:1: missing column 'output_tokens'"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens\n0,10,2\n1,-4,2\n", "{p}:3: prompt_tokens must not be negative, got -4"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens\n0,10,2\n\n1,2.5,2\n", "{p}:4: prompt_tokens must be a whole number, got 2.5"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens\n0,10,2\nnan,1,2\n", "{p}:3: arrival_s is not a number: 'nan'"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens\n0,10,2\ninf,1,2\n", "{p}:3: arrival_s must be finite"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens\n0,10,2\n1,10,2,7\n", "{p}:3: expected 3 fields as in the header, saw 4"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens,arrival_s\n0,10,2,0\n", "{p}:1: column 'arrival_s' appears twice"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens,request_id\n0,10,2,a\n1,10,2,a\n",
     "{p}:3: request_id 'a' appears twice (first at line 2)"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens,hash_ids,hash_block_tokens\n0,600,2,1 x,512\n",
     "{p}:2: hash_ids must be whole numbers separated by spaces, got '1 x'"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens,hash_ids,hash_block_tokens\n0,600,2,1,512\n",
     "{p}:2: 1 hash_ids cannot cover prompt_tokens 600: it needs 2, one per 512 tokens"),
    ("canonical", "arrival_s,prompt_tokens,output_tokens,hash_ids,hash_block_tokens\n0,6,2,1,16\n1,6,2,1,32\n",
     "{p}:3: hash_block_tokens is 32, but earlier lines have 16"),
    ("azure", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,3\n", "{p}:1: missing column 'GeneratedTokens'"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.68,3,1\r\nsoon,3,1",
     "{p}:3: TIMESTAMP 'soon' is not a date and time"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n9999-12-31 23:59:59.0000000,3,1\n",  # a date, out of the clock's range
     "{p}:2: TIMESTAMP '9999-12-31 23:59:59.0000000' is outside the times servesim reads (1677-09-22 to 2262-04-11"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,-3,1\n",
     "{p}:2: ContextTokens must not be negative, got -3"),
    ("burstgpt", "Timestamp,Model,Request tokens,Total tokens,Log Type\n1,ChatGPT,3,4,API log\n",
     "{p}:1: missing column 'Response tokens'"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,3,-1,2,API log\n",
     "{p}:2: Response tokens must not be negative, got -1"),
    ("burstgpt", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,3,0,3,API log\n",
     "no requests left to replay (dropped 1 with 0 Response tokens (failed))"),
    ("vidur", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,1\n1,5,\n", "{p}:3: num_decode_tokens is missing"),
    ("vidur", "arrived_at,num_prefill_tokens,num_decode_tokens\n-1,5,1\n", "{p}:2: arrived_at must not be negative"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1, "input',
     "{p}:2: not valid JSON (Unterminated string"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "hash_ids": [0]}\n', "{p}:1: missing field 'output_length'"),
    ("mooncake", '\n[1, 2, 3]\n', "{p}:2: expected a JSON object"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1, "output_length": 9, "hash_ids": [0]}\n',
     "{p}:1: the key 'output_length' is given twice in one object"),
    ("mooncake", '{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}\n',
     "{p}:1: input_length must not be negative, got -5"),
    ("mooncake", '{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}\n',
     "{p}:1: input_length must be a number, got \"5\""),
    ("mooncake", '{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}\n',
     "{p}:1: 2 hash_ids cannot cover input_length 1025: it needs 3"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0.5]}\n',
     "{p}:1: hash_ids must be a list of whole numbers"),
    ("mooncake", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
                 '{"timestamp": 1, "input_length": 5, "output_length": 1}\n', "{p}:2: missing field 'hash_ids'"),
    (None, "", "{p}: the file is empty"),
    (None, "\n\r\n  \n", "{p}: the file is empty"),
    (None, "arrival_s,prompt_tokens,output_tokens\n\n", "{p}: the trace has a header but no requests"),
    (None, "when,what\n1,2\n", "{p}:1: unknown trace format with columns 'when,what'"),
]


@pytest.mark.parametrize("fmt,text,message", BAD)
def test_bad_input_names_file_and_line(tmp_path, fmt, text, message):
    path = tmp_path / "t"
    path.write_text(text)
    with pytest.raises(ServesimError) as e:
        read_trace(path, fmt)
    assert message.format(p=path) in str(e.value) and "\n" not in str(e.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ServesimError, match="no such file"):
        read_trace(tmp_path / "missing.csv")
    (tmp_path / "bin.csv").write_bytes(b"arrival_s,prompt_tokens,output_tokens\n\xff\xfe,1,1\n")
    with pytest.raises(ServesimError, match="not a text file"):
        read_trace(tmp_path / "bin.csv")
    (tmp_path / "cut.csv.gz").write_bytes(gzip.compress(CLEAN["vidur"].encode())[:30])
    with pytest.raises(ServesimError, match="cut.csv.gz"):
        read_trace(tmp_path / "cut.csv.gz")


# ---- vLLM's bench serve results (--save-result --save-detailed)


def vllm_bench_result(**change) -> dict:
    """A result as vllm/benchmarks/serve.py writes it: per-request lists, two clients' sends."""
    result = {"date": "20261201-120000", "backend": "vllm", "max_concurrency": 2,
              "input_lens": [100, 200, 150, 120], "output_lens": [10, 20, 0, 12],
              "ttfts": [0.05, 0.06, 0.0, 0.05], "itls": [[0.01], [0.01], [], [0.01]],
              "start_times": [1000.5, 1000.0, 1001.0, 1001.25], "errors": ["", "", "timeout", ""]}
    return {**result, **change}


@pytest.mark.parametrize("indent", [None, 2])
def test_a_vllm_bench_result_is_its_requests_sent_when_the_client_sent_them(tmp_path, indent):
    """One line or pretty-printed, detected from its first line; sorted by send time, request ids
    their positions in the lists (so requests.csv joins the file's own ttfts); the failed request
    dropped and counted."""
    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_bench_result(), indent=indent))
    trace = read_trace(path)
    assert trace.format == "vllm-bench"
    assert trace.arrival_s.tolist() == [0.0, 0.5, 1.25]
    assert trace.prompt_tokens.tolist() == [200, 100, 120] and trace.output_tokens.tolist() == [20, 10, 12]
    assert trace.request_ids == ["1", "0", "3"]
    assert trace.dropped == {"an error (in the result's errors)": 1}
    assert trace.warnings == [f"{path}: request 2: dropped 1 request with an error (in the result's errors)"]
    assert read_trace(path, "vllm").format == "vllm-bench"  # the alias
    from traces.stats import format_stats, trace_stats

    stats = trace_stats(trace)  # `sim trace stats` shows the run's own latencies too
    assert stats["measured"]["ttft"]["mean"] == pytest.approx(1e3 * (0.06 + 0.05 + 0.05) / 3)
    assert stats["measured"]["ttft"]["requests"] == 3 and "measured (ms)" in format_stats(stats)
    assert "measured" not in trace_stats(read_trace(AZURE_CONV_SAMPLE))
    # Without an errors list as long as the others (vLLM versions that list the failed ones apart),
    # an output of 0 tokens is dropped as in every format.
    path.write_text(json.dumps(vllm_bench_result(errors=["timeout"])))
    assert read_trace(path).dropped == {"0 output_lens": 1}


def test_a_vllm_bench_result_with_a_timestamp_key_of_its_own_is_one(tmp_path):
    """Found by a review with odd traces: `vllm bench serve --metadata timestamp=...` adds a top-level
    "timestamp", and a result saved on one line was read as Mooncake ("missing field
    'input_length'"). A Mooncake line with the result's words in it stays Mooncake."""
    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_bench_result(timestamp="20261207")))
    assert read_trace(path).format == "vllm-bench" and read_trace(path).request_ids == ["1", "0", "3"]
    path = tmp_path / "mooncake.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "note": "input_lens"}\n')
    assert read_trace(path).format == "mooncake"


@pytest.mark.parametrize("change, message", [
    (dict(start_times=None), "without start_times: its per-request lists are saved with --save-result "
                             "--save-detailed"),
    (dict(input_lens=[1, 2]), "input_lens has 2 entries and start_times 4: one per request each"),
    (dict(output_lens=[1, 2.5, 3, 4]), "request 1: output_lens must be a whole number, got 2.5"),
    (dict(start_times=[1, -2, 3, 4]), "request 1: start_times must not be negative, got -2"),
    (dict(input_lens=[1, 2, 3, 2**40]), "request 3: input_lens is 1099511627776, more tokens than any model"),
    (dict(start_times="now"), "start_times must be a list"),
    (dict(start_times=[], input_lens=[], output_lens=[], errors=[]), "the result holds no requests"),
])
def test_a_bad_vllm_bench_result_names_the_file_and_request(tmp_path, change, message):
    path = tmp_path / "result.json"
    result = {k: v for k, v in vllm_bench_result(**change).items() if v is not None}
    path.write_text(json.dumps(result))
    with pytest.raises(ServesimError, match=re.escape(message)):
        read_trace(path)


def test_a_vllm_bench_result_that_is_not_json_names_the_line(tmp_path):
    path = tmp_path / "result.json"
    path.write_text('{\n "start_times": [1, 2],\n "input_lens": [1, 2],,\n}\n')
    with pytest.raises(ServesimError, match=re.escape(f"{path}:3: not valid JSON")):
        read_trace(path)


def test_a_vllm_bench_result_naming_a_key_twice_is_refused(tmp_path):
    path = tmp_path / "result.json"
    text = json.dumps(vllm_bench_result())
    path.write_text(text[:-1] + ', "input_lens": [7, 7]}')
    with pytest.raises(ServesimError, match=re.escape(f"{path}: the key 'input_lens' is given twice in one object")):
        read_trace(path)


def test_sim_replay_of_a_vllm_bench_result_puts_each_requests_prediction_beside_its_measurement(tmp_path, capsys):
    import pandas as pd

    from sim.app.cli import main

    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_bench_result()))
    assert main(["replay", str(path), "--out", str(tmp_path / "run")]) == 0
    requests = pd.read_csv(tmp_path / "run" / "requests.csv", dtype={"request_id": str})
    assert sorted(requests["request_id"]) == ["0", "1", "3"] and (requests["status"] == "finished").all()
    comparison = json.loads((tmp_path / "run" / "measured.json").read_text())
    assert comparison["source"] == str(path) and comparison["requests"] == 3
    ttft = comparison["metrics"]["ttft"]
    assert ttft["measured_mean_ms"] == pytest.approx(1e3 * (0.05 + 0.06 + 0.05) / 3)
    # vLLM's API server is modelled (its times are the client's sends): the replay's TTFT is compared
    # from the send, the client's, as measured; the engine's arrival is the send plus the server's time.
    assert comparison["predicted_from"] == "send"
    by_id = requests.set_index("request_id")
    assert ttft["predicted_mean_ms"] == pytest.approx(1e3 * by_id["client_ttft_s"].mean())
    assert (by_id["client_ttft_s"] == by_id["ttft_s"] + by_id["ttft_api_server_s"]).all()
    # The sends are 0.5 s apart or more, so no request waits for the server: 1 ms + 2 us a prompt token.
    assert by_id["ttft_api_server_s"].tolist() == pytest.approx([1e-3 + 2e-6 * n for n in (200, 100, 120)])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["options"]["api_server"]["servers"] == 1
    assert "against the trace's own measurements (3 requests)" in capsys.readouterr().out
    # --api-server off: the engine's TTFT from the send, as before the API server was modelled.
    assert main(["replay", str(path), "--api-server", "off", "--out", str(tmp_path / "off")]) == 0
    off = json.loads((tmp_path / "off" / "measured.json").read_text())
    engine = pd.read_csv(tmp_path / "off" / "requests.csv", dtype={"request_id": str}).set_index("request_id")
    assert off["predicted_from"] == "arrival" and engine["ttft_api_server_s"].isna().all()
    assert off["metrics"]["ttft"]["predicted_mean_ms"] == pytest.approx(1e3 * engine["ttft_s"].mean())
    assert engine["arrival_s"].tolist() == pytest.approx([0.0, 0.5, 1.25])
    assert by_id["arrival_s"].tolist() == pytest.approx([0.0 + 1.4e-3, 0.5 + 1.2e-3, 1.25 + 1.24e-3])
    # report.html draws the same table, and `sim report` draws it again from measured.json.
    section = "Against the run's own measurements"
    report = (tmp_path / "run" / "report.html").read_text()
    assert section in report and "3 requests in both" in report
    # Its table shows the TTFT and E2E from the send too, which the TTFT parts add up to (and says so).
    assert ">ttft from send<" in report and ">e2e from send<" in report and "add up to the TTFT from the" in report
    (tmp_path / "run" / "report.html").unlink()
    assert main(["report", str(tmp_path / "run")]) == 0
    assert section in (tmp_path / "run" / "report.html").read_text()
    saved = (tmp_path / "run" / "measured.json").read_text()  # a broken comparison is named, not a traceback
    (tmp_path / "run" / "measured.json").write_text('{"metrics": 5}')
    assert main(["report", str(tmp_path / "run")]) == 2
    assert "measured.json: not a comparison sim replay writes" in capsys.readouterr().err
    (tmp_path / "run" / "measured.json").write_text(saved)
    # A trace without measurements writes no measured.json, and its report has no such table.
    assert main(["replay", str(AZURE_CONV_SAMPLE), "--limit", "20", "--out", str(tmp_path / "plain")]) == 0
    assert not (tmp_path / "plain" / "measured.json").exists()
    assert section not in (tmp_path / "plain" / "report.html").read_text()


def test_measured_ttft_and_tpot_are_vllms_from_e2els_else_itls(tmp_path):
    """TPOT as vLLM's bench serve computes it: (E2E - TTFT) / (output - 1); from the inter-token
    gaps where the file has no e2els; NaN for a one-token output."""
    path = tmp_path / "result.json"
    result = vllm_bench_result(output_lens=[11, 21, 1, 1], e2els=[0.15, 0.26, 0.02, 0.05], ttfts=[0.05, 0.06, 0.02, 0.05],
                               itls=[[0.01] * 10, [0.01] * 20, [], []], errors=["", "", "", ""])
    path.write_text(json.dumps(result))
    trace = read_trace(path)
    assert trace.request_ids == ["1", "0", "2", "3"]
    assert trace.measured["ttft_s"].tolist() == [0.06, 0.05, 0.02, 0.05]
    tpot = trace.measured["tpot_s"]
    assert tpot[:2].tolist() == pytest.approx([(0.26 - 0.06) / 20, (0.15 - 0.05) / 10])
    assert np.isnan(tpot[2:]).all()
    path.write_text(json.dumps({k: v for k, v in result.items() if k != "e2els"}))
    assert read_trace(path).measured["tpot_s"][:2].tolist() == pytest.approx([0.2 / 20, 0.1 / 10])


def test_vllms_saved_latencies_give_e2e_and_tpot_and_the_servers_ttft_is_kept_where_reported(tmp_path, capsys):
    """vLLM's saved result names each request's E2E `latencies` (vllm/benchmarks/serve.py); where the
    server reported per-request metrics, `server_ttfts` (null where a request had none) is compared with
    the replay's engine TTFT, the like-for-like figure."""
    path = tmp_path / "result.json"
    result = vllm_bench_result(output_lens=[11, 21, 1, 1], latencies=[0.15, 0.26, 0.02, 0.05], ttfts=[0.05, 0.06, 0.02, 0.05],
                               server_ttfts=[0.04, None, None, 0.045], errors=["", "", "", ""])
    path.write_text(json.dumps(result))
    trace = read_trace(path)
    assert trace.request_ids == ["1", "0", "2", "3"]
    assert trace.measured["e2e_s"].tolist() == [0.26, 0.15, 0.02, 0.05]
    assert trace.measured["tpot_s"][:2].tolist() == pytest.approx([(0.26 - 0.06) / 20, (0.15 - 0.05) / 10])
    server = trace.measured["server_ttft_s"]
    assert np.isnan(server[0]) and server[1] == 0.04 and np.isnan(server[2]) and server[3] == 0.045
    import pandas as pd

    from sim.app.cli import main

    assert main(["replay", str(path), "--out", str(tmp_path / "run")]) == 0
    comparison = json.loads((tmp_path / "run" / "measured.json").read_text())
    assert set(comparison["metrics"]) == {"ttft", "tpot", "e2e", "server_ttft"}
    assert comparison["metrics"]["server_ttft"]["requests"] == 2
    assert comparison["metrics"]["server_ttft"]["measured_mean_ms"] == pytest.approx(1e3 * (0.04 + 0.045) / 2)
    # E2E is compared from the client's send (the API server's share added), the server's TTFT with the engine's.
    requests = pd.read_csv(tmp_path / "run" / "requests.csv", dtype={"request_id": str}).set_index("request_id")
    e2e_from_send = requests["e2e_s"] + requests["ttft_api_server_s"]
    assert comparison["metrics"]["e2e"]["predicted_mean_ms"] == pytest.approx(1e3 * e2e_from_send.mean())
    assert comparison["metrics"]["server_ttft"]["predicted_mean_ms"] == pytest.approx(
        1e3 * requests["ttft_s"].loc[["0", "3"]].mean())
    assert "server_ttft" in capsys.readouterr().out
    # A file with no latencies at all (no ttfts, latencies or server metrics) has no measurements.
    bare = {k: v for k, v in result.items() if k not in ("ttfts", "itls", "latencies", "server_ttfts")}
    path.write_text(json.dumps(bare))
    assert read_trace(path).measured is None


def test_a_transform_that_changes_what_was_measured_leaves_the_measurement_out(tmp_path):
    from traces.transforms import apply

    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_bench_result()))
    trace = read_trace(path)
    scaled = apply(trace, rate_scale=2.0)
    assert scaled.measured is None and "the trace's own measurements are not compared" in scaled.warnings[-1]
    assert apply(trace, rate_scale=1.0).measured is not None
    cut = apply(trace, on_too_long="truncate", max_model_len=150)  # the 200-token prompt is cut
    assert np.isnan(cut.measured["ttft_s"][0]) and cut.measured["ttft_s"][1:].tolist() == [0.05, 0.05]
    assert apply(trace, num_requests=2).measured["ttft_s"].tolist() == [0.06, 0.05]


def test_compare_measured_worked_by_hand():
    import pandas as pd

    from reports.measured import compare_measured

    requests = pd.DataFrame({"request_id": ["a", "b", "c", "d"], "status": ["finished"] * 3 + ["rejected"],
                             "ttft_s": [0.1, 0.3, 0.2, float("nan")], "tpot_s": [0.01, 0.02, float("nan"), 0.0]})
    measured = {"ttft_s": np.array([0.2, 0.2, 0.4, 0.1]), "tpot_s": np.array([0.01, 0.01, 0.01, 0.01])}
    out = compare_measured(requests, measured, ["c", "a", "b", "d"])  # the trace's order differs
    assert out["requests"] == 3  # d was rejected in the replay
    ttft = out["metrics"]["ttft"]  # predicted / measured: a 0.1 / 0.2, b 0.3 / 0.4, c 0.2 / 0.2
    assert ttft["measured_mean_ms"] == pytest.approx(800 / 3) and ttft["predicted_mean_ms"] == pytest.approx(200)
    assert ttft["mape_pct"] == pytest.approx((50 + 25 + 0) / 3)
    assert ttft["median_ape_pct"] == pytest.approx(25)
    assert ttft["mean_error_pct"] == pytest.approx(-25)
    assert out["metrics"]["tpot"]["requests"] == 2  # c's predicted TPOT is NaN (one output token)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["start_times", "input_lens", "output_lens", "ttfts", "itls", "e2els",
                                        "errors"]),
                       st.one_of(st.none(), st.booleans(), st.text(max_size=3),
                                 st.lists(st.one_of(st.none(), st.booleans(), st.integers(-5, 2**40),
                                                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=2),
                                                    st.lists(st.floats(-1, 1), max_size=2)),
                                          max_size=4))))
def test_any_vllm_bench_document_reads_or_is_refused_by_name_never_a_traceback(tmp_path, document):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"input_lens": [], **document}))
    try:
        trace = read_trace(path, "vllm-bench")
    except ServesimError as e:
        assert str(e).startswith(str(path))
        return
    assert len(trace) and (trace.prompt_tokens > 0).all() and (trace.output_tokens > 0).all()
    assert all(len(v) == len(trace) for v in trace.measured.values())


@pytest.mark.parametrize("change, message", [
    (dict(ttfts=[0.05, 0.06, 0.0]), "ttfts must be a list with one entry per request (4), got 3 entries"),
    (dict(latencies=[0.2, 0.3, 0.0]), "latencies must be a list with one entry per request (4), got 3 entries"),
    (dict(itls="none"), 'itls must be a list with one entry per request (4), got "none"'),
    (dict(ttfts=[0.05, 0.06, 0.0, 0.0]), "request 3: ttfts is 0 for a request that did not fail"),
    (dict(latencies=[0.15, 0.26, 0.0, 0.0]), "request 3: latencies is 0 for a request that did not fail"),
    (dict(latencies=[0.15, 0.26, 0.0, 0.04]), "request 3: ttfts 0.05 s is past its latencies 0.04 s"),
    (dict(ttfts=[0.05, 0.06, 0.0, 10**400]), "request 3: ttfts is a 401-digit number, too large to be one"),
    (dict(start_times=[1000.5, 1000.0, 1001.0, 10**400]), "request 3: start_times is a 401-digit number"),
    (dict(start_times=[1e18, 1e18 + 10, 1e18 + 20, 1e18 + 30]), "is too large to keep its arrivals apart: a number "
                                                                 "this large is exact only to 128 s"),
])
def test_a_vllm_bench_result_vllm_could_not_have_measured_is_refused_naming_the_request(tmp_path, change, message):
    """A list not matched one to one with the requests, a latency of 0 or a first token after the last
    for a request that did not fail, a number past any float: refused, never dropped unseen."""
    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_bench_result(**change)))
    with pytest.raises(ServesimError, match=re.escape(message)):
        read_trace(path)


def test_a_vllm_bench_result_saved_without_its_lists_is_named_on_one_line_too(tmp_path):
    path = tmp_path / "summary-only.json"
    path.write_text('{"date": "x", "backend": "vllm", "num_prompts": 20, "mean_ttft_ms": 40.0}\n')
    with pytest.raises(ServesimError, match="saved with --save-result --save-detailed"):
        read_trace(path)


def test_an_errors_list_of_the_failed_alone_is_said_not_matched(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_bench_result(errors=["timeout"])))
    trace = read_trace(path)
    assert trace.dropped == {"0 output_lens": 1}
    assert any("errors has 1 entries for 4 requests, so they cannot be matched" in w for w in trace.warnings)


def test_arrivals_too_large_for_a_float_to_keep_apart_are_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n1e12,10,5\n1000000000000.001,10,5\n")
    with pytest.raises(ServesimError, match=re.escape(f"{path}:2: arrival_s 1e+12 is too large to keep its arrivals "
                                                      "apart")):
        read_trace(path)
    path.write_text("arrival_s,prompt_tokens,output_tokens\n1700000000,10,5\n1700000000.001,10,5\n")  # since 1970
    assert read_trace(path).arrival_s.tolist() == pytest.approx([0.0, 0.001], abs=1e-6)


def test_a_measured_run_cut_by_a_window_or_limit_says_the_cut_load_is_left_out(tmp_path):
    from traces.transforms import apply

    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_bench_result()))
    trace = read_trace(path)
    for cut in (apply(trace, num_requests=2), apply(trace, time_window_s=(0.0, 1.0))):
        assert cut.measured is not None and "1 of the run's requests are cut away" in cut.warnings[-1]
    assert not any("cut away" in w for w in apply(trace, num_requests=10).warnings)


@pytest.mark.parametrize("window, message", [((1e400, None), "START must be a finite number of seconds, got inf"),
                                             ((None, -1e400), "END must be a finite number of seconds, got -inf"),
                                             ((2.0, 1.0), "START must be before END, got 2.0:1.0")])
def test_a_time_window_that_is_not_one_says_which_end(window, message):
    from traces.transforms import time_window

    with pytest.raises(ServesimError, match=re.escape(message)):
        time_window(read_trace(AZURE_CONV_SAMPLE), *window)


def test_a_truncated_request_is_left_out_of_the_comparison_and_its_count(tmp_path):
    from sim.app.cli import main

    path = tmp_path / "result.json"
    path.write_text(json.dumps(vllm_bench_result()))
    assert main(["replay", str(path), "--max-model-len", "150", "--on-too-long", "truncate", "--out",
                 str(tmp_path / "run"), "--quiet"]) == 0
    comparison = json.loads((tmp_path / "run" / "measured.json").read_text())
    assert comparison["requests"] == 2 == comparison["metrics"]["ttft"]["requests"]  # request 1 (220 tokens) cut


def test_burstgpt_rows_whose_total_is_not_the_sum_are_warned_about(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n"
                    "6,ChatGPT,18,472,900,Conversation log\n"
                    "7,ChatGPT,10,0,10,API log\n"  # failed (dropped): not counted
                    "8,ChatGPT,10,5,,API log\n")
    t = read_trace(path)
    assert t.prompt_tokens.tolist() == [472, 18, 10] and t.output_tokens.tolist() == [18, 472, 5]
    assert (f"{path}:3: Total tokens 900 is not Request tokens + Response tokens (18 + 472); 2 rows of the file so: "
            "their requests take Request and Response tokens (check the columns)") in t.warnings
    assert not [w for w in read_trace(BURSTGPT).warnings if "Total tokens" in w]


def test_a_canonical_column_the_reader_does_not_read_is_warned_of(tmp_path, capsys):
    """Found by a new-user run: a misspelt optional column (`priorty`) was read as absent, silently:
    every priority 0. So was `hash_ids` without `hash_block_tokens` (blocks of 512 tokens taken) and
    `hash_block_tokens` alone (not read); and --scheduling-policy priority on a trace without
    priorities ran as first come, first served without a word."""
    from sim.app.cli import main

    typo = tmp_path / "typo.csv"
    typo.write_text("arrival_s,prompt_tokens,output_tokens,priorty,note\n0,10,5,3,a\n0,20,5,1,b\n")
    trace = read_trace(typo)
    assert trace.priority is None
    assert trace.warnings == [f"{typo}:1: columns 'priorty', 'note' not read; a canonical trace's columns are "
                              "arrival_s, prompt_tokens, output_tokens, request_id, priority, hash_ids, "
                              "hash_block_tokens"]
    hashes = tmp_path / "hashes.csv"
    hashes.write_text("arrival_s,prompt_tokens,output_tokens,hash_ids\n0,1000,5,1 2\n")
    assert read_trace(hashes).warnings == [f"{hashes}:1: hash_ids without hash_block_tokens: each hash taken for a "
                                           "block of 512 tokens (Mooncake's)"]
    alone = tmp_path / "alone.csv"
    alone.write_text("arrival_s,prompt_tokens,output_tokens,hash_block_tokens\n0,1000,5,16\n")
    assert "hash_block_tokens without hash_ids" in read_trace(alone).warnings[0]
    good = tmp_path / "good.csv"
    good.write_text("arrival_s,prompt_tokens,output_tokens,request_id,priority,hash_ids,hash_block_tokens\n"
                    "0,32,5,a,1,1 2,16\n")
    assert read_trace(good).warnings == []
    capsys.readouterr()
    assert main(["replay", str(typo), "--scheduling-policy", "priority", "--out", str(tmp_path / "r"),
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "columns 'priorty', 'note' not read" in err
    assert "--scheduling-policy priority: " in err and "served first come, first served" in err


def test_messages_name_the_line_and_the_range(tmp_path, capsys):
    """Found by a new-user run: a repeated request_id was named without its line; a priority too large for
    a 64-bit integer was "not a whole number"; an open --time-window was echoed as 99999.0:None; --limit 0
    was refused for runs of more than 10,000,000 requests."""
    from sim.app.cli import main

    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,priority\n0,10,5,99999999999999999999\n")
    with pytest.raises(ServesimError, match=r":2: priority must be a whole number of at most 2\*\*62 in size"):
        read_trace(path)
    assert main(["trace", "stats", str(AZURE_CONV_SAMPLE), "--time-window", "99999:"]) == 2
    assert "--time-window 99999: keeps no request" in capsys.readouterr().err
    assert main(["trace", "stats", str(AZURE_CONV_SAMPLE), "--limit", "0"]) == 2
    assert "got 0 (at least one to run;" in capsys.readouterr().err


def test_a_compressed_file_servesim_does_not_read_is_named_and_a_negative_window_refused(tmp_path, capsys):
    """Found by a new-user run: xz, bzip2, zip and zstd files were "not a text file (not UTF-8)", which
    says nothing of why; a negative --time-window START was accepted silently."""
    import bz2
    import lzma
    import zipfile

    from sim.app.cli import main

    text = AZURE_CONV_SAMPLE.read_bytes()
    (tmp_path / "t.xz").write_bytes(lzma.compress(text))
    (tmp_path / "t.bz2").write_bytes(bz2.compress(text))
    with zipfile.ZipFile(tmp_path / "t.zip", "w") as z:
        z.writestr("t.csv", text)
    for name, what in (("t.xz", "an xz-compressed"), ("t.bz2", "a bzip2-compressed"), ("t.zip", "a zip")):
        with pytest.raises(ServesimError, match=f"t.{name[2:]}: {what} file; servesim reads a trace as plain text or "
                                                "gzip: decompress it first"):
            read_trace(tmp_path / name)
    header_like = tmp_path / "bzh.csv"  # a text file that merely starts as bzip2's magic does is read as text
    header_like.write_text("BZh9 is not a header\n")
    with pytest.raises(ServesimError, match="unknown trace format"):
        read_trace(header_like)
    assert main(["trace", "stats", str(AZURE_CONV_SAMPLE), "--time-window=-5:10"]) == 2
    assert "--time-window: START must not be negative, got -5" in capsys.readouterr().err
