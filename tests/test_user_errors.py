"""Issue 13's user errors, each exit 2 with one line naming the value, and its smaller fixes:
options that do not apply, --slo keys (the same in replay and capacity, none twice), hour-scale
latencies in seconds, `sim models` max length, `sim report` on a summary alone and of one run,
the capacity report within 1400 px, the README's calibrate example, bench/replay_speed.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reports.metrics import format_summary, requests_table, summarize
from reports.outcomes import outcomes_from_result
from sim.app.capacity import CapacitySLO
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.app.replay import replay
from sim.config import SLO, SLO_KEYS, SchedulerConfig
from tests.helpers import ConstantBackend, make_trace, one_error_line, sim
from traces import AZURE_CONV_SAMPLE

ROOT = Path(__file__).resolve().parents[1]
SMALL = [str(AZURE_CONV_SAMPLE), "--limit", "40"]




# Exit 2, not "internal error".

def test_replay_of_1e30_tokens_is_exit_2_naming_the_line(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,2\n1,1e30,2\n")
    assert sim("replay", trace, "--out", tmp_path / "run", "--quiet") == 2
    assert one_error_line(capsys) == (f"{trace}:3: prompt_tokens is 1e+30, more tokens than any model takes "
                                      "(at most 2**31 = 2,147,483,648)")
    assert not (tmp_path / "run").exists()


def test_num_blocks_1e11_is_exit_2(tmp_path, capsys):
    assert sim("replay", *SMALL, "--num-blocks", 10**11, "--out", tmp_path / "run") == 2
    assert one_error_line(capsys) == ("--num-gpu-blocks must be a whole number from 1 to 33,554,432 blocks, got "
                                      "100,000,000,000 (each KV block takes about 60 bytes of host memory: 33,554,432 "
                                      "take 2 GB; a larger --block-size needs fewer)")


def test_a_corrupt_safetensors_file_is_exit_2_naming_it(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert sim("replay", *SMALL, "--limit", 2, "--model", "tiny", "--backend", "real", "--weights", weights,
               "--out", tmp_path / "run", "--quiet") == 2
    message = one_error_line(capsys)
    assert message.startswith(f"{weights / 'model.safetensors'}: not a readable safetensors file ("), message


def test_capacity_refuses_rate_scale(tmp_path, capsys):
    assert sim("capacity", *SMALL, "--slo", "tbt=0.1", "--rate-scale", 100, "--out", tmp_path / "c") == 2
    assert one_error_line(capsys) == ("--rate-scale does not apply to sim capacity, which searches the rate scale "
                                      "itself (between --min-rate-scale and --max-rate-scale)")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("args,message", [
    (["replay", *SMALL, "--device", "cuda"],
     "--device cuda is the real backend's; it does not apply to --backend costmodel (whose hardware is --hardware)"),
    (["trace", "stats", AZURE_CONV_SAMPLE, "--max-model-len", 100],
     "--max-model-len applies here with --on-too-long truncate (a replay rejects requests that are too long; "
     "these commands keep them unless told to truncate)"),
    # sim calibrate's flags of the other way of calibrating were ignored: a --tp 4 fitted a profile of one device.
    (["calibrate", "--model", "tiny", "--tp", 4],
     "--tp 4 applies with --from-ops (a profile derived from operator tables); the real backend's calibration "
     "measures one device (--device) as it is"),
    (["calibrate", "--model", "tiny", "--dtype", "fp8"],
     "--dtype fp8 applies with --from-ops (a profile derived from operator tables); the real backend's calibration "
     "measures one device (--device) as it is"),
    (["calibrate", "--from-ops", ".", "--system", "h100_sxm", "--model", "Llama-3.1-8B", "--device", "cuda"],
     "--device cuda does not apply to sim calibrate with --from-ops, which runs no backend and derives the profile "
     "from the tables"),
    (["calibrate", "--from-ops", ".", "--system", "h100_sxm", "--model", "Llama-3.1-8B", "--grid", "small"],
     "--grid small does not apply to sim calibrate with --from-ops, which runs no backend and derives the profile "
     "from the tables"),
    # --on-too-long shapes a trace, as --limit does; sim bench's own requests have their lengths.
    (["bench", "--concurrency", 2, "--input-len", 64, "--output-len", 8, "--num-prompts", 4, "--on-too-long",
      "truncate"], "--on-too-long truncate shapes a trace; sim bench makes its own requests (of --input-len and "
                   "--output-len)"),
    # A MoE priced by the roofline (a hardware file of no system) routes no tokens by a distribution.
    (["replay", *SMALL, "--model", "Qwen3-30B-A3B", "--profile", "roofline", "--moe-distribution", "balanced"],
     "--moe-distribution balanced prices a mixture of experts' fused-MoE layer from the moe_perf tables of the "
     "hardware's system (the tables extra); this run of Qwen3-30B-A3B on H100-SXM is priced another way, which "
     "spreads no tokens over experts"),
    # vLLM 0.34's cache-aware admission reorders chunked's fcfs queue by the prefix cache; vLLM ignores it otherwise.
    (["replay", *SMALL, "--cache-aware-admission-window", 4, "--policy", "decode-first"],
     "--cache-aware-admission-window 4 reorders the waiting queue of the chunked policy (vLLM's scheduler), not of "
     "decode-first"),
    (["replay", *SMALL, "--cache-aware-admission-window", 4, "--scheduling-policy", "priority"],
     "--cache-aware-admission-window 4 needs --scheduling-policy fcfs: vLLM ignores it under priority"),
    (["replay", *SMALL, "--cache-aware-admission-window", 4, "--no-prefix-caching"],
     "--cache-aware-admission-window 4 orders requests by their cached prefix: it needs prefix caching (drop "
     "--no-prefix-caching)"),
    (["replay", *SMALL, "--prefill-schedule-interval", 3, "--policy", "prefill-first"],
     "--prefill-schedule-interval 3 holds the prefills of the chunked policy (vLLM's scheduler), not of prefill-first"),
    # With --dp (the ranks share the cadence of their DP group) it is still chunked's alone.
    (["replay", *SMALL, "--prefill-schedule-interval", 3, "--model", "Qwen3-30B-A3B", "--dp", 2, "--policy",
      "decode-first"],
     "--prefill-schedule-interval 3 holds the prefills of the chunked policy (vLLM's scheduler), not of decode-first"),
    # The long-prefill cap is chunked's alone: decode-first and prefill-first ignored it, and summary.json recorded it.
    (["replay", *SMALL, "--long-prefill-token-threshold", 16, "--policy", "decode-first"],
     "--long-prefill-token-threshold 16 caps the prefill chunks of the chunked policy (vLLM's scheduler), not of "
     "decode-first"),
    (["replay", *SMALL, "--long-prefill-token-threshold-adaptive", "--policy", "prefill-first"],
     "--long-prefill-token-threshold-adaptive raises the prefill cap of the chunked policy (vLLM's scheduler), not of "
     "prefill-first"),
    (["replay", *SMALL, "--long-prefill-token-threshold-adaptive"],
     "--long-prefill-token-threshold-adaptive raises the cap --long-prefill-token-threshold N sets, and there is "
     "none (0: no cap), so it would change nothing; give both, or neither"),
    # A router picks among replicas; with one engine (or a --dp group, whose balancer is vLLM's) it was ignored.
    (["replay", *SMALL, "--router", "least-kv"],
     "--router least-kv picks which replica takes each request, and there is one engine: add --replicas N, or "
     "--prefill-replicas and --decode-replicas"),
    (["replay", *SMALL, "--router", "prefix-aware", "--dp", 2],
     "--router prefix-aware picks which replica takes each request, and there is one engine: with --dp vLLM's DP "
     "load balancer picks the rank (docs/data-parallel.md); leave --router out"),
    (["bench", "--concurrency", 2, "--input-len", 64, "--output-len", 8, "--num-prompts", 4, "--router", "random"],
     "--router random picks which replica takes each request, and there is one engine: add --replicas N, or "
     "--prefill-replicas and --decode-replicas"),
    (["replay", *SMALL, "--cache-aware-admission-threshold", 1.5],
     "--cache-aware-admission-threshold must be a number from 0 to 1, got 1.5 (a fraction of the KV cache's blocks "
     "in use)"),
    # vLLM's SchedulerConfig: "max_num_active_seqs (N) cannot be greater than max_num_seqs (M)."
    (["replay", *SMALL, "--max-num-seqs", 32, "--max-num-active-seqs", 64],
     "--max-num-active-seqs (64) cannot be greater than --max-num-seqs (32), as vLLM refuses it"),
    (["replay", *SMALL, "--hardware", "A100-80GB", "--max-num-active-seqs", 512],
     "--max-num-active-seqs (512) cannot be greater than --max-num-seqs (256, vLLM's default on A100-80GB), as vLLM "
     "refuses it"),
    # A refusal raised while a pool's options are built or resolved names the pool's flag: the value refused may
    # be the pool's own (it named --max-num-seqs (32), which only --decode-options set).
    (["replay", *SMALL, "--prefill-replicas", 1, "--decode-replicas", 1, "--max-num-active-seqs", 64,
      "--decode-options", "max-num-seqs=32"],
     "--decode-options: --max-num-active-seqs (64) cannot be greater than --max-num-seqs (32), as vLLM refuses it"),
    (["replay", *SMALL, "--prefill-replicas", 1, "--decode-replicas", 1, "--prefill-options",
      "max-num-seqs=32,max-num-batched-tokens=16"],
     "--prefill-options: --max-num-batched-tokens (16) must be at least --max-num-seqs (32), so that every running "
     "decode fits in one step"),
    (["replay", *SMALL, "--prefill-replicas", 1, "--decode-replicas", 1, "--prefill-options", "hardware=NOPE"],
     "--prefill-options: unknown hardware 'NOPE': not a preset (A100-80GB, H100-SXM, H200), a package system or a "
     "JSON file; see `sim hardware`"),
    (["replay", *SMALL, "--prefill-replicas", 1, "--decode-replicas", 1, "--decode-options", "tp=3"],
     "--decode-options: --tp 3 does not split model Llama-3.1-8B: its num_attention_heads (32) cannot be divided "
     "among 3 GPUs"),
    # A message that already names the pool's flag is not named twice.
    (["replay", *SMALL, "--prefill-replicas", 1, "--decode-replicas", 1, "--decode-options", "max-num-seqs=0"],
     "--decode-options: max-num-seqs must be a whole number from 1 to 1,048,576 requests, got 0 (each running "
     "request holds at least one KV block; 1,048,576 at once is more than any GPU's KV cache holds)"),
])
def test_options_that_do_not_apply_are_refused(tmp_path, capsys, args, message):
    out = {"replay": "--out", "bench": "--out", "calibrate": "--out"}.get(args[0])
    target = tmp_path / ("p.json" if args[0] == "calibrate" else "o")
    assert sim(*args, *([out, target] if out else [])) == 2
    assert one_error_line(capsys) == message
    assert not target.exists()


@pytest.mark.parametrize("hardware,system", [("H200", "h200_sxm"), ("A100-80GB", "a100_sxm")])
def test_calibrate_from_ops_refuses_hardware_of_another_gpu_than_the_tables(tmp_path, capsys, hardware, system):
    """--system h100_sxm --hardware H200 wrote a profile named H200 with H100 kernel times, and `sim
    replay --hardware H200 --profile` took it as H200's: silently an H100's step times."""
    out = tmp_path / "p.json"
    assert sim("calibrate", "--from-ops", tmp_path, "--system", "h100_sxm", "--model", "Llama-3.1-8B", "--hardware",
               hardware, "--out", out) == 2
    assert one_error_line(capsys) == (
        f"--hardware {hardware} is the GPU of system {system}, but the --system h100_sxm tables were measured on "
        f"H100-SXM: the profile would pass {hardware}'s name off with H100-SXM's kernel times; give --hardware "
        "H100-SXM (or a hardware JSON file of that GPU)")
    assert not out.exists()


def test_capacity_of_another_trace_in_a_sweeps_folder_is_refused_naming_both(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    out = tmp_path / "x"
    assert sim("sweep", *SMALL, "--out", out, "--jobs", 1, "--quiet") == 0
    capsys.readouterr()
    args = ["capacity", AZURE_CONV_SAMPLE, "--limit", 20, "--slo", "tbt=0.1", "--max-rate-scale", 2, "--out", out,
            "--jobs", 1, "--quiet"]
    assert sim(*args) == 2
    assert one_error_line(capsys).startswith(f"{out}: already holds a run (report.html, results.parquet); pass "
                                             "--resume to continue it, --overwrite to start again")
    assert sim(*args, "--resume") == 2
    assert one_error_line(capsys) == (
        f"{out}: holds a sweep (results.parquet, 1 row of {AZURE_CONV_SAMPLE}) that this capacity search of "
        f"{AZURE_CONV_SAMPLE} would be reported with, but it has a different trace (its requests differ); choose "
        "another --out, or pass --overwrite to remove it")
    assert sim(*args, "--overwrite") == 0
    # --overwrite replaces the folder as a whole (issue 32): the sweep of the other trace is gone with it.
    assert sorted(p.name for p in out.iterdir()) == [".servesim-files.json", "capacity.csv", "probes.parquet",
                                                     "report.html"]
    assert not list(tmp_path.glob(".x.servesim-new-*"))


def test_same_trace_sweep_and_capacity_share_a_folder(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    out = tmp_path / "x"
    assert sim("sweep", *SMALL, "--rate-scale", "1,2", "--out", out, "--jobs", 1, "--quiet") == 0
    assert sim("capacity", *SMALL, "--slo", "tbt=0.1", "--max-rate-scale", 2, "--out", out, "--jobs", 1,
               "--quiet", "--resume") == 0
    assert {"results.parquet", "probes.parquet", "capacity.csv"} <= {p.name for p in out.iterdir()}


# --slo: one set of keys, none twice.

def test_slo_keys_are_the_same_in_replay_and_capacity():
    for key in SLO_KEYS:
        assert SLO.parse(f"{key}=1.5").limits() == {key: 1.5}
        assert CapacitySLO.parse(f"{key}=1.5,delay=2" if key != "delay" else "delay=1.5").limits()[key][0] == 1.5
    assert SLO.parse("itl=1,scheduling_delay=2,e2el=3").limits() == {"tbt": 1.0, "e2e": 3.0, "delay": 2.0}


@pytest.mark.parametrize("command", [["replay", *SMALL], ["capacity", *SMALL]])
def test_a_slo_key_given_twice_is_refused(tmp_path, capsys, command):
    assert sim(*command, "--slo", "ttft=1,tbt=0.1,TTFT=2", "--out", tmp_path / "o") == 2
    assert one_error_line(capsys) == "--slo: ttft is given twice"
    assert sim(*command, "--slo", "tbt=0.1,itl=0.2", "--out", tmp_path / "o") == 2
    assert one_error_line(capsys) == "--slo: tbt is given twice"


def test_goodput_with_tbt_and_delay_limits():
    # Two requests at t=0 (10 prompt, 3 output tokens), one at a time, 0.1 s per step: A's tokens at
    # 0.1, 0.2, 0.3; B is first scheduled at 0.3 and its tokens come at 0.4, 0.5, 0.6. Both have gaps of
    # 0.1 s; their scheduling delays are 0 and 0.3 s.
    trace = make_trace([(0.0, 10, 3), (0.0, 10, 3)])
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", 64, 1), model="tiny")
    result = replay(trace, resolve(options, backend=ConstantBackend(0.1)))
    requests = requests_table(result)
    assert requests["scheduling_delay_s"].tolist() == pytest.approx([0.0, 0.3])
    for text, attainment in (("tbt=0.11", 1.0), ("tbt=0.09", 0.0), ("delay=0.2", 0.5), ("tbt=0.11,delay=0.31", 1.0)):
        summary = summarize(result, outcomes_from_result(result, SLO.parse(text)), {})
        assert summary["slo_attainment"] == attainment, text
        assert summary["goodput"] == pytest.approx(2 * attainment / 0.6), text


# What the terminal shows.

def _summary(seconds: float) -> dict:
    stats = {"mean": seconds, "p50": seconds, "p90": seconds, "p99": seconds}
    return {"completed": 1, "rejected": 0, "preemptions": 0, "num_steps": 1, "duration_s": seconds,
            "request_throughput": 1 / seconds, "output_throughput": 1.0, "total_token_throughput": 1.0,
            "ttft": stats, "tpot": stats, "itl": stats, "e2e": stats, "scheduling_delay": stats}


def test_hour_scale_latencies_are_printed_in_seconds():
    text = format_summary(_summary(10355.372))
    assert "metric (s)" in text and " 10355.372" in text and "10355372" not in text
    text = format_summary(_summary(0.0421))
    assert "metric (ms)" in text and "      42.1" in text
    # In seconds, a TPOT beside an hour-long E2E keeps its milliseconds (it read 0.1, and an ITL of 0.034 s 0.0).
    summary = {**_summary(0.061), "e2e": _summary(3600.5)["e2e"], "itl": _summary(0.0337)["itl"]}
    text = format_summary(summary)
    assert "metric (s)" in text and "tpot                   0.061" in text and "itl                    0.034" in text


def test_models_shows_each_models_max_length(capsys):
    assert sim("models") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-2:] == ["max", "len"]
    end = next(i for i, line in enumerate(lines) if line.startswith("max len:"))  # the presets' table ends there
    rows = {line.split()[0]: line.split()[-1] for line in lines[1:end]}
    assert rows["Llama-3.1-8B"] == "131072" and rows["Mistral-7B"] == "32768" and rows["tiny"] == "8192"


# sim report.

def test_report_of_a_folder_holding_only_summary_json_is_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    for name in ("digest.json", "requests.csv", "steps.parquet", "report.html"):
        (run / name).unlink()
    assert sim("report", run) == 2
    assert one_error_line(capsys) == (f"{run}: holds summary.json but neither digest.json nor the requests and "
                                      "steps tables, so there is nothing to draw; replay the trace again into a "
                                      "new folder")
    assert not (run / "report.html").exists()


def test_report_of_a_file_says_it_is_a_file(tmp_path, capsys):
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    assert sim("report", run / "summary.json") == 2  # was "no such folder", of a file that is there
    assert one_error_line(capsys) == (f"{run / 'summary.json'}: a file, not a folder; sim report takes the folder "
                                      "of a run, a folder of runs, a sweep or a capacity search")
    assert sim("report", tmp_path / "nope") == 2
    assert one_error_line(capsys) == f"{tmp_path / 'nope'}: no such folder"


def test_report_of_one_run_folder_says_1_run(tmp_path, capsys):
    assert sim("replay", *SMALL, "--out", tmp_path / "runs" / "a", "--quiet") == 0
    assert sim("report", tmp_path / "runs") == 0
    title = re.search(r"<title>(.*?)</title>", (tmp_path / "runs" / "report.html").read_text()).group(1)
    assert title == f"1 run in {tmp_path / 'runs'}"


@pytest.mark.parametrize("name,content,message", [
    ("summary.json", "[]", "summary.json: not the JSON object servesim writes (a list)"),
    ("summary.json", "NaN", "summary.json: not the JSON object servesim writes (a float)"),
    ("summary.json", '{"ttft": 5}', "summary.json or digest.json is not as servesim writes it (TypeError"),
    ("digest.json", "[1]", "digest.json: not the JSON object servesim writes (a list)"),
    ("digest.json", "{}", "summary.json or digest.json is not as servesim writes it (KeyError: 'ttft')"),
    # A figure the page prints as a number given as text or a list was an internal error (ValueError, TypeError).
    ("summary.json", {"num_steps": "x"}, "summary.json: num_steps = 'x', not a number as servesim writes it"),
    ("summary.json", {"request_throughput": [1]}, "summary.json: request_throughput = [1], not a number"),
    ("summary.json", {"ttft": {"mean": "1", "p50": 1, "p90": 1, "p99": 1}}, "summary.json: ttft_mean = '1', not a number"),
    ("digest.json", {"ttft": ["x"]}, "digest.json: ttft = ['x'], not the list of numbers servesim writes"),
    ("digest.json", {"timeline": {"start_s": [0.0], "num_waiting": None}},
     "digest.json: timeline's num_waiting = None, not the list of numbers"),
    # A curve cut short was drawn against the first quantile levels (or bins), silently.
    ("digest.json", {"ttft": [0.1, 0.2, 0.3, 0.4, 0.5]},
     "digest.json: ttft holds 5 values, not 112 (one a quantile level)"),
    ("digest.json", {"timeline": {"start_s": [0.0, 1.0], "num_prefill_tokens": [1, 2], "num_decode_tokens": [1, 2],
                                  "num_kv_blocks_used": [1, 2], "num_waiting": [1]}},
     "digest.json: timeline's num_waiting holds 1 values, not 2 (one a bin of the timeline's start_s)"),
])
def test_report_of_runs_with_a_summary_or_digest_of_another_shape_names_it(tmp_path, capsys, name, content, message):
    """A run's summary.json or digest.json that is JSON but not servesim's shape was `sim: internal
    error: AttributeError` (exit 1); now exit 2 naming the run, alone or in a folder of runs."""
    runs = tmp_path / "runs"
    for policy in ("chunked", "decode-first"):
        assert sim("replay", *SMALL, "--limit", 10, "--policy", policy, "--out", runs / policy, "--quiet") == 0
    if isinstance(content, dict):  # these fields changed in the file servesim wrote
        content = json.dumps({**json.loads((runs / "chunked" / name).read_text()), **content})
    (runs / "chunked" / name).write_text(content)
    for folder in (runs, runs / "chunked"):
        assert sim("report", folder) == 2
        line = one_error_line(capsys)
        assert str(runs / "chunked") in line and message in line, line
        assert "replay the trace again" in line


def test_report_of_a_run_whose_requests_table_is_cut_short_is_refused(tmp_path, capsys):
    """A run from before digest.json is drawn from its tables: one cut short (a copy stopped midway)
    drew CDFs of the rows left, exit 0; now its rows are counted against summary.json's."""
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--limit", 20, "--steps", "csv", "--out", run, "--quiet") == 0
    (run / "digest.json").unlink()
    lines = (run / "requests.csv").read_text().splitlines(keepends=True)
    (run / "requests.csv").write_text("".join(lines[:5]))
    assert sim("report", run) == 2
    assert one_error_line(capsys) == (f"{run / 'requests.csv'}: 4 rows, but summary.json counts 20 requests; replay "
                                      "the trace again into a new folder")
    (run / "requests.csv").write_text("".join(lines))  # whole again: drawn as before
    assert sim("report", run) == 0


@pytest.mark.parametrize("content,message", [
    (b"\xff\xfe\x00\x01", "cannot read (UnicodeDecodeError"),
    (b"", "cannot read (EmptyDataError"),
    (b'policy,slo\n"unterminated\n', "cannot read (ParserError"),
    (b"a,b\n", "not the capacity.csv sim capacity writes (no point, slo, status, capacity_request_rate column)"),
])
def test_report_of_a_capacity_search_with_a_broken_capacity_csv_names_it(tmp_path, capsys, content, message):
    pytest.importorskip("pyarrow")
    out = tmp_path / "c"
    assert sim("capacity", *SMALL, "--limit", 20, "--slo", "tbt=0.1", "--max-rate-scale", 2, "--jobs", 1, "--out", out,
               "--quiet") == 0
    capsys.readouterr()
    (out / "capacity.csv").write_bytes(content)
    assert sim("report", out) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"{out / 'capacity.csv'}: {message}"), line
    # --resume writes capacity.csv again from the probes.
    assert sim("capacity", *SMALL, "--limit", 20, "--slo", "tbt=0.1", "--max-rate-scale", 2, "--jobs", 1, "--out",
               out, "--quiet", "--resume") == 0
    assert sim("report", out) == 0


@pytest.mark.parametrize("metadata,message", [
    (b"{not json", "not a servesim results table (its sweep metadata is not the JSON object servesim writes)"),
    (b"\xff\xfe", "not a servesim results table (its sweep metadata is not the JSON object servesim writes)"),
    (b'"x"', "not a servesim results table (its sweep metadata is not the JSON object servesim writes)"),
    (b'{"axes": {"policy": 5}}', "not a servesim results table (its sweep metadata is not the JSON object servesim "
                                 "writes)"),
    (None, "not a servesim results table (no point column)"),
])
def test_a_sweep_table_of_another_shape_is_refused_by_resume_and_report(tmp_path, capsys, metadata, message):
    """results.parquet whose identity is not JSON, or not an object, or that lacks its point column:
    `sim sweep --resume` and `sim report` were `sim: internal error` (JSONDecodeError, AttributeError,
    KeyError); now exit 2 naming the file."""
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "S"
    args = ["sweep", *SMALL, "--limit", 5, "--policy", "chunked,decode-first", "--jobs", 1, "--quiet", "--out", out]
    assert sim(*args) == 0
    table = pq.read_table(out / "results.parquet")
    if metadata is None:
        table = table.drop_columns(["point"])
    else:
        table = table.replace_schema_metadata({b"servesim.sweep": metadata})
    pq.write_table(table, out / "results.parquet")
    for command in (args + ["--resume"], ["report", out]):
        assert sim(*command) == 2
        assert one_error_line(capsys) == f"{out / 'results.parquet'}: {message}"


def test_a_users_capacity_csv_beside_a_sweep_is_left_out_of_its_report(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    out = tmp_path / "S"
    assert sim("sweep", *SMALL, "--limit", 5, "--jobs", 1, "--quiet", "--out", out) == 0
    (out / "capacity.csv").write_bytes(b"\xff\xfe mine")  # no probes.parquet: no search ran here
    assert sim("report", out) == 0
    assert (out / "capacity.csv").read_bytes() == b"\xff\xfe mine"


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


WIDTH_PROBE = ("<script>window.addEventListener('load', () => setTimeout(() => document.body.setAttribute("
               "'data-scroll-width', document.documentElement.scrollWidth), 500));</script></body>")


@pytest.mark.slow
@pytest.mark.skipif(_chromium() is None, reason="needs chromium (apt-get install chromium)")
def test_capacity_report_fits_1400_px(tmp_path):
    pytest.importorskip("pyarrow")
    out = tmp_path / "cap"
    assert sim("capacity", *SMALL, "--policy", "prefill-first,chunked", "--max-num-batched-tokens", "256,1024",
               "--slo", "tbt=0.1,ttft=5,tpot=0.2,e2e=30", "--max-rate-scale", 4, "--out", out, "--jobs", 1,
               "--quiet") == 0
    page = tmp_path / "probe.html"
    page.write_text((out / "report.html").read_text().replace("</body>", WIDTH_PROBE))
    import tempfile

    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                              "--window-size=1400,900", "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                             capture_output=True, text=True, timeout=120)
    width = int(re.search(r'data-scroll-width="(\d+)"', dom.stdout).group(1))
    assert width <= 1400


# Smaller things a user meets.

def test_readme_calibrate_example_leaves_the_bundled_profile_alone(tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if "sim calibrate " in line and "--out" in line]
    assert commands and not any("profiles/tiny-cpu.json" in c.split("--out", 1)[1].split()[0] for c in commands)
    existing = tmp_path / "p.json"
    existing.write_text("{}")
    assert sim("calibrate", "--model", "tiny", "--out", existing) == 2
    assert one_error_line(capsys) == (f"{existing}: exists; pass --overwrite to replace it, or choose another "
                                      "--out (profiles/tiny-cpu.json is the bundled profile the tests use)")
    assert existing.read_text() == "{}"


@pytest.mark.slow  # a whole replay_speed run on a sample
def test_bench_replay_speed_without_arguments_uses_a_trace_it_has(tmp_path):
    bench = ROOT / "bench" / "replay_speed.py"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    missing = subprocess.run([sys.executable, bench, "--trace", tmp_path / "nope.csv"], capture_output=True,
                             text=True, env=env)
    assert missing.returncode == 2 and missing.stderr.strip().endswith(f"--trace {tmp_path / 'nope.csv'}: no such file")
    one = subprocess.run([sys.executable, bench, "--only", "chunked:1"], capture_output=True, text=True, env=env,
                         check=True)
    row = json.loads(one.stdout)
    assert row["policy"] == "chunked" and row["finished"] > 0


def test_bench_where_time_goes_prints_the_parts_of_a_replay(tmp_path):
    bench = ROOT / "bench" / "where_time_goes.py"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, bench, ROOT / "traces" / "samples" / "azure_conv_2023_first5min.csv",
                           "--out", tmp_path / "run"], capture_output=True, text=True, env=env, check=True)
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:]}
    assert {"Engine.run", "FastForward.plan", "ChunkedPolicy.schedule", "RunFolder.finish"} <= set(rows)
    assert int(rows["Engine.run"][-3]) == 1 and int(rows["ChunkedPolicy.schedule"][-3]) > 1000
    assert (tmp_path / "run" / "summary.json").exists()


def test_bench_instructions_names_a_missing_trace(tmp_path):
    done = subprocess.run([sys.executable, ROOT / "bench" / "instructions.py", tmp_path / "nope.csv"],
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1
    assert done.stderr.strip() in (f"instructions: {tmp_path / 'nope.csv'}: no such file",
                                   "instructions: valgrind is not installed (it counts the instructions)")


def test_bench_block_manager_calls_replays_a_recording_with_the_same_answers(tmp_path):
    bench = ROOT / "bench" / "block_manager_calls.py"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    calls = tmp_path / "calls.pickle"
    done = subprocess.run([sys.executable, bench, ROOT / "traces" / "samples" / "mooncake_synthetic_last200.jsonl",
                           "--calls", calls, "--repeat", "1"], capture_output=True, text=True, env=env, check=True)
    assert calls.exists() and "ref" in done.stdout
    assert re.search(r"\d[\d,]* calls", done.stdout + done.stderr)


def test_replay_into_an_existing_run_folder_is_refused_unless_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert sim("replay", *SMALL, "--policy", "prefill-first", "--out", run, "--quiet") == 2
    assert one_error_line(capsys) == (f"{run}: already holds a run (digest.json, report.html, requests.csv, ...); "
                                      "pass --overwrite to replace it, or choose another --out")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert sim("replay", *SMALL, "--policy", "prefill-first", "--out", run, "--overwrite", "--quiet") == 0
    assert json.loads((run / "summary.json").read_text())["options"]["scheduler"]["policy"] == "prefill-first"


def test_bench_compiled_probe_edits_still_apply_to_the_modules_ci_type_checks():
    import importlib.util

    import tomllib

    spec = importlib.util.spec_from_file_location("compiled_probe", ROOT / "bench" / "compiled_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    modules = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert {"sim/engine.py", "sim/fast_forward.py", "sim/block_manager.py", "policies/chunked.py"} <= set(modules)
    assert all((ROOT / name).is_file() for name in modules)
    for name, old, _ in probe.COMPILE_EDITS:  # each compile-only edit still finds its text
        assert name in modules and old in (ROOT / name).read_text(), (name, old)


def test_bench_compiled_probe_names_a_missing_trace(tmp_path):
    done = subprocess.run([sys.executable, ROOT / "bench" / "compiled_probe.py", "--trace", tmp_path / "nope.csv",
                           "--mooncake", tmp_path / "nope.jsonl"],
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert "nope.csv: no such file" in done.stderr and "Traceback" not in done.stderr


def test_max_num_active_seqs_is_checked_against_vllms_default_max_num_seqs_for_the_gpu(tmp_path):
    # Left unset, --max-num-seqs is vLLM's default for the GPU (1024 on an H100): 512 active seqs are fine there.
    assert sim("replay", *SMALL, "--max-num-active-seqs", 512, "--out", tmp_path / "o") == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert (summary["options"]["scheduler"]["max_num_seqs"], summary["options"]["scheduler"]["max_num_active_seqs"]) \
        == (1024, 512)


def test_a_scheduler_config_built_by_hand_is_checked_when_its_policy_is_made():
    from policies.chunked import ChunkedPolicy
    from sim.errors import ServesimError

    with pytest.raises(ServesimError, match=r"--max-num-active-seqs \(5\) cannot be greater than --max-num-seqs \(4\)"):
        ChunkedPolicy(SchedulerConfig(max_num_seqs=4, max_num_active_seqs=5))


def test_a_hardware_file_named_like_a_preset_with_other_figures_is_refused(tmp_path, capsys):
    """A file's name names its hardware: H100-SXM.json picked the preset's measured operator-table profile,
    so a file of a quarter of the H100's FLOP/s and bandwidth replayed to the H100's numbers, under its name."""
    from backends.hardware import HARDWARE

    figures = {k: v for k, v in HARDWARE["H100-SXM"].as_dict().items() if k != "name"}
    same = tmp_path / "same" / "H100-SXM.json"
    same.parent.mkdir()
    same.write_text(json.dumps({**figures, "description": "our H100s"}))
    assert sim("replay", *SMALL, "--hardware", same, "--out", tmp_path / "run", "--quiet") == 0
    slow = tmp_path / "H100-SXM.json"
    slow.write_text(json.dumps({**figures, "memory_bandwidth": figures["memory_bandwidth"] / 4}))
    capsys.readouterr()
    assert sim("replay", *SMALL, "--hardware", slow, "--out", tmp_path / "run2", "--quiet") == 2
    assert one_error_line(capsys) == (f"{slow}: named like the preset H100-SXM, whose measured operator tables would "
                                      "price it, but its figures differ from the preset's (memory_bandwidth); rename the file "
                                      "(its name names the hardware)")
    assert not (tmp_path / "run2").exists()


@pytest.mark.parametrize("name", ["H*.json", "[H]100-SXM.json", "H?00-SXM.json"])
def test_a_hardware_file_named_with_glob_characters_is_priced_by_its_own_figures(tmp_path, name):
    """The committed operator-table profiles are found by the hardware's name: a file named H*.json (or
    [H]100-SXM.json) matched H100-SXM's, and a GPU of a tenth of the H100's FLOP/s and bandwidth replayed to
    the H100's numbers; it is priced by its own figures, as a file of any other name is."""
    from backends.hardware import HARDWARE

    figures = {k: v for k, v in HARDWARE["H100-SXM"].as_dict().items() if k != "name"}
    slow = {**figures, "memory_bandwidth": figures["memory_bandwidth"] / 10,
            "peak_bf16_flops": figures["peak_bf16_flops"] / 10, "peak_fp8_flops": figures["peak_fp8_flops"] / 10}
    (tmp_path / name).write_text(json.dumps(slow))
    (tmp_path / "slowgpu.json").write_text(json.dumps(slow))
    summaries = []
    for hardware in (tmp_path / name, tmp_path / "slowgpu.json"):
        assert sim("replay", *SMALL, "--hardware", hardware, "--out", tmp_path / "run", "--overwrite", "--quiet") == 0
        summaries.append(json.loads((tmp_path / "run" / "summary.json").read_text()))
    assert "profiles/ops" not in str(summaries[0]["options"].get("profile"))
    assert summaries[0]["tpot"] == summaries[1]["tpot"]


@pytest.mark.parametrize("ep", [[], ["--enable-expert-parallel"]])
def test_dp_on_a_mixture_of_experts_needs_a_link_between_the_gpus(tmp_path, capsys, ep):
    """A hardware file without NVLink or PCIe figures: --tp 2 was refused, but --dp 2 on a mixture of experts
    (whose ranks gather and scatter tokens every MoE layer) was an internal error (TypeError: a ring over a
    link of None bytes/s). A dense model's ranks share nothing and still run."""
    from backends.hardware import HARDWARE

    figures = {k: v for k, v in HARDWARE["H100-SXM"].as_dict().items() if k != "name"}
    nolink = tmp_path / "nolink.json"
    nolink.write_text(json.dumps({**figures, "nvlink_bandwidth": None}))
    assert sim("replay", *SMALL, "--hardware", nolink, "--model", "Qwen3-30B-A3B", "--dp", 2, *ep,
               "--out", tmp_path / "run", "--quiet") == 2
    assert one_error_line(capsys) == ("--dp 2 on a mixture of experts (Qwen3-30B-A3B) gathers and scatters every MoE "
                                      "layer's tokens among the ranks' GPUs, which needs a link between them; hardware "
                                      "nolink has neither nvlink_bandwidth nor pcie_bandwidth")
    assert sim("replay", *SMALL, "--hardware", nolink, "--dp", 2, "--out", tmp_path / "dense", "--quiet") == 0


@pytest.mark.parametrize("args, message", [
    (["replay", *SMALL, "--hardware", ""], "--hardware must not be empty (an empty name was read as the current folder)"),
    (["replay", *SMALL, "--model", ""], "--model must not be empty (an empty name was read as the current folder)"),
    (["replay", *SMALL, "--profile", ""], "--profile must not be empty (an empty name was read as the current folder)"),
    (["replay", *SMALL, "--prefill-replicas", 1, "--decode-replicas", 1, "--decode-options", "hardware="],
     "--decode-options: hardware has no value; give hardware=VALUE, or leave hardware out for the run's own"),
    (["bench", "--concurrency", 1, "--input-len", 8, "--output-len", 2, "--num-prompts", 2, "--model", ""],
     "--model must not be empty (an empty name was read as the current folder)"),
    (["calibrate", "--from-ops", ROOT / "tests" / "data" / "aic_layout", "--system", "h100_sxm", "--model", "tiny",
      "--hardware", ""], "--hardware must not be empty (an empty name was read as the current folder)"),
])
def test_an_empty_name_is_refused_naming_its_flag(tmp_path, capsys, args, message):
    """An empty --hardware, --model or --profile was read as the current folder: '.: cannot read the hardware
    file: Is a directory', 'config.json: no such file'; calibrate --from-ops took --hardware '' as not given."""
    assert sim(*args, *(["--out", tmp_path / "p.json"] if args[0] == "calibrate" else
                        ["--out", tmp_path / "run"])) == 2
    assert one_error_line(capsys) == message


def test_max_num_seqs_alone_takes_vllms_budget_for_the_gpu(tmp_path, capsys):
    """--max-num-seqs 4096 without --max-num-batched-tokens was refused as "--max-num-batched-tokens (2048) must
    be at least --max-num-seqs (4096)": 2048 stood in for the unset budget, which is 8192 on an H100 (vLLM
    serves the pair). On an A100, whose budget is 2048, it is refused naming vLLM's default."""
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--max-num-seqs", 4096, "--out", run, "--quiet") == 0
    scheduler = json.loads((run / "summary.json").read_text())["options"]["scheduler"]
    assert (scheduler["max_num_batched_tokens"], scheduler["max_num_seqs"]) == (8192, 4096)
    assert sim("replay", *SMALL, "--max-num-seqs", 4096, "--hardware", "A100-80GB", "--out", tmp_path / "a") == 2
    assert one_error_line(capsys) == ("--max-num-seqs 4096 is more than vLLM's default --max-num-batched-tokens on "
                                      "A100-80GB (2048): a step's budget must hold every running decode, and vLLM "
                                      "refuses the pair too; give both flags")
    assert sim("replay", *SMALL, "--prefill-replicas", 1, "--decode-replicas", 1, "--decode-options",
               "max-num-seqs=4096", "--out", tmp_path / "pd", "--quiet") == 0


def test_ctrl_c_while_the_command_loads_is_interrupted_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C before the command runs (its modules loading, its arguments read) ends as it does while it
    runs: "sim: interrupted", exit 130."""
    from sim.app import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["replay", "--help"]) == 130
    err = capsys.readouterr().err
    assert err == "sim: interrupted\n"


@pytest.mark.parametrize("argv,line", [
    (["replay", "t.csv", "--dtype", "int4"],
     "sim replay: error: argument --dtype: invalid choice: 'int4' (choose from 'bf16', 'fp8', 'fp4') "
     "(sim replay --help lists the options)"),
    (["replay", "t.csv", "--polcy", "chunked"],
     "sim replay: error: unrecognized arguments: --polcy chunked (did you mean --policy?) "
     "(sim replay --help lists the options)"),
    (["trace", "stats"], "sim trace stats: error: the following arguments are required: file "
                         "(sim trace stats --help lists the options)"),
    (["trace", "stats", "t.csv", "--limt", "5"],
     "sim trace stats: error: unrecognized arguments: --limt 5 (did you mean --limit?) "
     "(sim trace stats --help lists the options)"),
])
def test_an_argument_error_is_one_line_naming_the_command(argv, line, capsys):
    """argparse's own errors are one line, as servesim's are (not the command's whole usage first), an
    unknown option named with the command it was given to and the closest known one suggested."""
    from sim.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_a_vllm_version_before_v1_is_refused():
    """servesim simulates vLLM's V1 engine (its default from 0.8.0): an older --vllm-version was taken to
    the nearest measured tables with only an information line, as if V1 had served it."""
    from sim.errors import ServesimError

    with pytest.raises(ServesimError, match=r"--vllm-version 0\.7\.3: servesim simulates vLLM's V1 engine"):
        ReplayOptions(vllm_version="0.7.3")
    assert ReplayOptions(vllm_version="0.8.0").vllm_version == "0.8.0"


def test_the_rows_a_trace_dropped_are_recorded_with_the_run(tmp_path):
    """A row left out while reading (0 prompt or output tokens) was warned about on the terminal only: the
    run folder's completed + rejected did not add up to the trace's rows, and nothing said why."""
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,5\n0.1,0,5\n0.2,10,0\n0.3,0,4\n0.4,12,4\n")
    assert main(["replay", str(trace), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["options"]["trace_dropped"] == {"0 prompt_tokens": 2, "0 output_tokens": 1}
    assert summary["completed"] + summary["rejected"] + sum(summary["options"]["trace_dropped"].values()) == 5


def test_vllm_version_on_a_system_without_tables_says_so(tmp_path, capsys):
    """--vllm-version on a system the package has no vLLM tables for (h100_pcie) was refused naming a missing
    gemm_perf table folder, though the run without the flag runs on the roofline."""
    pytest.importorskip("aiconfigurator_core")
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,2\n")
    assert main(["replay", str(trace), "--hardware", "h100_pcie", "--vllm-version", "0.12.0",
                 "--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert capsys.readouterr().err == (
        "sim: error: --vllm-version prices the run from the hardware's system's vLLM operator tables, and h100_pcie "
        "has none (sim hardware: the roofline only); leave --vllm-version out to run it on the roofline\n")
    assert main(["replay", str(trace), "--hardware", "h100_pcie", "--out", str(tmp_path / "r"), "--quiet"]) == 0


def test_a_capture_size_below_the_running_requests_warns_that_eager_launches_are_not_priced():
    """A smaller --max-cudagraph-capture-size priced a small model's decode steps faster (unpadded GEMMs, no
    launch time), where vLLM's eager steps are slower: the command says so."""
    from sim.app.plan import resolve

    assert not any("--max-cudagraph-capture-size" in w for w in resolve(ReplayOptions()).warnings())
    warned = [w for w in resolve(ReplayOptions(max_cudagraph_capture_size=8)).warnings()
              if w.startswith("--max-cudagraph-capture-size 8: decode steps of more requests run without CUDA")]
    assert len(warned) == 1 and "without the CPU time of launching each kernel" in warned[0]


def test_the_command_lines_process_ignores_a_second_ctrl_c_as_it_ends(monkeypatch, capsys):
    """Found by a new-user run: Ctrl-C on a `--jobs 2` sweep sometimes printed Python's traceback
    ("Exception ignored in threading._shutdown") after "sim: interrupted": a second Ctrl-C while Python
    joined the worker pool's threads at exit. The command line's process (main() without arguments)
    ignores Ctrl-C once it has ended on one; a call with its own arguments keeps its Ctrl-C."""
    import signal

    from sim.app import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main(["replay", "x.csv"]) == 130 and signal.getsignal(signal.SIGINT) is previous
        monkeypatch.setattr(sys, "argv", ["sim", "replay", "x.csv"])
        assert cli.main() == 130 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert capsys.readouterr().err == "sim: interrupted\nsim: interrupted\n"


def test_an_option_that_changes_nothing_or_a_cache_past_memory_is_warned_about(tmp_path, capsys):
    """Found by a review with odd options: --moe-distribution on a model without experts, and a
    --num-gpu-blocks larger than the memory left for the cache (summary.json's own `available` said
    so), ran without a word. Both still run (a sweep over dense and MoE models may keep one
    distribution; --num-gpu-blocks is taken as given), and the terminal says what they mean."""
    assert sim("replay", AZURE_CONV_SAMPLE, "--limit", "5", "--moe-distribution", "balanced", "--num-gpu-blocks",
               "100000", "--out", tmp_path / "run", "--quiet") == 0
    err = capsys.readouterr().err
    assert ("sim: warning: --moe-distribution balanced: Llama-3.1-8B has no experts to spread tokens over; the flag "
            "changes nothing in this run\n") in err
    # 100,000 blocks of 16 tokens x 128 KiB (Llama-3.1-8B in bf16) on an 80 GB H100
    assert re.search(r"sim: warning: --num-gpu-blocks 100000: 195\.31 GiB of KV cache per GPU, more than the "
                     r"\d+\.\d\d GiB left on H100-SXM after the weights and activations \(summary.json kv_cache\); "
                     r"vLLM would fail to allocate it, here it runs as given\n", err), err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "moe_distribution" not in summary["options"] and summary["kv_cache"]["num_gpu_blocks"] == 100000
    assert sim("replay", AZURE_CONV_SAMPLE, "--limit", "5", "--num-gpu-blocks", "1000", "--out", tmp_path / "fits",
               "--quiet") == 0
    assert "warning" not in capsys.readouterr().err


def test_a_key_value_flag_given_twice_joins_its_values(tmp_path, capsys):
    """Found by a review: `--slo ttft=1 --slo tpot=0.01` kept tpot alone (goodput counted against another
    SLO than the one typed), and a pool's options the last --prefill-options alone. Given again, a
    KEY=VALUE,... flag joins its values; a key in both is refused as within one value."""
    assert sim("replay", AZURE_CONV_SAMPLE, "--limit", "5", "--slo", "ttft=1", "--slo", "tpot=0.01", "--out",
               tmp_path / "a", "--quiet") == 0
    slo = json.loads((tmp_path / "a" / "summary.json").read_text())["options"]["slo"]
    assert (slo["ttft"], slo["tpot"]) == (1.0, 0.01)
    assert sim("replay", AZURE_CONV_SAMPLE, "--limit", "5", "--slo", "ttft=1", "--slo", "ttft=2", "--out",
               tmp_path / "b") == 2
    assert one_error_line(capsys) == "--slo: ttft is given twice"
    assert sim("replay", AZURE_CONV_SAMPLE, "--limit", "5", "--prefill-replicas", "1", "--decode-replicas", "1",
               "--prefill-options", "max-num-seqs=4", "--prefill-options", "num-blocks=5000", "--out", tmp_path / "c",
               "--quiet") == 0
    cluster = json.loads((tmp_path / "c" / "summary.json").read_text())["options"]["cluster"]
    assert cluster["prefill"]["scheduler"]["max_num_seqs"] == 4 and cluster["prefill"]["cache"]["num_blocks"] == 5000
    assert sim("capacity", AZURE_CONV_SAMPLE, "--limit", "5", "--slo", "tbt=0.1", "--slo", "tbt=0.2", "--out",
               tmp_path / "d") == 2
    assert "tbt" in one_error_line(capsys)
