"""`sim compare`: the exact step join, the error figures, the report files; the CPU round trip."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from backends.calibration import calibrate
from backends.costmodel import CostModel
from backends.costmodel.fitted import CalibratedCostModel
from backends.model_config import ModelConfig
from backends.profile import load_profile, save_profile
from sim.app.compare import PredictingBackend, compare, join_steps, step_kind, write_comparison
from sim.app.plan import resolve
from sim.app.replay import ReplayOptions, replay
from sim.config import CacheConfig, SchedulerConfig
from tests.helpers import make_trace
from tests.test_calibrate import StandInBackend

# 16 requests: prompts long enough to be chunked by a 128-token budget, so steps mix.
ROWS = [(0.002 * i, 40 + 37 * i, 3 + (5 * i) % 11) for i in range(16)]


class CountingPredictor:
    def __init__(self, costmodel: CostModel):
        self.costmodel, self.batches = costmodel, []

    def execute(self, batch):
        self.batches.append((tuple(batch.num_computed_tokens), tuple(batch.num_scheduled_tokens)))
        return self.costmodel.execute(batch)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compare")
    profile, _ = calibrate(StandInBackend("tiny", num_blocks=512), "tiny", grid="small", warmup=0, repeats=3)
    path = folder / "tiny-standin.json"
    save_profile(profile, path)
    cache = CacheConfig(num_blocks=256)
    scheduler = SchedulerConfig("chunked", max_num_batched_tokens=128, max_num_seqs=8)
    predicted = ReplayOptions(scheduler=scheduler, cache=cache, model="tiny", hardware="H200", profile=str(path))
    measured = replace(predicted, profile=None)
    return folder, path, measured, predicted


def test_step_join_is_exact(setup):
    _, path, measured_options, predicted_options = setup
    trace = make_trace(ROWS)
    standin = StandInBackend("tiny", num_blocks=256, seed=3)
    predictor = CountingPredictor(CalibratedCostModel(ModelConfig.from_preset("tiny"), load_profile(path).calibration))
    recorder = PredictingBackend(standin, predictor)
    result = replay(trace, resolve(measured_options, backend=recorder))
    steps = join_steps(result, recorder)
    # Every executed step was measured once and predicted once, from the same batch.
    assert standin.num_executed == len(predictor.batches) == len(steps) == len(result.steps) > 10
    assert np.array_equal(steps["measured_s"], result.steps.seconds)
    assert steps["step"].tolist() == list(range(len(steps)))
    expected = [sum(scheduled) for _, scheduled in predictor.batches]
    assert (steps["num_prefill_tokens"] + steps["num_decode_tokens"]).tolist() == expected
    assert set(steps["kind"]) == {"prefill", "decode", "mixed"}
    # A step lost or doubled is an error, not a silently shifted join.
    recorder.measured_s.pop()
    with pytest.raises(RuntimeError, match="predicted"):
        join_steps(result, recorder)


def test_step_kinds():
    from sim.batch import Batch

    b = Batch()
    b.add("a", 0, 5, [0], needs_logits=True)
    assert step_kind(b) == "prefill"
    b.add("b", 9, 1, [1], needs_logits=True, is_decode=True)
    assert step_kind(b) == "mixed"
    d = Batch()
    d.add("b", 9, 1, [1], needs_logits=True, is_decode=True)
    assert step_kind(d) == "decode"


def test_compare_writes_every_error_figure_and_the_report(setup):
    folder, path, measured_options, predicted_options = setup
    trace = make_trace(ROWS)
    measured = resolve(measured_options, StandInBackend("tiny", num_blocks=256, seed=4))
    predicted = resolve(predicted_options)
    comparison = compare(trace, measured, predicted)
    out = folder / "out"
    figures = write_comparison(out, comparison, trace, measured, predicted,
                               {"model": "tiny", "device": "cpu", "policy": "chunked", "trace": "test"})
    for name in ("compare.json", "steps.csv", "report.html", "measured/summary.json", "predicted/summary.json",
                 "measured/steps.parquet", "predicted/requests.csv"):
        assert (out / name).is_file(), name
    data = json.loads((out / "compare.json").read_text())
    errors = data["errors"]
    # Each step-level figure is the statistic of |predicted - measured| / measured over that kind of step.
    steps = comparison.steps
    for kind in ("all", "prefill", "decode", "mixed"):
        ape = (steps if kind == "all" else steps[steps["kind"] == kind])["ape"].to_numpy()
        assert len(ape) > 0, kind
        assert errors[f"step_{kind}_median_ape"] == pytest.approx(np.median(ape), rel=1e-12)
        assert errors[f"step_{kind}_p90_ape"] == pytest.approx(np.quantile(ape, 0.9), rel=1e-12)
        assert errors[f"step_{kind}_max_ape"] == pytest.approx(ape.max(), rel=1e-12)
    # Each end-to-end figure is (predicted - measured) / measured of the two runs' summaries.
    measured = json.loads((out / "measured" / "summary.json").read_text())
    predicted = json.loads((out / "predicted" / "summary.json").read_text())
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for p in ("p50", "p90", "p99"):
            want = (predicted[metric][p] - measured[metric][p]) / measured[metric][p]
            assert errors[f"{metric}_{p}_rel_error"] == pytest.approx(want, rel=1e-9)
    for name in ("request_throughput", "output_throughput"):
        assert errors[f"{name}_rel_error"] == pytest.approx((predicted[name] - measured[name]) / measured[name], rel=1e-9)
    assert data["step_error"]["all"]["count"] == len(comparison.steps) == len(comparison.measured.steps)
    assert errors == figures["errors"]
    assert data["requests"] == {run: {"completed": summary["completed"], "rejected": summary["rejected"]}
                                for run, summary in (("measured", measured), ("predicted", predicted))}
    # The stand-in is the datasheet roofline with 2% noise: the calibrated model predicts it closely.
    assert errors["step_all_median_ape"] < 0.1
    page = (out / "report.html").read_text()
    assert "Plotly.newPlot" in page and "predicted vs measured" in page
    # The options in which the two runs differ are named, as `sim report` of a folder of runs names them.
    # (the stand-in was priced by the roofline, which its summary says, the prediction by its profile)
    assert data["differing_options"] == {"profile": [None, str(path)], "cost_model": [
        "roofline: the datasheet's peaks and bandwidth (no operator-table profile matches)", None]}
    assert f"The two runs differ only in profile: - (measured), {path} (predicted); cost_model: roofline" in page
    assert "<script src=" not in page and "<script charset=\"utf-8\" src=" not in page
    assert len(page) > 1_000_000  # plotly.js inline: works offline


def test_report_of_a_comparison_keeps_its_page(setup, capsys):
    """`sim report` of sim compare's folder drew its two runs as a folder of runs into report.html, replacing
    compare's own page (the step times predicted against measured), which nothing can draw again."""
    from sim.app.cli import main
    from sim.app.outputs import write_manifest

    folder, _, measured_options, predicted_options = setup
    trace = make_trace(ROWS)
    measured = resolve(measured_options, StandInBackend("tiny", num_blocks=256, seed=4))
    predicted = resolve(predicted_options)
    out = folder / "kept"
    write_comparison(out, compare(trace, measured, predicted), trace, measured, predicted,
                     {"model": "tiny", "device": "cpu", "policy": "chunked", "trace": "test"})
    write_manifest(out)  # as sim compare's claimed folder records its files (measured/report.html too)
    page = (out / "report.html").read_bytes()
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    assert capsys.readouterr().err == (f"sim: error: {out}: a comparison by sim compare; its report.html is sim "
                                       "compare's own page (step times predicted against measured, the error "
                                       "figures), which sim report cannot draw again and would replace; sim report "
                                       f"{out / 'measured'} or {out / 'predicted'} reports either run\n")
    assert (out / "report.html").read_bytes() == page
    assert main(["report", str(out / "measured")]) == 0
    # recorded in the comparison's own manifest, so the folder stays servesim's whole
    from sim.app.outputs import foreign_entries, read_manifest
    assert "measured/report.html" in read_manifest(out) and foreign_entries(out) == []
    assert main(["report", str(out / "measured")]) == 0


def test_compare_refuses_different_kv_caches(setup):
    _, _, measured_options, predicted_options = setup
    from sim.errors import ServesimError

    other = replace(predicted_options, cache=CacheConfig(num_blocks=128))
    with pytest.raises(ServesimError, match="same number of KV blocks"):
        compare(make_trace(ROWS), resolve(measured_options, StandInBackend("tiny")), resolve(other))


def test_compare_needs_a_profile(tmp_path, capsys):
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,10,2\n")
    assert main(["compare", str(trace), "--model", "tiny", "--out", str(tmp_path / "c")]) == 2
    assert "needs --profile" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_where_every_request_is_rejected_says_there_is_nothing_to_compare(tmp_path, capsys):
    """Before, the report's CDF of no finished request was an internal error."""
    pytest.importorskip("torch")
    from sim.app.cli import main

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,40,2\n0.1,50,2\n")
    assert main(["compare", str(trace), "--model", "tiny", "--device", "cpu", "--profile",
                 str(Path(__file__).resolve().parents[1] / "profiles" / "tiny-cpu.json"), "--num-gpu-blocks", "1",
                 "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "no figure for ttft_p50_rel_error (nothing to compare" in out and "missed" not in out
    assert "requests measured 0 completed, 2 rejected; predicted 0 completed, 2 rejected" in out
    assert (tmp_path / "c" / "report.html").is_file()


@pytest.mark.slow
def test_cpu_round_trip_calibrate_then_compare_on_tiny(tmp_path, capsys):
    """The real backend on the CPU: `sim calibrate` (small grid), then `sim compare` with its profile."""
    pytest.importorskip("torch")
    from sim.app.cli import main

    profile = tmp_path / "tiny-cpu.json"
    assert main(["calibrate", "--model", "tiny", "--device", "cpu", "--grid", "small", "--warmup", "1",
                 "--repeats", "2", "--out", str(profile)]) == 0
    assert profile.is_file() and profile.with_suffix(".csv").is_file()
    assert "fit error" in capsys.readouterr().out
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n"
                     + "".join(f"{a:.3f},{p},{o}\n" for a, p, o in ROWS[:8]))
    out = tmp_path / "cmp"
    # --max-num-batched-tokens left unset: the real backend's run keeps servesim's 2048 (vLLM's for an H100,
    # the --hardware, would be 8192), and the cost model's run has the very same scheduler.
    assert main(["compare", str(trace), "--model", "tiny", "--device", "cpu", "--profile", str(profile),
                 "--max-num-seqs", "8", "--num-blocks", "128", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "median APE" in printed and "ttft_p50" in printed
    data = json.loads((out / "compare.json").read_text())
    for name in ("step_all_median_ape", "step_all_p90_ape", "ttft_p50_rel_error", "ttft_p99_rel_error",
                 "tpot_p50_rel_error", "tpot_p99_rel_error"):
        assert math.isfinite(data["errors"][name]), name
    measured = json.loads((out / "measured" / "summary.json").read_text())
    assert measured["options"]["backend"] == "real" and measured["completed"] == 8
    predicted = json.loads((out / "predicted" / "summary.json").read_text())
    assert predicted["options"]["profile"] == str(profile)
    assert data["differing_options"]["backend"] == ["real", "costmodel"]
    assert predicted["options"]["scheduler"] == measured["options"]["scheduler"]
    assert measured["options"]["scheduler"]["max_num_batched_tokens"] == 2048
    assert data["step_error"]["all"]["count"] == measured["num_steps"]
    assert (out / "report.html").stat().st_size > 1_000_000 and (out / "steps.csv").is_file()
