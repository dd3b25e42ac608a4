"""`sim compare`: predicted against measured, step by step and end to end.

1. The trace is replayed with the measured (real) backend. Every batch the engine executes also
   goes, unchanged, to the calibrated cost model: each executed step is predicted exactly once,
   from the very same batch, so the step-level error needs no matching afterwards.
2. The trace is replayed again, independently, with the cost model alone; the two runs' request
   metrics are set side by side.

Errors: step-level absolute percentage error |predicted - measured| / measured (median, p90,
max), over all steps and split into prefill-only, decode-only and mixed steps; end to end, the
signed relative error (predicted - measured) / measured of each metric.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from backends.profile import ape_stats, load_profile
from reports.compare_page import STEP_KINDS, write_compare_report
from sim.app.options import ReplayOptions
from sim.app.outputs import atomic_path, atomic_write_text, command_inputs, open_run_folder
from sim.app.plan import RunPlan, resolve
from sim.app.replay import replay, write_run
from sim.backend import StepResult
from sim.batch import Batch
from sim.engine import SimResult
from sim.errors import ServesimError
from sim.jsonable import jsonable
from traces.trace import Trace

METRICS = tuple(f"{m}_{p}" for m in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p90", "p99")) + (
    "request_throughput", "output_throughput", "total_token_throughput", "duration_s")
# What a calibrated profile should reach on its own device, marked in the report: step-level median error
# <= 5% and p90 <= 15%; p50 and p99 TTFT and TPOT within 10% of the measured run.
TARGETS = {"step_all_median_ape": 0.05, "step_all_p90_ape": 0.15, "ttft_p50_rel_error": 0.10,
           "ttft_p99_rel_error": 0.10, "tpot_p50_rel_error": 0.10, "tpot_p99_rel_error": 0.10}


def step_kind(batch: Batch) -> str:
    num_decode = batch.num_decode_tokens
    if num_decode == 0:
        return "prefill"
    return "decode" if num_decode == len(batch) else "mixed"


class PredictingBackend:
    """Runs each batch on the measured backend and predicts the very same batch with the cost model."""

    supports_fast_forward = False  # every step must reach execute, to be measured and predicted

    def __init__(self, measured, predictor):
        self.measured, self.predictor = measured, predictor
        self.name, self.device, self.dtype = measured.name, measured.device, measured.dtype
        self.num_blocks = measured.num_blocks
        self.kinds: list[str] = []
        self.measured_s: list[float] = []
        self.predicted_s: list[float] = []

    def execute(self, batch: Batch) -> StepResult:
        result = self.measured.execute(batch)
        self.kinds.append(step_kind(batch))
        self.measured_s.append(result.seconds)
        self.predicted_s.append(self.predictor.execute(batch).seconds)
        return result


@dataclass
class Comparison:
    measured: SimResult
    predicted: SimResult  # the independent cost-model replay
    steps: pd.DataFrame  # one row per executed step of the measured run: measured_s, predicted_s, ape


def join_steps(result: SimResult, recorder: PredictingBackend) -> pd.DataFrame:
    """The measured run's steps with their predictions; checks that each step was predicted once."""
    from reports.metrics import steps_table

    steps = steps_table(result)
    if len(recorder.measured_s) != len(steps) or not np.array_equal(recorder.measured_s, steps["seconds"]):
        raise RuntimeError(f"internal error: {len(steps)} steps ran but {len(recorder.measured_s)} were predicted")
    frame = steps[["step", "start_s", "num_prefill_tokens", "num_decode_tokens", "num_requests"]].copy()
    frame.insert(1, "kind", recorder.kinds)
    frame["measured_s"] = steps["seconds"]
    frame["predicted_s"] = recorder.predicted_s
    frame["ape"] = (frame["predicted_s"] - frame["measured_s"]).abs() / frame["measured_s"]
    return frame


def compare(trace: Trace, measured: RunPlan, predicted: RunPlan, progress=None) -> Comparison:
    """Replay with the measured run's backend, predicting each step with the predicted run's cost
    model; then replay with the cost model alone."""
    if predicted.options.backend != "costmodel":
        raise ServesimError("the predicted run needs the cost-model backend")
    if measured.num_blocks != predicted.num_blocks:
        raise ServesimError("the measured and predicted runs must have the same number of KV blocks")
    recorder = PredictingBackend(measured.backend, predicted.backend)
    measured_result = replay(trace, replace(measured, backend=recorder), progress=progress)
    steps = join_steps(measured_result, recorder)
    predicted_result = replay(trace, predicted)
    return Comparison(measured_result, predicted_result, steps)


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def _metric(summary: dict, name: str) -> float | None:
    metric, _, stat = name.rpartition("_")
    if metric in ("ttft", "tpot", "itl", "e2e") and stat in ("p50", "p90", "p99"):
        return summary[metric][stat]
    return summary[name]


def error_figures(steps: pd.DataFrame, measured_summary: dict, predicted_summary: dict) -> dict:
    """Every error figure, by name (fractions: 0.05 is 5%)."""
    step_error = {"all": ape_stats(steps["predicted_s"], steps["measured_s"])}
    for kind in STEP_KINDS:
        rows = steps[steps["kind"] == kind]
        step_error[kind] = ape_stats(rows["predicted_s"], rows["measured_s"])
    total_measured, total_predicted = float(steps["measured_s"].sum()), float(steps["predicted_s"].sum())
    metrics = {}
    for name in METRICS:
        m, p = _metric(measured_summary, name), _metric(predicted_summary, name)
        metrics[name] = {"measured": m, "predicted": p, "relative_error": relative_error(p, m)}
    errors = {}
    for kind, stats in step_error.items():
        for stat in ("median_ape", "p90_ape", "max_ape", "median_error"):
            errors[f"step_{kind}_{stat}"] = stats[stat]
    errors["step_total_seconds_rel_error"] = relative_error(total_predicted, total_measured)
    for name, value in metrics.items():
        errors[f"{name}_rel_error"] = value["relative_error"]
    targets = {name: (errors[name] is not None and abs(errors[name]) <= limit) for name, limit in TARGETS.items()}
    # How many requests each run completed and rejected (too long, HTTP 503): the figures above are of the
    # completed, so two runs that shed different requests are compared on different requests.
    requests = {run: {"completed": summary["completed"], "rejected": summary["rejected"]}
                for run, summary in (("measured", measured_summary), ("predicted", predicted_summary))}
    return {"errors": errors, "step_error": step_error,
            "step_total_seconds": {"measured": total_measured, "predicted": total_predicted},
            "metrics": metrics, "requests": requests, "targets": {"limits": TARGETS, "met": targets}}


def format_comparison(figures: dict) -> str:
    def pct(x, signed=False):
        return "-" if x is None else (f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%")

    def value(name, x):
        if x is None:
            return "-"
        return f"{x:.2f}" if "throughput" in name or name == "duration_s" else f"{x * 1e3:.2f}"

    lines = ["step time, cost model on the measured run's own batches",
             f"  {'steps':<10}{'count':>8}{'median APE':>12}{'p90 APE':>10}{'max APE':>10}{'bias':>10}"]
    for kind, s in figures["step_error"].items():
        lines.append(f"  {kind:<10}{s['count']:>8}{pct(s['median_ape']):>12}{pct(s['p90_ape']):>10}"
                     f"{pct(s['max_ape']):>10}{pct(s['median_error'], signed=True):>10}")
    lines += ["end to end, measured run against an independent cost-model run (ms; throughput per s)",
              "  requests " + "; ".join(f"{run} {n['completed']} completed, {n['rejected']} rejected"
                                        for run, n in figures["requests"].items()),
              f"  {'metric':<24}{'measured':>12}{'predicted':>12}{'rel. error':>12}"]
    for name, m in figures["metrics"].items():
        lines.append(f"  {name:<24}{value(name, m['measured']):>12}{value(name, m['predicted']):>12}"
                     f"{pct(m['relative_error'], signed=True):>12}")
    met, errors = figures["targets"]["met"], figures["errors"]
    lines.append(f"targets met: {sum(met.values())}/{len(met)}"
                 + "".join(f"\n  missed {k} (limit {TARGETS[k]:.0%})" if errors[k] is not None else
                           f"\n  no figure for {k} (nothing to compare: no finished request or step)"
                           for k, ok in met.items() if not ok))
    return "\n".join(lines)


def write_comparison(out: Path, comparison: Comparison, trace: Trace, measured: RunPlan, predicted: RunPlan,
                     info: dict) -> dict:
    """measured/ and predicted/ run folders, steps.csv, compare.json and report.html; returns the figures."""
    measured_summary = write_run(out / "measured", comparison.measured, measured, trace)  # makes `out` too
    predicted_summary = write_run(out / "predicted", comparison.predicted, predicted, trace)
    with atomic_path(out / "steps.csv") as temp:
        comparison.steps.to_csv(temp, index=False)
    figures = error_figures(comparison.steps, measured_summary, predicted_summary)
    differ = options_that_differ(measured_summary, predicted_summary)
    atomic_write_text(out / "compare.json", json.dumps(jsonable({**info, **figures, "differing_options": differ}),
                                                       indent=2) + "\n")
    with atomic_path(out / "report.html") as temp:
        write_compare_report(temp, comparison.steps,
                             {"measured": comparison.measured, "predicted": comparison.predicted}, figures,
                             f"servesim compare: {info.get('model')} on {info.get('device')}, {info.get('policy')}, "
                             f"{Path(str(info.get('trace'))).name}", differ)
    return figures


def options_that_differ(measured_summary: dict, predicted_summary: dict) -> dict[str, list]:
    """The options in which the two runs differ (as `sim report` of a folder of runs names them), each with
    the measured and the predicted run's value (the backend and its profile: both runs replay the same
    trace with the same scheduler and as many KV blocks)."""
    from reports.digest import flat_options
    from reports.html import differing_options

    options = [s.get("options", {}) for s in (measured_summary, predicted_summary)]
    flat = [flat_options(o) for o in options]
    return {name: [f.get(name) for f in flat] for name in differing_options(options)}


def cmd_compare(args: argparse.Namespace) -> int:
    from sim.app.cli import options_from_args, warn

    if args.profile is None:
        raise ServesimError("sim compare needs --profile (make one with `sim calibrate`)")
    if args.profile == "roofline":  # (found by a review: read as a file named roofline that does not exist)
        raise ServesimError("--profile roofline: sim compare checks a calibrated cost model against the real backend "
                            "on the same device; give the profile `sim calibrate` made for it")
    if args.backend is not None:  # (found by a review: --backend costmodel, the replay default, was taken silently)
        raise ServesimError(f"--backend {args.backend}: sim compare runs both backends itself (the real one with "
                            "--device and --weights, the cost model with --profile); leave --backend out")
    # Read as the real backend's run (its --device and --weights are its own); the profile is the prediction's.
    options = options_from_args(argparse.Namespace(**{**vars(args), "backend": "real", "profile": None}))
    # Neither run adds vLLM's host-time model: the real backend's steps hold its own CPU's preparation, and the
    # profile was fitted to such steps (found by a review: with --no-async-scheduling every predicted step
    # carried vLLM's host time on top, +18.9% median).
    options = replace(options, scheduler=replace(options.scheduler, host_time=False))
    with open_run_folder(args.out, "compare", overwrite=args.overwrite, discard_on_failure=True,
                         inputs=command_inputs(args)) as folder:
        warn(folder.took_over)
        lines = _compare(args, options, folder.folder)
    if not args.quiet:
        print("\n".join(lines))
        print(f"wrote {folder.final}/ (compare.json, steps.csv, report.html, measured/, predicted/)")
    return 0


def _compare(args: argparse.Namespace, options: ReplayOptions, out: Path) -> list[str]:
    """Run the comparison into `out`; returns what to print once the folder is in place."""
    from backends.real.timing import with_clock
    from sim.app.progress import Progress
    from traces.cli import load_trace

    measured = resolve(options)
    measured = replace(measured, backend=with_clock(measured.backend, args.clock))
    # Both runs plan with the KV blocks the real backend allocated.
    cache = replace(options.cache, num_blocks=measured.num_blocks)
    # The same scheduler as the measured run's, as resolved for the real backend's device (batch_defaults).
    predicted = resolve(replace(options, backend="costmodel", profile=args.profile, weights=None,
                                device=ReplayOptions.device, cache=cache,
                                scheduler=measured.options.scheduler, batch_defaults=()))
    profile = load_profile(args.profile, measured.model)  # (its name and shapes: a config folder named so too)
    trace = load_trace(args.trace, args, predicted.max_model_len)
    profile_clock = profile.grid.get("clock", "wall")
    if profile_clock != args.clock:
        print(f"sim: warning: {args.profile} was measured with --clock {profile_clock}, this run with "
              f"--clock {args.clock}", file=sys.stderr)
    progress = Progress.for_replay(len(trace), quiet=args.quiet)
    started = time.perf_counter()
    comparison = compare(trace, measured, predicted, progress=progress)
    progress.close()
    device = str(measured.backend.device)
    info = {"trace": trace.source, "policy": options.scheduler.policy, "model": options.model, "device": device,
            "profile": args.profile, "profile_device_name": profile.device_name,
            "profile_repeat_noise": profile.fit.get("repeat_noise"), "clock": args.clock, "num_requests": len(trace),
            "num_blocks": measured.num_blocks, "wall_s": time.perf_counter() - started}
    figures = write_comparison(out, comparison, trace, measured, predicted, info)
    return [f"{options.scheduler.policy} on {trace.source}: {len(trace)} requests, {options.model} on {device}, "
            f"profile {args.profile}", format_comparison(figures)]


def register(subparsers) -> None:
    from sim.app.cli import DEFAULT_TRACE_HELP, add_replay_options
    from sim.app.options import add_output_options

    p = subparsers.add_parser(
        "compare", help="replay with the real backend and the calibrated cost model; report their errors",
        description="Replay a trace with the real backend, predict every executed step from the same batch with "
                    "the calibrated cost model (--profile), replay the trace again with the cost model alone, and "
                    "report step-level and end-to-end errors. Writes compare.json, steps.csv, report.html and "
                    "the two runs' folders into --out.")
    p.add_argument("trace", help=f"trace file; {DEFAULT_TRACE_HELP}")
    add_replay_options(p)
    add_output_options(p, "comparison", required=True)
    p.add_argument("--clock", default="wall", choices=("wall", "thread"),
                   help="how the real backend's steps are timed: wall (its own timing, default) or thread (the "
                        "calling thread's CPU time, for a CPU shared with other processes; --device cpu only)")
    # (no --backend default here: sim compare runs both backends, so an explicit --backend of either is refused)
    p.set_defaults(func=cmd_compare, backend=None)
    for action in p._actions:
        if action.dest == "backend":
            action.help = "not for sim compare, which runs both backends itself (refused if given)"
