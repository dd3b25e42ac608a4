"""`sim capacity`: the highest request rate meeting the SLOs, per configuration (the search is
sim/app/capacity.py; probes are sweep points, run as `sim sweep` runs them)."""

from __future__ import annotations

import argparse
import itertools
import sys

from reports.axes import axis_name, axis_widths
from sim.app.progress import Progress
from sim.app.sweep_cli import (
    _on_row,
    add_grid_options,
    add_run_options,
    check_executor,
    check_table_folder,
    interrupted_words,
    load_sweep_trace,
    open_folder,
    parse_grid,
    point_options,
    reads_chunked_options,
)
from sim.app.workers import Terminated
from sim.errors import ServesimError


def register(sub) -> None:
    from sim.app.cli import DEFAULT_TRACE_HELP, add_replay_options
    from sim.app.options import JoinedValues
    from sim.config import OPEN_FRACTION, RATE_SCALE

    p = sub.add_parser(
        "capacity", conflict_handler="resolve",
        help="find the highest request rate meeting the SLOs, per policy and budget",
        description="Binary search over the rate scale for the highest request rate that meets the SLOs, for "
                    "every combination of the listed options. Default criterion (Sarathi-Serve): P99 time "
                    "between tokens within --slo tbt and median scheduling delay <= 2 s. Probes are kept in "
                    "DIR/probes.parquet; capacities in DIR/capacity.csv; a report in DIR/report.html.")
    p.add_argument("trace", help=f"trace file; {DEFAULT_TRACE_HELP}")
    add_replay_options(p)
    add_grid_options(p, with_rate_scale=False)
    p.add_argument("--slo", default=None, metavar="tbt=S[,ttft=S,tpot=S,e2e=S,delay=S]", action=JoinedValues,
                   help="limits in seconds: tbt (time between tokens), ttft, tpot, e2e at --quantile, and delay "
                        "(scheduling delay, default 2; delay=none drops it) at --delay-quantile")
    p.add_argument("--quantile", type=OPEN_FRACTION.flag_type("--quantile"), default=0.99, metavar="Q",
                   help="quantile of tbt, ttft, tpot and e2e held to the SLO (default: 0.99)")
    p.add_argument("--delay-quantile", type=OPEN_FRACTION.flag_type("--delay-quantile"), default=0.5, metavar="Q",
                   help="quantile of the scheduling delay held to its limit (default: 0.5, the median)")
    p.add_argument("--min-rate-scale", type=RATE_SCALE.flag_type("--min-rate-scale"), default=1 / 64, metavar="X",
                   help="lowest rate scale tried (default: 1/64)")
    p.add_argument("--max-rate-scale", type=RATE_SCALE.flag_type("--max-rate-scale"), default=64.0, metavar="X",
                   help="highest rate scale tried (default: 64)")
    p.add_argument("--tolerance", type=OPEN_FRACTION.flag_type("--tolerance"), default=0.02, metavar="F",
                   help="stop when the highest passing and lowest failing scale are within this fraction "
                        "(default: 0.02)")
    add_run_options(p, "capacity")
    p.set_defaults(func=cmd_capacity)


def cmd_capacity(args: argparse.Namespace) -> int:
    import pandas as pd

    from reports.axes import AXES
    from sim.app.capacity import BURST_S, UNBOUNDED, CapacitySLO, RateSearch, burst_scale, search_all
    from sim.app.outputs import atomic_path
    from sim.app.plan import resolve
    from sim.app.report import write_report
    from sim.app.results_table import PROBES
    from sim.app.sweep import ResultsTable, identity, make_point, require_pyarrow, run_rows, trace_checksum

    require_pyarrow()
    check_executor(args)
    if args.rate_scale is not None:
        raise ServesimError("--rate-scale does not apply to sim capacity, which searches the rate scale "
                            "itself (between --min-rate-scale and --max-rate-scale)")
    for flag in ("--max-num-queued-reqs", "--max-num-queued-tokens"):
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            raise ServesimError(f"{flag} {value} does not apply to sim capacity: the requests it rejects (HTTP 503) "
                                "leave those admitted within the SLO at any rate, so no rate would fail; sim sweep "
                                "or sim replay show what it sheds at each rate")
    slo = CapacitySLO.parse(args.slo, args.quantile, args.delay_quantile)
    RateSearch(args.min_rate_scale, args.max_rate_scale, args.tolerance)  # checks the bounds
    names = [name for name in AXES if name != "rate_scale"]
    axes = parse_grid(args, names)
    configs = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    replay_args = argparse.Namespace(**vars(args))
    replay_args.slo = None  # --slo here is the capacity criterion, not replay's goodput SLO
    options = [point_options(replay_args, config, axes.get("policy", ())) for config in configs]
    # A model that does not fit the hardware, or any other unusable option, fails here, before anything runs.
    max_model_lens = [resolve(o, build_backend=False).max_model_len for o in options]
    with open_folder(args, "capacity") as folder:
        out = folder.folder
        trace = load_sweep_trace(args, max_model_lens)
        config_index = {tuple(config[n] for n in names): i for i, config in enumerate(configs)}

        def order(row: dict) -> tuple:
            return (config_index.get(tuple(row.get(n) for n in names), len(configs)), row.get("rate_scale") or 0.0)

        given = next((o for o in options if reads_chunked_options(o.scheduler.policy)), options[0])  # (as in sim sweep)
        table_identity = identity(trace_checksum(trace), axes, given)
        check_table_folder(out, PROBES, table_identity, trace, args.overwrite)
        table = ResultsTable(out / PROBES, table_identity, args.resume, order, overwrite=args.overwrite)
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
                                  lambda: RateSearch(args.min_rate_scale, args.max_rate_scale, args.tolerance,
                                                     burst_scale=burst_scale(trace.duration_s)))
        except (KeyboardInterrupt, Terminated):
            bar.close()
            print(interrupted_words(folder, f"the finished probes are in {out / PROBES}" if table.rows else None),
                  file=sys.stderr)
            raise
        bar.close()
        capacity = pd.DataFrame([_capacity_row(config, search, probes, slo)
                                 for config, (search, probes) in zip(configs, outcomes)])
        with atomic_path(out / "capacity.csv") as temp:
            capacity.to_csv(temp, index=False)
        report = write_report(out, check_owner=bool(args.resume))  # a resumed folder: its page must be ours
    if not args.quiet:
        print(format_capacity(capacity, [n for n in names if len(axes[n]) > 1] or ["policy"], slo))
        final = folder.final
        print(f"wrote {final / 'capacity.csv'}, {final / PROBES} and {final / report.name}")
    unbounded = capacity[capacity["status"] == UNBOUNDED]
    if len(unbounded):
        print(f"sim: warning: {len(unbounded)} of {len(capacity)} searches stopped at rate scale "
              f"{unbounded['capacity_rate_scale'].min():g}, where the whole trace ({trace.source}, {len(trace)} "
              f"requests) arrives within {BURST_S:g} s and still meets the SLO: this trace is too short to build a "
              "queue, so no capacity can be found within --max-rate-scale; use a longer trace (or --target-rate "
              "on a longer one)", file=sys.stderr)
    behind = capacity[capacity["served_share"] < SERVED_SHARE]  # (NaN where no capacity was found: not counted)
    if len(behind):
        worst = behind.loc[behind["served_share"].idxmin()]
        print(f"sim: warning: at {len(behind)} of {len(capacity)} capacities the server kept up with "
              f"{worst['served_share']:.0%} of the arrivals at worst (served_share in capacity.csv): a queue was "
              f"building when the trace ({trace.source}, {len(trace)} requests) ended, so the SLO was met only because "
              "it ended; a longer trace (--limit, --time-window) would miss it there: the capacity is an overestimate",
              file=sys.stderr)
    if not args.quiet:  # a grid's budget and --max-num-seqs are its own, not a replay's defaults
        print("sim replay of a capacity: give --rate-scale and its row's --max-num-batched-tokens and --max-num-seqs "
              "(a grid's defaults, 2048 and 256, not vLLM's for the GPU that a replay takes)")
    errors = capacity[capacity["status"] == "error"]
    if len(errors):
        print(f"sim: {len(errors)} searches stopped on a failing probe (first: {errors.iloc[0]['error']})",
              file=sys.stderr)
        return 1
    return 0


SERVED_SHARE = 0.9  # served over offered requests per second below which a probe's queue was still growing


def served_share(row: dict) -> float | None:
    """How much of a probe's arrival rate the server kept up with: its finished requests over the time
    it took to serve them less the mean request's own span (the drain a finite trace ends with, which
    no queue makes), over the arrival rate. On the Azure sample's first 300 requests it is 0.95 at 4x
    the rate and 0.89 at 6x; replayed whole, 4x holds a p99 TTFT of 0.44 s and 6x of 11.5 s."""
    busy = row.get("duration_s", 0.0) - (row.get("e2e_mean") or 0.0)
    if not (busy > 0 and row.get("request_rate") and row.get("completed")):
        return None
    return row["completed"] / busy / row["request_rate"]


def _capacity_row(config: dict, search, probes: dict, slo) -> dict:
    at = probes.get(search.passed) if search.passed is not None else None
    measured = slo.measure(at) if at is not None else {}
    return {
        **config,
        "capacity_rate_scale": search.passed,
        "capacity_request_rate": at.get("request_rate") if at is not None else None,
        "request_throughput": at.get("request_throughput") if at is not None else None,
        "served_share": served_share(at) if at is not None else None,
        **{f"{key}_at_capacity": value for key, value in measured.items()},
        "lowest_failing_rate_scale": search.failed,
        "num_probes": len(search.probes),
        "status": search.status,
        "error": search.error or "",
        "slo": slo.describe(),
        "point": at["point"] if at is not None else None,
    }


def format_capacity(capacity, keys: list[str], slo) -> str:
    from reports.metrics import latency_unit

    measured = [f"{key}_at_capacity" for key in slo.limits()]
    # Latencies in capacity.csv are in seconds; shown in `unit`, each multiplied by `per_second`.
    unit, per_second = latency_unit([v for k in measured if k in capacity for v in capacity[k].tolist()])
    widths = axis_widths(keys)
    head = ("".join(f"{axis_name(k):>{w}}" for k, w in zip(keys, widths)) + f"{'rate x':>9}{'offered/s':>11}"
            + "".join(f"{k.removesuffix('_at_capacity') + ' ' + unit:>12}" for k in measured) + f"{'probes':>8}  status")
    lines = [f"capacity: {slo.describe()}", head]
    for _, row in capacity.iterrows():
        line = "".join(f"{row[k]!s:>{w}}" for k, w in zip(keys, widths))
        rate_scale, rate = row["capacity_rate_scale"], row["capacity_request_rate"]
        line += f"{rate_scale:>9.3g}" if rate_scale is not None and rate_scale == rate_scale else f"{'-':>9}"
        # (the arrival rate offered at capacity, not the throughput achieved: capacity.csv has both)
        if rate is None or rate != rate:
            line += f"{'-':>11}"
        else:
            line += f"{rate:>11.2f}" if abs(rate) < 1e5 else f"{rate:>11.3g}"
        for k in measured:
            value = row.get(k)
            line += f"{value * per_second:>12.4g}" if value is not None and value == value else f"{'-':>12}"
        line += f"{row['num_probes']:>8}  {row['status']}"
        lines.append(line)
    return "\n".join(lines)
