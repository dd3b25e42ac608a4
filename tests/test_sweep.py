"""`sim sweep`: the full grid, resume after a kill, failing points, bad input, Ray = processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from sim.app.cli import main
from sim.app.sweep import RESULTS, make_point, parse_axis, read_table, run_rows
from sim.errors import ServesimError
from traces import AZURE_CONV_SAMPLE

pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]
# 40 requests of the Azure conversation sample: a replay takes a fraction of a second.
SMALL = [str(AZURE_CONV_SAMPLE), "--limit", "40"]
GRID = ["--policy", "prefill-first,chunked", "--max-num-batched-tokens", "256,1024", "--rate-scale", "1,4"]


def sweep(*args) -> int:
    return main(["sweep", *SMALL, *[str(a) for a in args]])


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    """The table without the wall-clock column, which differs from run to run."""
    return frame.drop(columns=["wall_s"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> pd.DataFrame:
    out = tmp_path_factory.mktemp("sweep") / "full"
    assert sweep(*GRID, "--seed", "0,1", "--out", out, "--jobs", 2, "--quiet") == 0
    assert (out / "report.html").exists()
    return read_table(out / RESULTS)[0]


def test_small_sweep_gives_the_full_grid_in_grid_order(uninterrupted):
    frame = uninterrupted
    assert len(frame) == 2 * 2 * 2 * 2 and (frame["status"] == "ok").all()
    grid = [(p, b, r, s) for p in ("prefill-first", "chunked") for b in (256, 1024) for r in (1.0, 4.0) for s in (0, 1)]
    assert list(zip(frame["policy"], frame["max_num_batched_tokens"], frame["rate_scale"], frame["seed"])) == grid
    assert frame["point"].is_unique
    assert (frame["completed"] == 40).all() and (frame["num_requests"] == 40).all()
    for metric in ("ttft", "tpot", "itl", "e2e", "scheduling_delay"):
        assert (frame[f"{metric}_p50"] <= frame[f"{metric}_p99"]).all()
        assert all(len(q) == len(frame["ttft_quantiles"].iloc[0]) for q in frame[f"{metric}_quantiles"])
    # Four times the rate: the same requests arrive in a quarter of the time.
    slow, fast = frame[frame["rate_scale"] == 1.0], frame[frame["rate_scale"] == 4.0]
    assert fast["request_rate"].to_numpy() == pytest.approx(4 * slow["request_rate"].to_numpy())
    # The options are columns, the same as a single replay's summary.
    assert (frame["model"] == "Llama-3.1-8B").all() and (frame["block_size"] == 16).all()


@pytest.mark.slow
def test_killed_sweep_resumes_to_the_same_table(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "sim.app.cli", "sweep", *SMALL, *GRID, "--seed", "0,1", "--out", str(out),
               "--jobs", "1", "--quiet"]
    process = subprocess.Popen(command, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    num_rows, deadline = 0, time.monotonic() + 120
    while num_rows < 3 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
        if (out / RESULTS).exists():
            num_rows = len(read_table(out / RESULTS)[0])  # always whole: the table is replaced atomically
    assert process.poll() is None, "the sweep ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)  # as a crash would: no chance to clean up
    process.wait()
    partial = read_table(out / RESULTS)[0]
    assert 3 <= len(partial) < 16

    assert sweep(*GRID, "--seed", "0,1", "--out", out, "--jobs", 2, "--quiet") == 2  # needs --resume
    assert sweep(*GRID, "--seed", "0,1", "--out", out, "--jobs", 2, "--quiet", "--resume") == 0
    resumed = read_table(out / RESULTS)[0]
    pd.testing.assert_frame_equal(comparable(resumed), comparable(uninterrupted))
    # The points finished before the kill were kept, not run again.
    kept = resumed.set_index("point").loc[partial["point"], "wall_s"]
    assert kept.to_numpy() == pytest.approx(partial["wall_s"].to_numpy())


def test_resume_refuses_a_table_of_other_options(tmp_path, capsys):
    out = tmp_path / "s"
    assert sweep("--policy", "chunked", "--out", out, "--jobs", 1, "--quiet") == 0
    capsys.readouterr()
    assert sweep("--policy", "chunked", "--max-num-seqs", 64, "--out", out, "--resume", "--quiet") == 2
    error = capsys.readouterr().err
    assert "holds results of other options" in error and "max_num_seqs" in error and error.count("\n") == 1
    assert main(["sweep", str(AZURE_CONV_SAMPLE), "--limit", "41", "--out", str(out), "--resume", "--quiet"]) == 2
    assert "a different trace" in capsys.readouterr().err
    assert sweep("--policy", "chunked,prefill-first", "--out", out, "--resume", "--quiet") == 2
    assert "grid policy" in capsys.readouterr().err


def test_resume_refuses_another_commands_folder(tmp_path, capsys):
    """--resume writes into the folder: a replay's (or a capacity search's) is refused, its files untouched."""
    out = tmp_path / "r"
    assert main(["replay", str(AZURE_CONV_SAMPLE), "--limit", "20", "--out", str(out), "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert sweep("--policy", "chunked", "--out", out, "--resume", "--quiet") == 2
    assert "holds no sweep to resume (no results.parquet)" in capsys.readouterr().err
    assert main(["capacity", str(AZURE_CONV_SAMPLE), "--limit", "20", "--slo", "ttft=1", "--out", str(out),
                 "--resume", "--quiet"]) == 2
    assert "holds no capacity search to resume (no probes.parquet)" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sweep("--policy", "chunked", "--out", tmp_path / "new", "--resume", "--jobs", 1, "--quiet") == 0  # none yet


@pytest.mark.parametrize("args, fragment", [
    (["--policy", ""], "--policy: no values, so the grid is empty"),
    (["--seed", ","], "--seed: no values"),
    (["--rate-scale", "1,,2"], "--rate-scale: empty item"),
    (["--rate-scale", "0"], "--rate-scale: '0' must be a positive finite number"),
    (["--rate-scale", "nan"], "--rate-scale: 'nan' must be a positive finite number"),
    (["--max-num-batched-tokens", "256,abc"], "--max-num-batched-tokens: 'abc' is not a whole number"),
    (["--max-num-batched-tokens", "128"], "must be at least --max-num-seqs"),
    (["--policy", "chunked,fifo"], "unknown policy 'fifo'"),
    (["--seed", "1,1"], "--seed: '1' is listed twice"),
    (["--seed", "-1"], "--seed: '-1' must not be negative"),
    (["--model", "GPT-9"], "GPT-9"),
    (["--jobs", "0"], "--jobs must be a whole number from 1 to 4,096 processes, got 0"),
    (["--address", "auto"], "--address is the Ray cluster's"),
])
def test_bad_grids_are_one_line_errors(tmp_path, capsys, args, fragment):
    assert sweep(*args, "--out", tmp_path / "s", "--quiet") == 2
    error = capsys.readouterr().err
    assert error.startswith("sim: error: ") and fragment in error and error.count("\n") == 1
    assert not (tmp_path / "s" / RESULTS).exists()


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    import sim.app.sweep

    real_replay = sim.app.sweep.replay

    def replay(trace, options, **kwargs):
        if options.scheduler.max_num_batched_tokens == 512:
            raise ValueError("boom at 512")
        return real_replay(trace, options, **kwargs)

    monkeypatch.setattr(sim.app.sweep, "replay", replay)  # --jobs 1 runs points in this process
    out = tmp_path / "s"
    assert sweep("--max-num-batched-tokens", "256,512,1024", "--out", out, "--jobs", 1, "--quiet") == 1
    assert "1 of 3 points failed" in capsys.readouterr().err
    frame = read_table(out / RESULTS)[0]
    assert list(frame["status"]) == ["ok", "error", "ok"]
    assert frame["error"].iloc[1] == "ValueError: boom at 512"
    assert frame["policy"].iloc[1] == "chunked" and pd.isna(frame["ttft_p50"].iloc[1])
    assert (out / "report.html").exists()
    # --resume runs only the failed point again.
    monkeypatch.setattr(sim.app.sweep, "replay", real_replay)
    before = frame.set_index("point")["wall_s"]
    assert sweep("--max-num-batched-tokens", "256,512,1024", "--out", out, "--jobs", 1, "--quiet", "--resume") == 0
    after = read_table(out / RESULTS)[0].set_index("point")
    assert (after["status"] == "ok").all()
    ok = frame.loc[frame["status"] == "ok", "point"]
    assert after.loc[ok, "wall_s"].to_numpy() == pytest.approx(before.loc[ok].to_numpy())


def test_parse_axis():
    assert parse_axis("max_num_batched_tokens", "256, 512") == (256, 512)
    assert parse_axis("rate_scale", "0.5,1,2") == (0.5, 1.0, 2.0)
    assert parse_axis("policy", "chunked") == ("chunked",)
    with pytest.raises(ServesimError, match="--rate-scale: 'inf'"):
        parse_axis("rate_scale", "inf")


def _points(policies=("prefill-first", "chunked"), scales=(1.0, 3.0)):
    from sim.app.replay import ReplayOptions
    from sim.config import SchedulerConfig

    points = []
    for policy in policies:
        for scale in scales:
            values = {"policy": policy, "model": "Llama-3.1-8B", "hardware": "H100-SXM",
                      "max_num_batched_tokens": 512, "max_num_seqs": 256, "max_num_active_seqs": 0,
                      "long_prefill_token_threshold": 0, "scheduling_policy": "fcfs", "prefill_schedule_interval": 1,
                      "watermark": 0.0, "cache_aware_admission_window": 0, "stream_interval": 1, "rate_scale": scale,
                      "seed": 0}
            points.append(make_point(values, lambda v: ReplayOptions(scheduler=SchedulerConfig(v["policy"], 512))))
    return points


def _rows(rows) -> pd.DataFrame:
    return comparable(pd.DataFrame(sorted(rows, key=lambda r: r["point"])))


def test_ray_executor_gives_the_same_rows_as_processes():
    pytest.importorskip("ray")
    from traces import read_trace
    from traces.transforms import limit

    trace = limit(read_trace(AZURE_CONV_SAMPLE), 30)
    points = _points()
    by_process = _rows(run_rows(trace, points, "process", jobs=2))
    by_ray = _rows(run_rows(trace, points, "ray", jobs=2))
    assert (by_process["status"] == "ok").all()
    pd.testing.assert_frame_equal(by_ray, by_process)
    pd.testing.assert_frame_equal(_rows(run_rows(trace, points, "process", jobs=1)), by_process)


def test_ray_missing_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("no ray here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    from traces import read_trace

    with pytest.raises(ServesimError, match=r"pip install 'servesim\[ray\]'"):
        list(run_rows(read_trace(AZURE_CONV_SAMPLE), _points(scales=(1.0,)), "ray", jobs=1))


def test_progress_bar_shows_points_failures_and_an_eta(capsys):
    from sim.app.progress import Progress
    from sim.app.sweep_cli import _on_row

    bar = Progress(4, "points", enabled=True, done=1)  # one point was done before a resume
    on_row = _on_row(bar)
    on_row({"status": "ok"}, 2, 4)
    on_row({"status": "error"}, 3, 4)
    bar.close()
    lines = capsys.readouterr().err.split("\r")
    assert lines[1].startswith("  [#######.......................] 1/4 points  0:00 elapsed  ETA --:--")
    assert "3/4 points  1 failed  0:0" in lines[-1] and "elapsed  ETA 0:0" in lines[-1]
    Progress(4, "points", enabled=False).update(2)
    assert capsys.readouterr().err == ""


def test_a_resume_refusal_names_the_option_that_differs():
    """A table of one engine resumed as a cluster's: the replicas are named, not an empty pool option."""
    from sim.app.results_table import difference

    one = {"trace_sha256": "t", "axes": {}, "fixed": {"seed": 0}}
    cluster = {"trace_sha256": "t", "axes": {}, "fixed": {"seed": 0, "cluster_decode_options": "",
                                                          "cluster_num_replicas": 2}}
    assert difference(one, cluster) == "option cluster_num_replicas = not set there, 2 here"
    assert difference(one, {**one, "fixed": {"seed": 3}}) == "option seed = 0 there, 3 here"


@pytest.mark.slow
def test_a_sweep_over_cache_aware_admission_windows(tmp_path):
    # The Mooncake sample's shared prefixes under a tight cache: a window moves cached prompts ahead.
    from traces import MOONCAKE_SAMPLE

    out = tmp_path / "w"
    assert main(["sweep", str(MOONCAKE_SAMPLE), "--limit", "120", "--num-gpu-blocks", "3000",
                 "--cache-aware-admission-window", "0,32", "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    frame = read_table(out / RESULTS)[0]
    assert frame["cache_aware_admission_window"].tolist() == [0, 32] and (frame["status"] == "ok").all()
    assert (frame["num_requests"] == 120).all() and frame["completed"].nunique() == 1  # (the same rejected)
    assert frame["ttft_p50"].iloc[1] != frame["ttft_p50"].iloc[0]


def test_a_share_axis_takes_zero_and_its_range():
    assert parse_axis("watermark", "0,0.1,0.5") == (0.0, 0.1, 0.5)
    with pytest.raises(ServesimError, match="--watermark: '-0.1' must be a non-negative finite number"):
        parse_axis("watermark", "0,-0.1")
    with pytest.raises(ServesimError, match="--watermark must be a number from 0 to 0.99, got 1"):
        parse_axis("watermark", "1")
    with pytest.raises(ServesimError, match="--rate-scale: '0' must be a positive finite number"):
        parse_axis("rate_scale", "0")


@pytest.mark.slow
def test_a_sweep_over_max_num_active_seqs(tmp_path):
    # 0 is unset (--max-num-seqs, 32 here); 4 holds the Azure sample's requests back at 2x their rate.
    out = tmp_path / "a"
    assert main(["sweep", str(AZURE_CONV_SAMPLE), "--limit", "120", "--rate-scale", "2", "--max-num-seqs", "32",
                 "--max-num-active-seqs", "0,4,32", "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    frame = read_table(out / RESULTS)[0]
    assert frame["max_num_active_seqs"].tolist() == [0, 4, 32] and (frame["status"] == "ok").all()
    assert frame["ttft_p50"].iloc[1] > frame["ttft_p50"].iloc[0] == frame["ttft_p50"].iloc[2]


def test_the_max_num_active_seqs_axis_takes_zero_for_unset():
    assert parse_axis("max_num_active_seqs", "0,16,64") == (0, 16, 64)
    with pytest.raises(ServesimError, match="--max-num-active-seqs must be a whole number from 0 to 1,048,576"):
        parse_axis("max_num_active_seqs", "2000000")


def test_a_grid_of_policies_gives_chunked_only_options_to_its_chunked_points(tmp_path, capsys):
    # decode-first reads no long-prefill cap: in a grid of policies it runs without one (its row says 0), where a
    # replay or a sweep of decode-first alone refuses the cap; the table's grid holds the values given.
    out = tmp_path / "p"
    assert main(["sweep", *SMALL, "--policy", "decode-first,chunked", "--long-prefill-token-threshold", "16",
                 "--prefill-schedule-interval", "2", "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    frame, identity = read_table(out / RESULTS)
    assert frame["policy"].tolist() == ["decode-first", "chunked"] and (frame["status"] == "ok").all()
    assert frame["long_prefill_token_threshold"].tolist() == [0, 16]
    assert frame["prefill_schedule_interval"].tolist() == [1, 2]
    assert identity["axes"]["long_prefill_token_threshold"] == [16] and identity["axes"]["prefill_schedule_interval"] == [2]
    assert main(["sweep", *SMALL, "--policy", "decode-first,chunked", "--long-prefill-token-threshold", "16",
                 "--prefill-schedule-interval", "2", "--out", str(out), "--jobs", "1", "--quiet", "--resume"]) == 0
    capsys.readouterr()
    assert main(["sweep", *SMALL, "--policy", "decode-first", "--long-prefill-token-threshold", "16",
                 "--out", str(tmp_path / "q"), "--quiet"]) == 2
    assert "--long-prefill-token-threshold 16 caps the prefill chunks of the chunked policy" in capsys.readouterr().err


def test_an_active_seqs_refusal_says_the_grids_max_num_seqs_was_its_default(tmp_path, capsys):
    assert main(["sweep", *SMALL, "--max-num-active-seqs", "512", "--out", str(tmp_path / "a"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        "sim: error: --max-num-active-seqs (512) cannot be greater than --max-num-seqs (256), as vLLM refuses it "
        "(--max-num-seqs 256 is the grid's default, not vLLM's for the GPU: give --max-num-seqs)")
    assert main(["sweep", *SMALL, "--max-num-seqs", "256", "--max-num-active-seqs", "512", "--out",
                 str(tmp_path / "b"), "--quiet"]) == 2
    assert "grid's default" not in capsys.readouterr().err  # given, not a default


def test_a_sweep_over_stream_interval(tmp_path):
    # vLLM's --stream-interval changes only what the streaming client sees: the engine's steps, TTFT and
    # TPOT are the same at every point, the client's inter-token gaps grow with it.
    out = tmp_path / "s"
    assert main(["sweep", *SMALL, "--stream-interval", "1,4", "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    frame = read_table(out / RESULTS)[0]
    assert frame["stream_interval"].tolist() == [1, 4] and (frame["status"] == "ok").all()
    assert frame["ttft_p50"].iloc[0] == frame["ttft_p50"].iloc[1] and frame["tpot_p50"].iloc[0] == frame["tpot_p50"].iloc[1]
    assert frame["point"].str.contains("stream_interval=4").iloc[1]
    # the client's gaps: the engine's at 1 (no client_itl columns then), about four of them at 4
    assert frame["client_itl_mean"].isna().iloc[0] and frame["client_itl_mean"].iloc[1] > 3 * frame["itl_mean"].iloc[1]
    with pytest.raises(ServesimError, match="--stream-interval"):
        parse_axis("stream_interval", "0")


def test_points_of_the_same_options_run_once(tmp_path, monkeypatch):
    """decode-first reads no prefill cadence: in a grid of policies its points at intervals 1 and 2 are
    the same replay, run once; the second gets the first's row under its own key (wall_s 0)."""
    from sim.app import sweep as sweep_module

    calls = []
    real = sweep_module.run_point
    monkeypatch.setattr(sweep_module, "run_point", lambda trace, point: calls.append(point.key) or real(trace, point))
    out = tmp_path / "d"
    assert main(["sweep", *SMALL, "--policy", "decode-first,chunked", "--prefill-schedule-interval", "1,2",
                 "--out", str(out), "--jobs", "1", "--quiet"]) == 0
    frame = read_table(out / RESULTS)[0]
    assert len(frame) == 4 and len(calls) == 3 and (frame["status"] == "ok").all()
    decode_first = frame[frame["policy"] == "decode-first"]
    assert decode_first["point"].str.contains("prefill_schedule_interval=2").tolist() == [False, True]
    a, b = (decode_first.drop(columns=["point", "wall_s"]).iloc[k] for k in (0, 1))
    def missing(v) -> bool:
        return v is None or (isinstance(v, float) and v != v)

    assert all((missing(x) and missing(y)) or str(x) == str(y) for x, y in zip(a, b))
    assert decode_first["wall_s"].iloc[1] == 0.0
    chunked = frame[frame["policy"] == "chunked"]
    assert chunked["prefill_schedule_interval"].tolist() == [1, 2] and chunked["wall_s"].gt(0).all()


def test_what_an_interrupted_sweep_says_it_kept():
    """A sweep stopped before any point finished said "0 finished points are in DIR/results.parquet; continue
    with --resume" of a folder it had removed, and "sim: interrupted" twice."""
    from types import SimpleNamespace

    from sim.app.sweep_cli import interrupted_words

    folder = SimpleNamespace(staged=False, final="out")
    assert interrupted_words(folder, None) == "sim: nothing had finished, so nothing was kept"
    assert interrupted_words(folder, "1 finished point is in out/results.parquet") == \
        "sim: 1 finished point is in out/results.parquet; continue with the same command and --resume"
    assert interrupted_words(SimpleNamespace(staged=True, final="out"), None) == \
        "sim: out still holds the run it had (this --overwrite run is discarded)"


def test_the_sweep_table_keeps_its_columns_apart():
    """An axis name longer than 14 characters ran into the next ("policyprefill interval"), and a point's
    rejections, a count, read 29.0."""
    import pandas as pd

    from sim.app.sweep_cli import format_sweep

    frame = pd.DataFrame({"status": ["ok", "ok"], "policy": ["chunked", "decode-first"],
                          "prefill_schedule_interval": [1, 4], "request_throughput": [7.25, 7.0],
                          "rejected": [0, 29], "ttft_p50": [0.05, 0.06], "ttft_p99": [0.2, 0.3],
                          "itl_p99": [0.03, 0.04], "scheduling_delay_p50": [0.01, 0.02], "e2e_p99": [5.0, 6.0]})
    from reports.axes import AXES

    for axis in AXES:  # the other axes, alike at every point
        if axis not in frame:
            frame[axis] = 0
    text = format_sweep(frame)
    head, *rows = text.splitlines()
    assert "policy prefill interval" in head.replace("  ", " ") and "policyprefill" not in head
    assert rows[1].split()[:4] == ["decode-first", "4", "7.0", "29"]


def test_a_resume_with_a_plugin_edited_since_is_refused(tmp_path, capsys):
    """Found by a new-user run: a sweep of a user's policy, its file edited and the sweep resumed, mixed
    the two versions' rows silently. The table's identity holds each plugin file's sha256; a table of
    built-in policies keeps the identity it had."""
    from sim.app.results_table import plugin_code

    plugin = tmp_path / "mine.py"
    plugin.write_text("from policies.chunked import ChunkedPolicy\n\n\nclass Mine(ChunkedPolicy):\n    pass\n")
    from traces import AZURE_CONV_SAMPLE

    args = ["sweep", str(AZURE_CONV_SAMPLE), "--limit", "12", "--policy", f"{plugin}:Mine,chunked",
            "--max-num-batched-tokens", "256,512", "--jobs", "1", "--out", str(tmp_path / "sw"), "--quiet"]
    assert main(args) == 0 and main([*args, "--resume"]) == 0
    plugin.write_text(plugin.read_text() + "# edited\n")
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    assert f"your plugin {plugin}:Mine changed since those rows ran" in capsys.readouterr().err
    assert plugin_code(["chunked", "round-robin", None]) == {}


def test_one_plugin_spelled_two_ways_is_listed_twice(tmp_path):
    """Found by a new-user run: `a/p.py:P` and `a/../a/p.py:P` ran twice as two policies."""
    (tmp_path / "a").mkdir()
    plugin = tmp_path / "a" / "p.py"
    plugin.write_text("")
    with pytest.raises(ServesimError, match="is listed twice \\(the same file and class spelled another way\\)"):
        parse_axis("policy", f"{plugin}:P,{tmp_path / 'a' / '..' / 'a' / 'p.py'}:P")
    assert parse_axis("policy", f"{plugin}:P,{plugin}:Q,chunked") == (f"{plugin}:P", f"{plugin}:Q", "chunked")


def test_truncation_over_a_grid_of_models_cuts_each_points_requests_to_its_own_limit(tmp_path, capsys):
    """Found by a review with odd grids: --on-too-long truncate over Llama-3.1-8B (131,072 tokens) and
    Qwen3-0.6B (40,960) cut every point's requests to 40,960, so the Llama row said max_model_len
    131072 beside 82,105 prompt tokens of the trace's 150,200; sim capacity passed Llama on prompts cut
    the same way. Each point cuts to its own limit, and the terminal says how many each cuts."""
    trace = tmp_path / "long.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100000,10\n1,200,20\n2,50000,5\n")
    out = tmp_path / "sweep"
    assert main(["sweep", str(trace), "--model", "Llama-3.1-8B,Qwen3-0.6B", "--on-too-long", "truncate", "--out",
                 str(out), "--jobs", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert ("sim: warning: --on-too-long truncate: each point cuts the requests longer than its own "
            "--max-model-len (2 at 40960, 0 at 131072)") in err
    rows = read_table(out / RESULTS)[0].set_index("model")
    assert rows.loc["Llama-3.1-8B", "total_prompt_tokens"] == 150200
    assert rows.loc["Qwen3-0.6B", "total_prompt_tokens"] == (40960 - 10) + 200 + (40960 - 5)
    alone = tmp_path / "alone"
    assert main(["sweep", str(trace), "--model", "Llama-3.1-8B", "--on-too-long", "truncate", "--out", str(alone),
                 "--jobs", "1", "--quiet"]) == 0
    llama = read_table(alone / RESULTS)[0].iloc[0]
    assert llama["total_prompt_tokens"] == 150200 and llama["ttft_p99"] == rows.loc["Llama-3.1-8B", "ttft_p99"]
