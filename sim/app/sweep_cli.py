"""`sim sweep`: many replays of one trace, on local processes or Ray; and the options, folder and
point building it shares with `sim capacity` (sim/app/capacity_cli.py)."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from reports.axes import axis_name
from sim.app.progress import Progress
from sim.app.workers import Terminated
from sim.errors import ServesimError

GRID_HELP = {
    "policy": "scheduling policies",
    "model": "model presets",
    "hardware": "hardware presets",
    "max_num_batched_tokens": "token budgets of one step",
    "max_num_seqs": "most requests running at once",
    "max_num_active_seqs": "most requests admitted into the running batch (0: unset, --max-num-seqs)",
    "long_prefill_token_threshold": "caps of a prefill's chunk per step (0: none)",
    "scheduling_policy": "waiting-queue orders (fcfs, priority)",
    "prefill_schedule_interval": "prefill cadences: steps between steps that carry prefill (1: every step)",
    "watermark": "watermarks: shares of the KV cache kept free at admission while any request runs",
    "cache_aware_admission_window": "cache-aware admission windows (0: off; chunked, fcfs, prefix caching)",
    "stream_interval": "vLLM's API server's stream intervals: tokens gathered per send to a streaming client (1: every "
                       "token); only what the client sees changes",
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
    add_grid_options(p, with_rate_scale=True)
    add_run_options(p, "sweep")
    p.set_defaults(func=cmd_sweep)


class GridDefault(str):
    """An axis the command line left at the grid's default (a refusal can then say the value was not given)."""


def add_grid_options(p: argparse.ArgumentParser, with_rate_scale: bool) -> None:
    """Re-declare the sweepable replay options as comma-separated lists (keeping their defaults). A grid
    states every point's values: the budget and --max-num-seqs default to SchedulerConfig's (2048, 256)
    on every GPU, not to vLLM's for the GPU as a single replay's do (sim.app.options, vllm_batch_defaults)."""
    from reports.axes import AXES
    from sim.app.options import SCHEDULER_DEFAULTS

    for name in AXES:
        if name == "rate_scale" and not with_rate_scale:
            continue
        flag = "--" + name.replace("_", "-")
        given = p.get_default(name)  # None: a flag whose default is vLLM's for the GPU
        default = "1" if name == "rate_scale" else str(SCHEDULER_DEFAULTS[name] if given is None else given)
        p.add_argument(flag, default=GridDefault(default), metavar="A,B,...",
                       help=f"{GRID_HELP[name]}, comma-separated (default: {default})")
    if not with_rate_scale:
        p.set_defaults(rate_scale=None)


def add_run_options(p: argparse.ArgumentParser, what: str) -> None:
    from sim.app.options import add_output_options
    from sim.app.sweep import EXECUTORS
    from sim.config import JOBS

    add_output_options(p, what, resume=True, quiet_help="no progress bar and no table")
    p.add_argument("--jobs", type=JOBS.flag_type("--jobs"), default=None, metavar="N",
                   help="points run at once (default: the number of CPUs); 1 runs them in this process")
    p.add_argument("--executor", default="process", choices=EXECUTORS,
                   help="where points run: local processes (default) or a Ray cluster (pip install "
                        "'servesim[ray]')")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="Ray cluster to join (e.g. ray://head:10001 or auto); default: start Ray on this machine")


# Building points from the command line.

def load_sweep_trace(args: argparse.Namespace, max_model_lens: list[int]):
    """The trace with every transform but the rate scale, which each point applies itself; and with
    --on-too-long truncate over points of different --max-model-len (a grid of models), but the
    truncation too: each point cuts the requests to its own (sim.app.sweep.run_point), and the terminal
    says how many each limit cuts. (Found by a review with odd grids: every point's requests were cut
    to the smallest model's limit, so a Llama-3.1-8B row said max_model_len 131072 beside prompts cut
    to 40960, and a capacity search passed it on prompts it never ran.)"""
    from dataclasses import replace

    from traces.cli import load_trace

    plain = argparse.Namespace(**vars(args))
    plain.rate_scale = None
    lens = sorted(set(max_model_lens))
    if getattr(args, "on_too_long", "reject") != "truncate" or len(lens) < 2:
        return load_trace(args.trace, plain, lens[0] if lens else None)
    plain.on_too_long = "reject"
    trace = load_trace(args.trace, plain, None)
    cuts = [f"{_cut_count(trace, n)} at {n}" for n in lens]
    print(f"sim: warning: --on-too-long truncate: each point cuts the requests longer than its own --max-model-len "
          f"({', '.join(cuts)})", file=sys.stderr)
    return replace(trace, transforms={**trace.transforms, "on_too_long": "truncate"})


def _cut_count(trace, max_model_len: int) -> int:
    """Requests `truncate_too_long` cuts at `max_model_len` (its rule: the output to at most
    max_model_len - 1 tokens, then the prompt to what is left)."""
    output = trace.output_tokens.clip(max=max_model_len - 1)
    return int(((trace.output_tokens != output) | (trace.prompt_tokens > max_model_len - output)).sum())


def point_options(args: argparse.Namespace, values: dict, policies: tuple = ()):
    """The options of one point. `policies`: the grid's --policy values; where it holds more than one,
    a chunked-only scheduler option (sim.app.plan.CHUNKED_ONLY: the long-prefill cap, the prefill
    cadence, the cache-aware window) applies to the chunked points and the others run without it, as
    their resolved options (summary.json, the table's columns) say; a replay of one policy that
    cannot read such an option still refuses it."""
    from sim.app.cli import options_from_args
    from sim.app.plan import CHUNKED_ONLY
    from sim.config import ActiveSeqsAboveSeqs

    ns = argparse.Namespace(**vars(args))
    for name, value in values.items():
        setattr(ns, name, value)
    ns.rate_scale = None  # applied to the trace per point, not by the options
    if len(policies) > 1 and not reads_chunked_options(ns.policy):
        for name, off, _ in CHUNKED_ONLY:
            setattr(ns, name, off)
    try:
        return options_from_args(ns)
    except ActiveSeqsAboveSeqs as e:
        if not isinstance(getattr(args, "max_num_seqs", None), GridDefault):
            raise
        raise ServesimError(f"{e} (--max-num-seqs {args.max_num_seqs} is the grid's default, not vLLM's for the "
                            "GPU: give --max-num-seqs)") from None


def reads_chunked_options(policy: str) -> bool:
    """Whether the policy named `policy` is chunked (or a subclass of it: a user's policy built on it)."""
    from policies import load_policy
    from policies.chunked import ChunkedPolicy

    return issubclass(load_policy(policy), ChunkedPolicy)


def parse_grid(args: argparse.Namespace, names) -> dict[str, tuple]:
    from sim.app.sweep import parse_axis

    axes = {name: parse_axis(name, getattr(args, name)) for name in names}
    num_points = 1
    for values in axes.values():
        num_points *= len(values)
    if num_points > 100_000:
        raise ServesimError(f"the grid has {num_points} points; that is more than 100000")
    return axes


def check_executor(args: argparse.Namespace) -> None:
    if args.jobs is not None and args.jobs < 1:
        raise ServesimError(f"--jobs must be at least 1, got {args.jobs}")
    if args.address and args.executor != "ray":
        raise ServesimError("--address is the Ray cluster's; it needs --executor ray")
    if args.address:
        check_reachable(args.address)
    if args.resume and args.overwrite:
        raise ServesimError("give --resume or --overwrite, not both")


RAY_CONNECT_TIMEOUT_S = 10.0


def check_reachable(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Refuse, within `timeout_s`, a Ray address nothing answers at: ray.init retries an unreachable
    head for minutes, blind to SIGTERM while it waits in its own code. `auto` (a cluster on this
    machine) is left to Ray, which fails at once when there is none."""
    import socket

    if address in ("auto", "local"):
        return
    text = address.removeprefix("ray://")
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ServesimError(f"--address {address!r}: expected HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ServesimError(f"--address {address}: no Ray cluster answers there ({reason}, {timeout_s:g} s "
                            "limit); start it (`ray start --head`) or check the host and port") from None


def open_folder(args: argparse.Namespace, what: str):
    """The locked run folder (sim.app.outputs.open_run_folder), claimed before any work."""
    from sim.app.cli import run_stamp, warn
    from sim.app.outputs import command_inputs, open_run_folder

    if args.resume and args.out is None:
        raise ServesimError("--resume continues the run in --out; name it")
    folder = open_run_folder(args.out, f"{run_stamp()}-{what}", overwrite=args.overwrite, resume=args.resume,
                             hint="pass --resume to continue it, --overwrite to start again, or choose another --out",
                             inputs=command_inputs(args))
    if args.resume:
        try:
            check_resumable(folder.folder, what)
        except BaseException:
            folder.release()
            raise
    warn(folder.took_over)
    return folder


def check_resumable(folder, what: str) -> None:
    """--resume continues a sweep (or capacity search) in its own folder: one that holds its table
    (or the other kind's, of the same trace, which a sweep and a capacity search share: results_table.py
    check_folder), or nothing yet (one stopped before its first row). Another command's run is refused,
    never written into."""
    from reports.tables import RESULTS
    from sim.app.outputs import LOCK_NAME, MANIFEST_NAME, OS_FILES
    from sim.app.results_table import PROBES

    table = RESULTS if what == "sweep" else PROBES
    what = "sweep" if what == "sweep" else "capacity search"
    held = sorted(p.name for p in folder.iterdir() if p.name not in (LOCK_NAME, MANIFEST_NAME) and p.name not in OS_FILES
                  and not p.name.startswith("."))
    if held and not {RESULTS, PROBES} & set(held):
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ServesimError(f"{folder}: holds no {what} to resume (no {table}) but {shown}: --resume continues a "
                            f"{what} in its own folder; choose another --out")


def interrupted_words(folder, kept: str | None) -> str:
    """What an interrupted sweep or capacity search leaves: its rows to --resume (`kept`; None: nothing had
    finished, and the folder it made is gone), or, when it was replacing a run (--overwrite), the old run,
    whole, in its place. (`sim` then says how it was stopped: interrupted, or terminated.)"""
    if folder.staged:
        return f"sim: {folder.final} still holds the run it had (this --overwrite run is discarded)"
    if kept is None:
        return "sim: nothing had finished, so nothing was kept"
    return f"sim: {kept}; continue with the same command and --resume"


def check_table_folder(out: Path, name: str, identity: dict, trace, overwrite: bool) -> None:
    from sim.app.cli import warn
    from sim.app.results_table import check_folder

    for message in check_folder(out, name, identity, trace.source, overwrite):
        warn(message)


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
    from sim.app.report import write_report
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
    check_executor(args)
    axes = parse_grid(args, AXES)
    points = [make_point(dict(zip(axes, values)), lambda v: point_options(args, v, axes["policy"]))
              for values in itertools.product(*axes.values())]
    with open_folder(args, "sweep") as folder:
        out = folder.folder
        trace = load_sweep_trace(args, [point.max_model_len for point in points])
        # (The fixed options as given: a chunked point's, where a grid of policies left others without chunked's.)
        given = next((p.options for p in points if reads_chunked_options(p.options.scheduler.policy)), points[0].options)
        table_identity = identity(trace_checksum(trace), axes, given)
        check_table_folder(out, RESULTS, table_identity, trace, args.overwrite)
        table = ResultsTable(out / RESULTS, table_identity, args.resume, grid_order(points), overwrite=args.overwrite)
        num_done = sum(table.is_done(point.key) for point in points)
        bar = Progress(len(points), "points", sys.stderr.isatty() and not args.quiet, done=num_done, ticking=True)
        try:
            result = sweep(trace, points, table, args.executor, args.jobs, args.address, on_row=_on_row(bar))
        except (KeyboardInterrupt, Terminated):
            bar.close()
            done = len(table.rows)
            print(interrupted_words(folder, f"{done} finished point{'s' * (done != 1)} {'are' if done != 1 else 'is'} "
                                    f"in {out / RESULTS}" if done else None),
                  file=sys.stderr)
            raise
        bar.close()
        report = write_report(out, check_owner=bool(args.resume))  # a resumed folder: its page must be ours
    if not args.quiet:
        print(format_sweep(result.frame))
        print(f"{len(points)} points ({len(points) - result.num_run} already done), {result.num_failed} failed; "
              f"wrote {folder.final / RESULTS} and {folder.final / report.name}")
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
    from reports.axes import AXES, axis_widths
    from reports.metrics import latency_digits, latency_unit

    ok = frame[frame["status"] == "ok"] if len(frame) else frame
    if not len(ok):
        return "no point finished"
    keys = [a for a in AXES if a != "seed" and ok[a].astype(str).nunique() > 1] or ["policy"]
    latencies = ("ttft_p50", "ttft_p99", "itl_p99", "scheduling_delay_p50", "e2e_p99")
    # The requests a point rejected (HTTP 503 under the admission limits, too long) are in none of its figures:
    # a column where any point rejected some, so one that shed its load is not read as one that served it.
    rejected = ["rejected"] if "rejected" in ok and (ok["rejected"].fillna(0) > 0).any() else []
    means = ok.groupby(keys, sort=False)[["request_throughput", *rejected, *latencies]].mean().reset_index()
    unit, scale = latency_unit(means[list(latencies)].to_numpy().ravel().tolist())
    digits = latency_digits(unit)
    # (column, label, scale, decimals; the rejected, a mean of counts over seeds, whole where it is one)
    columns = [("request_throughput", "req/s", 1, 1), *(("rejected", "rejected", 1, None) for _ in rejected),
               ("ttft_p50", "p50 TTFT", scale, digits), ("ttft_p99", "p99 TTFT", scale, digits),
               ("itl_p99", "p99 TBT", scale, digits), ("scheduling_delay_p50", "p50 delay", scale, digits),
               ("e2e_p99", "p99 E2E", scale, digits)]
    widths = axis_widths(keys)
    head = "".join(f"{axis_name(k):>{w}}" for k, w in zip(keys, widths)) + "".join(f"{n:>11}" for _, n, _, _ in columns)
    lines = [head + f"   (latencies in {unit})"]
    for _, row in means.iterrows():
        line = "".join(f"{row[k]!s:>{w}}" if not isinstance(row[k], float) else f"{row[k]:>{w}g}"
                       for k, w in zip(keys, widths))
        line += "".join(_cell(row[c] * s, (0 if float(row[c]).is_integer() else 1) if d is None else d)
                        for c, _, s, d in columns)
        lines.append(line)
    return "\n".join(lines)


def _cell(value: float, digits: int = 1) -> str:
    if value != value:
        return f"{'-':>11}"
    return f"{value:>11.{digits}f}" if abs(value) < 1e6 else f"{value:>11.3g}"
