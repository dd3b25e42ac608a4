"""`sim sweep` and `sim capacity`: many replays of one trace, on local processes or Ray."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from reports.axes import axis_name
from sim.app.progress import Progress
from sim.errors import ServesimError

GRID_HELP = {
    "policy": "scheduling policies",
    "model": "model presets",
    "hardware": "hardware presets",
    "max_num_batched_tokens": "token budgets of one step",
    "max_num_seqs": "most requests running at once",
    "rate_scale": "rate scales: arrival times divided by each (2 doubles the request rate)",
    "seed": "seeds of the synthetic token ids",
}


def register(sub) -> None:
    from sim.app.cli import DEFAULT_TRACE_HELP, add_replay_options

    p = sub.add_parser(
        "sweep", conflict_handler="resolve", help="replay every point of a grid of options into one results table",
        description="Replay the trace at every point of the product of the listed options. Each finished point "
                    "is a row (options + summary metrics) of DIR/results.parquet; --resume continues an "
                    "interrupted sweep. Writes DIR/report.html at the end.")
    p.add_argument("trace", help=f"trace file; {DEFAULT_TRACE_HELP}")
    add_replay_options(p)
    _add_grid_options(p, with_rate_scale=True)
    _add_run_options(p, "sweep")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "capacity", conflict_handler="resolve",
        help="find the highest request rate meeting the SLOs, per policy and budget",
        description="Binary search over the rate scale for the highest request rate that meets the SLOs, for "
                    "every combination of the listed options. Default criterion (Sarathi-Serve): P99 time "
                    "between tokens within --slo tbt and median scheduling delay <= 2 s. Probes are kept in "
                    "DIR/probes.parquet; capacities in DIR/capacity.csv; a report in DIR/report.html.")
    p.add_argument("trace", help=f"trace file; {DEFAULT_TRACE_HELP}")
    add_replay_options(p)
    _add_grid_options(p, with_rate_scale=False)
    p.add_argument("--slo", default=None, metavar="tbt=S[,ttft=S,tpot=S,e2e=S,delay=S]",
                   help="limits in seconds: tbt (time between tokens), ttft, tpot, e2e at --quantile, and delay "
                        "(scheduling delay, default 2; delay=none drops it) at --delay-quantile")
    p.add_argument("--quantile", type=float, default=0.99, metavar="Q",
                   help="quantile of tbt, ttft, tpot and e2e held to the SLO (default: 0.99)")
    p.add_argument("--delay-quantile", type=float, default=0.5, metavar="Q",
                   help="quantile of the scheduling delay held to its limit (default: 0.5, the median)")
    p.add_argument("--min-rate-scale", type=float, default=1 / 64, metavar="X",
                   help="lowest rate scale tried (default: 1/64)")
    p.add_argument("--max-rate-scale", type=float, default=64.0, metavar="X",
                   help="highest rate scale tried (default: 64)")
    p.add_argument("--tolerance", type=float, default=0.02, metavar="F",
                   help="stop when the highest passing and lowest failing scale are within this fraction "
                        "(default: 0.02)")
    _add_run_options(p, "capacity")
    p.set_defaults(func=cmd_capacity)


def _add_grid_options(p: argparse.ArgumentParser, with_rate_scale: bool) -> None:
    """Re-declare the sweepable replay options as comma-separated lists (keeping their defaults)."""
    from reports.axes import AXES

    for name in AXES:
        if name == "rate_scale" and not with_rate_scale:
            continue
        flag = "--" + name.replace("_", "-")
        default = "1" if name == "rate_scale" else str(p.get_default(name))
        p.add_argument(flag, default=default, metavar="A,B,...",
                       help=f"{GRID_HELP[name]}, comma-separated (default: {default})")
    if not with_rate_scale:
        p.set_defaults(rate_scale=None)


def _add_run_options(p: argparse.ArgumentParser, what: str) -> None:
    from sim.app.sweep import EXECUTORS

    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"folder of the {what} (default: a new folder under runs/)")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out: keep its finished points, run the rest "
                        "(and the failed ones) again")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="points run at once (default: the number of CPUs); 1 runs them in this process")
    p.add_argument("--executor", default="process", choices=EXECUTORS,
                   help="where points run: local processes (default) or a Ray cluster (pip install "
                        "'servesim[ray]')")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="Ray cluster to join (e.g. ray://head:10001 or auto); default: start Ray on this machine")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")


# Building points from the command line.

def _load(args: argparse.Namespace, max_model_len: int | None):
    """The trace with every transform but the rate scale, which each point applies itself."""
    from traces.cli import load_trace

    plain = argparse.Namespace(**vars(args))
    plain.rate_scale = None
    return load_trace(args.trace, plain, max_model_len)


def _point_options(args: argparse.Namespace, values: dict):
    from sim.app.cli import options_from_args

    ns = argparse.Namespace(**vars(args))
    for name, value in values.items():
        setattr(ns, name, value)
    ns.rate_scale = None  # applied to the trace per point, not by the options
    return options_from_args(ns)


def _grid(args: argparse.Namespace, names) -> dict[str, tuple]:
    from sim.app.sweep import parse_axis

    axes = {name: parse_axis(name, getattr(args, name)) for name in names}
    num_points = 1
    for values in axes.values():
        num_points *= len(values)
    if num_points > 100_000:
        raise ServesimError(f"the grid has {num_points} points; that is more than 100000")
    return axes


def _check_executor(args: argparse.Namespace) -> None:
    if args.jobs is not None and args.jobs < 1:
        raise ServesimError(f"--jobs must be at least 1, got {args.jobs}")
    if args.address and args.executor != "ray":
        raise ServesimError("--address is the Ray cluster's; it needs --executor ray")


def _out_dir(args: argparse.Namespace, what: str) -> Path:
    from sim.app.cli import new_run_dir

    return Path(args.out) if args.out else new_run_dir(what)


def _on_row(bar):
    """A sweep's callback for each finished point: count failures, redraw."""
    def on_row(row: dict, done: int, total: int) -> None:
        if row["status"] != "ok":
            bar.fail()
        bar.total = total
        bar.update(done, force=True)
    return on_row


# sim sweep

def cmd_sweep(args: argparse.Namespace) -> int:
    from reports.axes import AXES
    from reports.html import write_report
    from sim.app.sweep import (
        RESULTS,
        ResultsTable,
        grid_order,
        identity,
        make_point,
        require_pyarrow,
        sweep,
        trace_checksum,
    )

    require_pyarrow()
    _check_executor(args)
    axes = _grid(args, AXES)
    points = [make_point(dict(zip(axes, values)), lambda v: _point_options(args, v))
              for values in itertools.product(*axes.values())]
    trace = _load(args, min(point.max_model_len for point in points))
    out = _out_dir(args, "sweep")
    table = ResultsTable(out / RESULTS, identity(trace_checksum(trace), axes, points[0].options), args.resume,
                         grid_order(points))
    num_done = sum(table.is_done(point.key) for point in points)
    bar = Progress(len(points), "points", sys.stderr.isatty() and not args.quiet, done=num_done, ticking=True)
    try:
        result = sweep(trace, points, table, args.executor, args.jobs, args.address, on_row=_on_row(bar))
    except KeyboardInterrupt:
        bar.close()
        print(f"sim: interrupted; {len(table.rows)} finished points are in {out / RESULTS}; "
              "continue with the same command and --resume", file=sys.stderr)
        raise
    bar.close()
    report = write_report(out)
    if not args.quiet:
        print(format_sweep(result.frame))
        print(f"{len(points)} points ({len(points) - result.num_run} already done), {result.num_failed} failed; "
              f"wrote {out / RESULTS} and {report}")
    return _report_failures(result.frame)


def _report_failures(frame) -> int:
    failed = frame[frame["status"] != "ok"] if len(frame) else frame
    if not len(failed):
        return 0
    first = failed.iloc[0]
    print(f"sim: {len(failed)} of {len(frame)} points failed (first: {first['point']}: {first['error']}); "
          "the error column has each message; --resume runs them again", file=sys.stderr)
    return 1


def format_sweep(frame) -> str:
    """Mean over seeds of the key metrics, one line per point of the other axes."""
    from reports.axes import AXES

    ok = frame[frame["status"] == "ok"] if len(frame) else frame
    if not len(ok):
        return "no point finished"
    keys = [a for a in AXES if a != "seed" and ok[a].astype(str).nunique() > 1] or ["policy"]
    columns = [("request_throughput", "req/s", 1), ("ttft_p50", "p50 TTFT", 1e3), ("ttft_p99", "p99 TTFT", 1e3),
               ("itl_p99", "p99 TBT", 1e3), ("scheduling_delay_p50", "p50 delay", 1e3), ("e2e_p99", "p99 E2E", 1e3)]
    means = ok.groupby(keys, sort=False)[[c for c, _, _ in columns]].mean().reset_index()
    head = "".join(f"{axis_name(k):>14}" for k in keys) + "".join(f"{n:>11}" for _, n, _ in columns)
    lines = [head + "   (latencies in ms)"]
    for _, row in means.iterrows():
        line = "".join(f"{row[k]!s:>14}" if not isinstance(row[k], float) else f"{row[k]:>14g}" for k in keys)
        line += "".join(_cell(row[c] * scale) for c, _, scale in columns)
        lines.append(line)
    return "\n".join(lines)


def _cell(value: float) -> str:
    if value != value:
        return f"{'-':>11}"
    return f"{value:>11.1f}" if abs(value) < 1e6 else f"{value:>11.3g}"


# sim capacity

def cmd_capacity(args: argparse.Namespace) -> int:
    import pandas as pd

    from reports.axes import AXES
    from reports.html import write_report
    from sim.app.capacity import CapacitySLO, RateSearch, search_all
    from sim.app.plan import resolve
    from sim.app.sweep import ResultsTable, identity, make_point, require_pyarrow, run_rows, trace_checksum

    require_pyarrow()
    _check_executor(args)
    slo = CapacitySLO.parse(args.slo, args.quantile, args.delay_quantile)
    RateSearch(args.min_rate_scale, args.max_rate_scale, args.tolerance)  # checks the bounds
    names = [name for name in AXES if name != "rate_scale"]
    axes = _grid(args, names)
    configs = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    replay_args = argparse.Namespace(**vars(args))
    replay_args.slo = None  # --slo here is the capacity criterion, not replay's goodput SLO
    options = [_point_options(replay_args, config) for config in configs]
    # A model that does not fit the hardware, or any other unusable option, fails here, before anything runs.
    max_model_len = min(resolve(o, build_backend=False).max_model_len for o in options)
    trace = _load(args, max_model_len)
    out = _out_dir(args, "capacity")
    config_index = {tuple(config[n] for n in names): i for i, config in enumerate(configs)}

    def order(row: dict) -> tuple:
        return (config_index.get(tuple(row.get(n) for n in names), len(configs)), row.get("rate_scale") or 0.0)

    table = ResultsTable(out / "probes.parquet", identity(trace_checksum(trace), axes, options[0]), args.resume, order)
    bar = Progress(0, "probes this round", sys.stderr.isatty() and not args.quiet, ticking=True)
    on_row = _on_row(bar)

    def make_probe(i: int, scale: float):
        return make_point(dict(configs[i], rate_scale=scale), lambda v: options[i])

    def run_probes(points) -> dict:
        todo = [point for point in points if not table.is_done(point.key)]
        bar.total, bar.initial = len(todo), 0
        bar.update(0, force=True)
        for done, row in enumerate(run_rows(trace, todo, args.executor, args.jobs, args.address), 1):
            table.add(row)
            on_row(row, done, len(todo))
        return {point.key: table.rows[point.key] for point in points}

    try:
        outcomes = search_all(list(range(len(configs))), make_probe, run_probes, slo.is_met,
                              lambda: RateSearch(args.min_rate_scale, args.max_rate_scale, args.tolerance))
    except KeyboardInterrupt:
        bar.close()
        print(f"sim: interrupted; the finished probes are in {out / 'probes.parquet'}; "
              "continue with the same command and --resume", file=sys.stderr)
        raise
    bar.close()
    rows = []
    for config, (search, probes) in zip(configs, outcomes):
        at = probes.get(search.passed) if search.passed is not None else None
        measured = slo.measure(at) if at is not None else {}
        rows.append({
            **config,
            "capacity_rate_scale": search.passed,
            "capacity_request_rate": at.get("request_rate") if at is not None else None,
            "request_throughput": at.get("request_throughput") if at is not None else None,
            **{f"{key}_at_capacity": value for key, value in measured.items()},
            "lowest_failing_rate_scale": search.failed,
            "num_probes": len(search.probes),
            "status": search.status,
            "error": search.error or "",
            "slo": slo.describe(),
            "point": at["point"] if at is not None else None,
        })
    capacity = pd.DataFrame(rows)
    capacity.to_csv(out / "capacity.csv", index=False)
    report = write_report(out)
    if not args.quiet:
        print(format_capacity(capacity, [n for n in names if len(axes[n]) > 1] or ["policy"], slo))
        print(f"wrote {out / 'capacity.csv'}, {out / 'probes.parquet'} and {report}")
    errors = capacity[capacity["status"] == "error"]
    if len(errors):
        print(f"sim: {len(errors)} searches stopped on a failing probe (first: {errors.iloc[0]['error']})",
              file=sys.stderr)
        return 1
    return 0


def format_capacity(capacity, keys: list[str], slo) -> str:
    measured = [f"{key}_at_capacity" for key in slo.limits()]
    head = ("".join(f"{axis_name(k):>14}" for k in keys) + f"{'rate x':>9}{'req/s':>9}"
            + "".join(f"{k.removesuffix('_at_capacity') + ' ms':>12}" for k in measured) + f"{'probes':>8}  status")
    lines = [f"capacity: {slo.describe()}", head]
    for _, row in capacity.iterrows():
        line = "".join(f"{row[k]!s:>14}" for k in keys)
        scale, rate = row["capacity_rate_scale"], row["capacity_request_rate"]
        line += f"{scale:>9.3g}" if scale == scale and scale is not None else f"{'-':>9}"
        line += f"{rate:>9.2f}" if rate == rate and rate is not None else f"{'-':>9}"
        for k in measured:
            value = row.get(k)
            line += f"{value * 1e3:>12.1f}" if value is not None and value == value else f"{'-':>12}"
        line += f"{row['num_probes']:>8}  {row['status']}"
        lines.append(line)
    return "\n".join(lines)
