"""`sim trace stats|convert|synth` and the trace options of `sim replay`, end to end."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sim.app.cli import main
from tests.test_trace_readers import BURSTGPT
from traces import AZURE_CONV_SAMPLE, MOONCAKE_SAMPLE, read_trace
from traces.stats import trace_stats
from traces.transforms import mean_rate


def run(*args):
    return main([str(a) for a in args])


def expect_error(capsys, args, fragment):
    assert run(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith("sim: error: ") and err.count("\n") == 1 and fragment in err, err


def test_stats_text_and_json(capsys):
    assert run("trace", "stats", MOONCAKE_SAMPLE) == 0
    text = capsys.readouterr().out
    for fragment in ("requests          200", "span              48.7 s", "mean rate         4.110 requests/s",
                     "inter-arrival CV", "prompt", "p99", "prefix sharing    65.7% of prompt tokens"):
        assert fragment in text, text
    assert run("trace", "stats", AZURE_CONV_SAMPLE, "--json") == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats == json.loads(json.dumps(trace_stats(read_trace(AZURE_CONV_SAMPLE))))
    assert stats["requests"] == 1445 and stats["prefix_sharing_ratio"] is None


def test_stats_after_transforms_and_dropped_rows(capsys):
    assert run("trace", "stats", BURSTGPT, "--json", "--limit", "3") == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.out)
    assert stats["requests"] == 3 and stats["dropped"] == {"0 Response tokens (failed)": 2, "0 Request tokens": 1}
    assert "dropped 2 requests with 0 Response tokens (failed)" in captured.err


def test_convert_with_window_and_target_rate(tmp_path, capsys):
    out = tmp_path / "w.csv.gz"
    assert run("trace", "convert", AZURE_CONV_SAMPLE, out, "--time-window", "60:120", "--target-rate", "10") == 0
    whole, cut = read_trace(AZURE_CONV_SAMPLE), read_trace(out)
    in_window = ((whole.arrival_s >= 60) & (whole.arrival_s < 120)).sum()
    assert len(cut) == in_window and mean_rate(cut) == pytest.approx(10.0, rel=1e-12)


def test_synth_is_seeded_and_reads_back(tmp_path, capsys):
    args = ["--num-requests", 300, "--rate", 4, "--arrival", "gamma", "--cv", 2, "--prompt-len", "zipf:1.1:16:2048",
            "--output-len", "uniform:1:64", "--turns", "uniform:1:4", "--system-prompt-tokens", 128, "--seed", 5]
    assert run("trace", "synth", tmp_path / "a.csv", *args) == 0
    assert run("trace", "synth", tmp_path / "b.csv", *args) == 0
    assert "wrote 300 synthetic requests" in capsys.readouterr().out
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    t = read_trace(tmp_path / "a.csv")
    assert len(t) == 300 and t.hash_block_tokens == 16 and t.request_ids[0] == "s0-t1"
    assert run("trace", "synth", tmp_path / "c.csv", "--num-requests", 50, "--lengths-from", AZURE_CONV_SAMPLE) == 0
    assert set(read_trace(tmp_path / "c.csv").prompt_tokens) <= set(read_trace(AZURE_CONV_SAMPLE).prompt_tokens)


def test_replay_with_rate_scale_limit_and_window(tmp_path):
    assert run("replay", AZURE_CONV_SAMPLE, "--limit", 50, "--rate-scale", 2, "--time-window", "10:",
               "--out", tmp_path / "r", "--quiet") == 0
    requests = pd.read_csv(tmp_path / "r" / "requests.csv")
    whole = read_trace(AZURE_CONV_SAMPLE)
    kept = whole.arrival_s[whole.arrival_s >= 10][:50]
    assert len(requests) == 50
    assert requests["arrival_s"].tolist() == pytest.approx(((kept - kept[0]) / 2).tolist(), abs=1e-9)


def test_replay_on_too_long(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n0,500,100\n")
    summaries = {}
    for mode in ("reject", "truncate"):
        out = tmp_path / mode
        assert run("replay", trace, "--max-model-len", 300, "--on-too-long", mode, "--out", out, "--quiet") == 0
        summaries[mode] = json.loads((out / "summary.json").read_text())
    assert summaries["reject"]["rejected"] == 1 and summaries["truncate"]["rejected"] == 0
    assert summaries["truncate"]["total_prompt_tokens"] == 10 + 200  # 500 cut to 300 - 100


def test_replay_help_lists_trace_options(capsys):
    with pytest.raises(SystemExit):
        run("replay", "--help")
    text = capsys.readouterr().out
    for option in ("--format", "--model-filter", "--rate-scale", "--target-rate", "--time-window", "--limit",
                   "--on-too-long"):
        assert option in text


@pytest.mark.parametrize("args,fragment", [
    (["trace", "stats", AZURE_CONV_SAMPLE, "--time-window", "5"], "--time-window must be START:END"),
    (["trace", "stats", AZURE_CONV_SAMPLE, "--rate-scale", "0"], "--rate-scale must be a number from 1e-06 to 1e+06, got 0 "),
    (["trace", "stats", AZURE_CONV_SAMPLE, "--rate-scale", "2", "--target-rate", "3"], "not both"),
    (["trace", "stats", AZURE_CONV_SAMPLE, "--on-too-long", "truncate"], "needs --max-model-len"),
    (["trace", "stats", AZURE_CONV_SAMPLE, "--model-filter", "GPT-4"], "applies to BurstGPT traces only"),
    (["trace", "stats", AZURE_CONV_SAMPLE, "--format", "csv"], "unknown trace format 'csv'"),
    (["trace", "stats", "nope.csv"], "nope.csv: no such file"),
    (["trace", "synth", "x.csv", "--prompt-len", "gauss:3"], "--prompt-len: cannot read 'gauss:3'"),
    (["trace", "synth", "x.csv", "--cv", "2"], "--cv applies to gamma arrivals"),
    # Flags that changed nothing were ignored, the trace written as if they had not been given.
    (["trace", "synth", "x.csv", "--lengths-from", AZURE_CONV_SAMPLE, "--prompt-len", "fixed:5"],
     "--prompt-len does not combine with --lengths-from"),
    (["trace", "synth", "x.csv", "--lengths-from", AZURE_CONV_SAMPLE, "--output-len", "fixed:5"],
     "--output-len does not combine with --lengths-from"),
    (["trace", "synth", "x.csv", "--diurnal-period", "3600"], "--diurnal-period applies to a daily pattern"),
    (["trace", "synth", "x.csv", "--think-time", "5"], "--think-time applies to sessions of more than one turn"),
    (["replay", AZURE_CONV_SAMPLE, "--limit", "0"], "--limit must be a whole number from 1 to 10,000,000, got 0"),
])
def test_bad_options_exit_2_with_one_line(capsys, args, fragment):
    expect_error(capsys, args, fragment)
