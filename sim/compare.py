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
import html
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from backends import StepResult
from backends.profile import ape_stats, load_profile
from sim.batch import Batch
from sim.engine import SimResult
from sim.errors import ServesimError
from sim.replay import ReplayOptions, make_backend, replay, write_run
from traces.trace import Trace

STEP_KINDS = ("prefill", "decode", "mixed")
METRICS = tuple(f"{m}_{p}" for m in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p90", "p99")) + (
    "request_throughput", "output_throughput", "total_token_throughput", "duration_s")
# The targets: step-level median <= 5% and p90 <= 15%; p50 and p99 TTFT and TPOT within 10%.
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
        self.name = measured.name
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


def compare(trace: Trace, measured_options: ReplayOptions, predicted_options: ReplayOptions,
            measured_backend=None, progress=None) -> Comparison:
    """Replay with the measured backend (made from `measured_options` unless given), predicting each
    step; then replay with the cost model of `predicted_options`."""
    if predicted_options.backend != "costmodel":
        raise ServesimError("the predicted run needs the cost-model backend")
    if measured_options.cache.num_blocks != predicted_options.cache.num_blocks:
        raise ServesimError("the measured and predicted runs must have the same number of KV blocks")
    recorder = PredictingBackend(measured_backend or make_backend(measured_options), make_backend(predicted_options))
    measured = replay(trace, measured_options, backend=recorder, progress=progress)
    steps = join_steps(measured, recorder)
    predicted = replay(trace, predicted_options)
    return Comparison(measured, predicted, steps)


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
    return {"errors": errors, "step_error": step_error,
            "step_total_seconds": {"measured": total_measured, "predicted": total_predicted},
            "metrics": metrics, "targets": {"limits": TARGETS, "met": targets}}


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
              f"  {'metric':<24}{'measured':>12}{'predicted':>12}{'rel. error':>12}"]
    for name, m in figures["metrics"].items():
        lines.append(f"  {name:<24}{value(name, m['measured']):>12}{value(name, m['predicted']):>12}"
                     f"{pct(m['relative_error'], signed=True):>12}")
    met = figures["targets"]["met"]
    lines.append(f"targets met: {sum(met.values())}/{len(met)}"
                 + "".join(f"\n  missed {k} (limit {TARGETS[k]:.0%})" for k, ok in met.items() if not ok))
    return "\n".join(lines)


def _cdf(values: np.ndarray, num_points: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    values = np.sort(np.asarray(values, dtype=np.float64)[~np.isnan(values)])
    if len(values) == 0:
        return values, values
    fraction = np.linspace(0, 1, min(num_points, len(values)))
    return np.quantile(values, fraction), fraction


def write_report(path: Path, comparison: Comparison, figures: dict, title: str) -> None:
    """A self-contained HTML page (plotly.js inline): the error table, a predicted-vs-measured scatter
    of the step times and overlaid CDFs of the request metrics."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from reports.metrics import inter_token_latencies, requests_table

    steps = comparison.steps
    scatter = go.Figure()
    for kind in STEP_KINDS:
        rows = steps[steps["kind"] == kind]
        scatter.add_trace(go.Scattergl(x=rows["measured_s"] * 1e3, y=rows["predicted_s"] * 1e3, mode="markers",
                                       name=f"{kind} ({len(rows)})", marker={"size": 4, "opacity": 0.6}))
    if len(steps):
        lo = float(min(steps["measured_s"].min(), steps["predicted_s"].min())) * 1e3
        hi = float(max(steps["measured_s"].max(), steps["predicted_s"].max())) * 1e3
        scatter.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="predicted = measured",
                                     line={"dash": "dash", "color": "gray"}))
    scatter.update_layout(title="Step time: predicted vs measured (same batches)", height=560,
                          xaxis={"title": "measured (ms)", "type": "log"},
                          yaxis={"title": "predicted (ms)", "type": "log"})

    runs = {"measured": comparison.measured, "predicted": comparison.predicted}
    tables = {name: requests_table(result) for name, result in runs.items()}
    cdfs = make_subplots(rows=2, cols=2, subplot_titles=("TTFT", "TPOT", "ITL", "E2E latency"))
    colors = {"measured": "#1f77b4", "predicted": "#d62728"}
    for i, metric in enumerate(("ttft", "tpot", "itl", "e2e")):
        for name, result in runs.items():
            frame = tables[name][tables[name]["status"] == "finished"]
            values = inter_token_latencies(result) if metric == "itl" else frame[f"{metric}_s"].to_numpy()
            x, y = _cdf(values * 1e3)
            cdfs.add_trace(go.Scatter(x=x, y=y, mode="lines", name=name, legendgroup=name, showlegend=i == 0,
                                      line={"color": colors[name]}), row=i // 2 + 1, col=i % 2 + 1)
        cdfs.update_xaxes(title_text="ms", row=i // 2 + 1, col=i % 2 + 1)
    cdfs.update_layout(title="Request metrics: measured run vs independent cost-model run (CDF)", height=720)

    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{'-' if v is None else f'{100 * v:+.2f}%'}</td></tr>"
                   for k, v in figures["errors"].items())
    body = (f"<h1>{html.escape(title)}</h1>"
            + scatter.to_html(full_html=False, include_plotlyjs=True)
            + cdfs.to_html(full_html=False, include_plotlyjs=False)
            + f"<h2>Error figures</h2><table>{rows}</table>")
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                    "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 12px}</style></head>"
                    f"<body>{body}</body></html>\n")


def write_comparison(out: Path, comparison: Comparison, trace: Trace, measured_options: ReplayOptions,
                     predicted_options: ReplayOptions, info: dict) -> dict:
    """measured/ and predicted/ run folders, steps.csv, compare.json and report.html; returns the figures."""
    from sim.replay import _jsonable

    out.mkdir(parents=True, exist_ok=True)
    measured_summary = write_run(out / "measured", comparison.measured, measured_options, trace)
    predicted_summary = write_run(out / "predicted", comparison.predicted, predicted_options, trace)
    comparison.steps.to_csv(out / "steps.csv", index=False)
    figures = error_figures(comparison.steps, measured_summary, predicted_summary)
    (out / "compare.json").write_text(json.dumps(_jsonable({**info, **figures}), indent=2) + "\n")
    write_report(out / "report.html", comparison, figures,
                 f"servesim compare: {info.get('model')} on {info.get('device')}, {info.get('policy')}, "
                 f"{Path(str(info.get('trace'))).name}")
    return figures


def cmd_compare(args: argparse.Namespace) -> int:
    from sim.calibrate import with_clock
    from sim.cli import Progress, options_from_args
    from traces import read_trace
    from traces.cli import apply_trace_options

    if args.profile is None:
        raise ServesimError("sim compare needs --profile (make one with `sim calibrate`)")
    options = options_from_args(args)
    profile = load_profile(args.profile, options.model)
    trace = read_trace(args.trace, args.format, model_filter=args.model_filter)
    trace = apply_trace_options(trace, args, options.max_model_len)
    for warning in trace.warnings:
        print(f"sim: warning: {warning}", file=sys.stderr)
    measured_options = replace(options, backend="real", profile=None)
    measured_backend = with_clock(make_backend(measured_options), args.clock)
    profile_clock = profile.grid.get("clock", "wall")
    if profile_clock != args.clock:
        print(f"sim: warning: {args.profile} was measured with --clock {profile_clock}, this run with "
              f"--clock {args.clock}", file=sys.stderr)
    # Both runs plan with the KV blocks the real backend allocated.
    cache = replace(options.cache, num_blocks=int(measured_backend.num_blocks))
    measured_options = replace(measured_options, cache=cache)
    predicted_options = replace(options, backend="costmodel", weights=None, cache=cache)
    progress = Progress(enabled=sys.stderr.isatty() and not args.quiet)
    started = time.perf_counter()
    comparison = compare(trace, measured_options, predicted_options, measured_backend, progress)
    progress.done()
    out = Path(args.out)
    device = str(getattr(measured_backend, "device", "cpu"))
    info = {"trace": trace.source, "policy": options.scheduler.policy, "model": options.model, "device": device,
            "profile": args.profile, "profile_device_name": profile.device_name,
            "profile_repeat_noise": profile.fit.get("repeat_noise"), "clock": args.clock, "num_requests": len(trace),
            "num_blocks": cache.num_blocks, "wall_s": time.perf_counter() - started}
    figures = write_comparison(out, comparison, trace, measured_options, predicted_options, info)
    if not args.quiet:
        print(f"{options.scheduler.policy} on {trace.source}: {len(trace)} requests, {options.model} on {device}, "
              f"profile {args.profile}")
        print(format_comparison(figures))
        print(f"wrote {out}/ (compare.json, steps.csv, report.html, measured/, predicted/)")
    return 0


def register(subparsers) -> None:
    from sim.cli import DEFAULT_TRACE_HELP, add_replay_options

    p = subparsers.add_parser(
        "compare", help="replay with the real backend and the calibrated cost model; report their errors",
        description="Replay a trace with the real backend, predict every executed step from the same batch with "
                    "the calibrated cost model (--profile), replay the trace again with the cost model alone, and "
                    "report step-level and end-to-end errors. Writes compare.json, steps.csv, report.html and "
                    "the two runs' folders into --out.")
    p.add_argument("trace", help=f"trace file; {DEFAULT_TRACE_HELP}")
    add_replay_options(p)
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--clock", default="wall", choices=("wall", "thread"),
                   help="how the real backend's steps are timed: wall (its own timing, default) or thread (the "
                        "calling thread's CPU time, for a CPU shared with other processes; --device cpu only)")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    p.set_defaults(func=cmd_compare)
