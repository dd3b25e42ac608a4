"""Sweeps: every point of a grid of replay options is one replay, and one row of a results table.

    grid (policy x model x hardware x max_num_batched_tokens x max_num_seqs x rate_scale x seed)
      -> points, each a ReplayOptions and a rate scale
      -> rows (options, summary metrics, latency quantile sketches, a binned step timeline)
      -> DIR/results.parquet, rewritten atomically after every finished point

The table (sim/app/results_table.py) carries the sweep's identity (trace checksum, grid, fixed
options) in its Parquet metadata, so `--resume` refuses a table from other options and runs only
the points it lacks (or that failed). Points run on local processes or on Ray; rows are sorted by grid order, so
the table is the same whatever the executor.

pyarrow is imported only here; Ray only in `_ray_rows`.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from concurrent.futures import as_completed
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import pandas as pd

from reports.axes import AXES, axis_text
from reports.tables import RESULTS, read_table  # noqa: F401 (RESULTS, read_table: for callers)
from sim.app import workers
from sim.app.options import ReplayOptions, range_of
from sim.app.plan import resolve
from sim.app.replay import replay
from sim.app.results_table import ResultsTable  # noqa: F401 (for callers)
from sim.app.results_table import identity as table_identity
from sim.errors import ServesimError
from traces.trace import Trace

EXECUTORS = ("process", "ray")



def parse_axis(name: str, text: str) -> tuple:
    """'256,512,1024' -> (256, 512, 1024), with one-line errors naming the flag."""
    flag = "--" + name.replace("_", "-")
    kind = AXES[name]
    parts = [part.strip() for part in str(text).split(",")]
    if all(part == "" for part in parts):
        raise ServesimError(f"{flag}: no values, so the grid is empty; give a comma-separated list")
    if any(part == "" for part in parts):
        raise ServesimError(f"{flag}: empty item in {text!r}; give a comma-separated list without blanks")
    values: list = []
    for part in parts:
        try:
            value = kind(part)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ServesimError(f"{flag}: {part!r} is not {what}") from None
        bounds = range_of(name)  # the flag's physical range (sim.config)
        zero_ok = bounds is not None and bounds.contains(0.0)  # a share, such as --watermark
        if kind is float and not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
            raise ServesimError(f"{flag}: {part!r} must be a {'non-negative' if zero_ok else 'positive'} finite number")
        if kind is int and value < 0:
            raise ServesimError(f"{flag}: {part!r} must not be negative")
        if bounds is not None:
            bounds.check(flag, value)
        if value in values or (isinstance(value, str) and plugin_file_key(value) in map(plugin_file_key, values)):
            raise ServesimError(f"{flag}: {part!r} is listed twice" + (
                "" if value in values else " (the same file and class spelled another way)"))
        values.append(value)
    return tuple(values)


def plugin_file_key(spec) -> object:
    """A policy or router named as `FILE.py:Class`, by its file's real path and class: `a/p.py:P` and
    `a/../a/p.py:P` are one plugin. Any other value, as it is."""
    from sim.plugins import plugin_file

    path = plugin_file(spec) if isinstance(spec, str) and spec.rpartition(":")[0].endswith(".py") else None
    if path is None:
        return spec
    try:
        return (str(path.resolve()), spec.rpartition(":")[2])
    except OSError:
        return spec


@dataclass(frozen=True)
class Point:
    """One replay of a sweep: its key in the table, its options and its rate scale."""

    key: str
    options: ReplayOptions
    rate_scale: float
    values: tuple  # the axis values, in AXES order
    resolved: dict  # the options as the run uses them (RunPlan.as_dict)
    max_model_len: int


def point_key(values: dict) -> str:
    return ",".join(axis_text(name, values[name]) for name in AXES)


def make_point(values: dict, make_options: Callable[[dict], ReplayOptions]) -> Point:
    """`make_options` turns axis values into ReplayOptions (the CLI passes options_from_args). The
    options are resolved here, without building a backend, so a point that cannot run fails at once."""
    options = make_options(values)
    plan = resolve(options, build_backend=False)
    return Point(point_key(values), options, float(values["rate_scale"]), tuple(values[name] for name in AXES),
                 plan.as_dict(), plan.max_model_len)


def trace_checksum(trace: Trace) -> str:
    """The requests as replayed (after every transform but the rate scale), not the file's bytes."""
    h = hashlib.sha256()
    for column in (trace.arrival_s, trace.prompt_tokens, trace.output_tokens):
        h.update(np.ascontiguousarray(column).tobytes())
    for ids in trace.hash_ids or ():
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def identity(trace_sha256: str, axes: dict[str, tuple], options: ReplayOptions) -> dict:
    """What makes two tables comparable: the trace's content, the grid, and every fixed option."""
    return table_identity(trace_sha256, axes, options, AXES)


# Running one point.

def run_point(trace: Trace, point: Point) -> dict:
    """Replay one point; a failure becomes a row with status 'error' and its message."""
    from reports.digest import flat_options, run_digest, steps_timeline, summary_row
    from reports.metrics import steps_columns, summarize
    from reports.outcomes import outcomes_from_result
    from traces.transforms import scale_rate, truncate_too_long

    started = time.perf_counter()
    options = dict(flat_options(point.resolved), trace=trace.source, rate_scale=point.rate_scale)
    row: dict = {"point": point.key, "status": "ok", "error": ""}
    try:
        plan = resolve(point.options)
        scaled = scale_rate(trace, point.rate_scale)
        if trace.transforms.get("on_too_long") == "truncate":  # to this point's limit (a no-op where cut to it)
            scaled = truncate_too_long(scaled, point.max_model_len)
        result = replay(scaled, plan)
        outcomes = outcomes_from_result(result, plan.options.slo, stream_interval=plan.options.scheduler.stream_interval)
        opts = dict(plan.as_dict(), trace=trace.source, rate_scale=point.rate_scale)
        summary = summarize(result, outcomes, opts)
        row.update(summary_row(summary, run_digest(outcomes, steps_timeline(steps_columns(result)))))
        row["request_rate"] = len(scaled) / scaled.duration_s if scaled.duration_s > 0 else None
    except Exception as e:  # recorded in the table; the sweep goes on
        row.update(options)
        row["status"] = "error"
        row["error"] = str(e) if isinstance(e, ServesimError) else f"{type(e).__name__}: {e}"
    row["wall_s"] = time.perf_counter() - started
    return with_every_axis(row, point)


def with_every_axis(row: dict, point: Point) -> dict:
    """The row with a column for every axis: the options as the run used them name most axes, but a
    run's summary leaves out an option at its default (`RunPlan.as_dict`: --stream-interval 1), which
    the table still states, as the point's value (a missing one would make the column's numbers
    floats, shown as 1.0)."""
    for name, value in zip(AXES, point.values):
        row.setdefault(name, value)
    return row


def error_row(point: Point, trace: Trace, message: str) -> dict:
    from reports.digest import flat_options

    return with_every_axis({"point": point.key, "status": "error", "error": message,
                            **flat_options(point.resolved), "trace": trace.source, "rate_scale": point.rate_scale}, point)


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run_rows(trace: Trace, points: list[Point], executor: str = "process", jobs: int | None = None,
             address: str | None = None) -> Iterator[dict]:
    """Run the points, yielding each one's row as it finishes (in no particular order). Points whose
    options are the same run once (`same_runs`), and each of the others gets that run's row."""
    if executor not in EXECUTORS:
        raise ServesimError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    jobs = jobs or default_jobs()
    if jobs < 1:
        raise ServesimError(f"--jobs must be at least 1, got {jobs}")
    if not points:
        return
    unique, twins = same_runs(points)
    if executor == "ray":
        rows = _ray_rows(trace, unique, jobs, address)
    elif jobs == 1 or len(unique) == 1:
        rows = (run_point(trace, point) for point in unique)
    else:
        rows = _process_rows(trace, unique, min(jobs, len(unique)))
    for row in rows:
        yield row
        for twin in twins.get(row["point"], ()):
            yield dict(row, point=twin.key, wall_s=0.0)


def same_runs(points: list[Point]) -> tuple[list[Point], dict[str, list[Point]]]:
    """(the points to run, each one's twins by its key): points whose options (and rate scale) are the
    same replay the same, so each runs once. A grid of several policies gives chunked-only options
    (--long-prefill-token-threshold, --prefill-schedule-interval, --cache-aware-admission-window) to
    its chunked points only, so its other policies' points at each of those values are one run."""
    import json
    from dataclasses import asdict

    unique: list[Point] = []
    first: dict[str, Point] = {}
    twins: dict[str, list[Point]] = {}
    for point in points:
        identity = json.dumps([asdict(point.options), point.rate_scale], sort_keys=True, default=repr)
        if identity in first:
            twins.setdefault(first[identity].key, []).append(point)
        else:
            first[identity] = point
            unique.append(point)
    return unique, twins


def _process_rows(trace: Trace, points: list[Point], jobs: int) -> Iterator[dict]:
    """Points on local processes that die with this one (sim/app/workers.py)."""
    executor = workers.pool(jobs)
    futures = {executor.submit(run_point, trace, point): point for point in points}
    try:
        for future in as_completed(futures):
            try:
                yield future.result()
            except Exception as e:  # the worker process died (killed, out of memory)
                yield error_row(futures[future], trace, f"worker failed: {type(e).__name__}: {e}")
    finally:
        workers.stop(executor)  # the points still running (after an interrupt)


def _ray_rows(trace: Trace, points: list[Point], jobs: int, address: str | None) -> Iterator[dict]:
    try:
        import ray
    except ImportError:
        raise ServesimError("--executor ray needs Ray: pip install 'servesim[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        try:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                # "local": a new Ray instance of this process's own, never a cluster left running on this machine.
                ray.init(address="local", num_cpus=jobs, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ServesimError(f"cannot start Ray{' at ' + address if address else ''}: {e}") from None
    remote = ray.remote(num_cpus=1, max_retries=0)(run_point)
    trace_ref = ray.put(trace)
    pending = {remote.remote(trace_ref, point): point for point in points}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                point = pending.pop(ref)
                try:
                    yield ray.get(ref)
                except Exception as e:  # the worker died; run_point itself never raises
                    yield error_row(point, trace, f"worker failed: {type(e).__name__}: {e}")
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()


def require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ServesimError("pyarrow is missing (a servesim dependency): pip install pyarrow") from None


# A sweep.

@dataclass
class SweepResult:
    frame: pd.DataFrame  # every row, in grid order
    num_run: int  # points run now
    num_failed: int  # rows with status 'error'


def sweep(trace: Trace, points: list[Point], table: ResultsTable, executor: str = "process",
          jobs: int | None = None, address: str | None = None,
          on_row: Callable[[dict, int, int], None] | None = None) -> SweepResult:
    """Run every point that the table lacks (or holds as failed), adding each row as it finishes.

    `on_row(row, num_done, num_total)` is called after each row is written."""
    todo = [point for point in points if not table.is_done(point.key)]
    num_done = len(points) - len(todo)
    for row in run_rows(trace, todo, executor, jobs, address):
        table.add(row)
        num_done += 1
        if on_row is not None:
            on_row(row, num_done, len(points))
    keys = {point.key for point in points}
    frame = pd.DataFrame([row for row in table.sorted_rows() if row["point"] in keys])
    return SweepResult(frame, len(todo), int((frame["status"] != "ok").sum()) if len(frame) else 0)


def grid_order(points: Iterable[Point]) -> Callable[[dict], tuple]:
    index = {point.key: i for i, point in enumerate(points)}
    return lambda row: (index.get(row["point"], len(index)), row["point"])
