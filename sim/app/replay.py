"""One replay: trace + options -> simulated requests and steps -> a run folder."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from sim.app.options import ReplayOptions
from sim.app.outputs import atomic_path
from sim.app.plan import RunPlan, resolve
from sim.arrivals import TraceArrivals, simulate
from sim.engine import Engine, SimResult, TokenTimes
from sim.errors import ServesimError
from sim.jsonable import jsonable
from sim.request import Request
from traces.trace import Trace

__all__ = ["ReplayOptions", "make_requests", "replay", "write_run"]

RUN_FILES = ("requests.csv", "steps.csv", "summary.json", "digest.json", "report.html")


def make_requests(trace: Trace) -> list[Request]:
    """The trace's requests, in trace order."""
    ids = trace.ids()
    hash_ids = trace.hash_ids
    arrival = trace.arrival_s.tolist()
    prompt = trace.prompt_tokens.tolist()
    output = trace.output_tokens.tolist()
    priority = [0] * len(trace) if trace.priority is None else trace.priority.tolist()
    return [
        Request(i, ids[i], arrival[i], prompt[i], output[i],
                hash_ids=None if hash_ids is None else hash_ids[i], hash_block_tokens=trace.hash_block_tokens,
                priority=priority[i])
        for i in range(len(trace))
    ]


def replay(trace: Trace, options: ReplayOptions | RunPlan, backend=None,
           progress: Callable[[float, int], None] | None = None, fast_forward: bool = True) -> SimResult:
    """Simulate the trace. `fast_forward=False` steps every decode step one by one (same answers,
    slower; see sim/fast_forward.py)."""
    plan = options if isinstance(options, RunPlan) else resolve(options, backend)
    requests = sorted(make_requests(trace), key=lambda r: (r.arrival_s, r.index))  # arrival order, ties in trace order
    engine = Engine(plan.make_policy(), plan.backend, plan.make_block_manager(), TokenTimes(requests),
                    plan.max_model_len, fast_forward=fast_forward, progress=progress)
    return simulate(engine, TraceArrivals(requests, engine))


def write_run(out: Path, result: SimResult, plan: RunPlan | ReplayOptions, trace: Trace, extra: dict | None = None,
              start_s: float | None = None) -> dict:
    """Write requests.csv, steps.csv, summary.json, digest.json and report.html; return the summary.
    `extra`: more summary entries (sim bench's); `start_s`: see reports.metrics.summarize. The run is
    written whole or not at all (temporary files renamed into place together)."""
    if not isinstance(plan, RunPlan):
        plan = resolve(plan, build_backend=False)
    from reports.html import run_report_files
    from reports.metrics import requests_table, steps_table, summarize, write_numeric_csv

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ServesimError(f"{out}: cannot make the folder ({e.strerror or e})") from None
    requests = requests_table(result)
    opts = plan.as_dict()
    opts["trace"] = trace.source
    if trace.transforms:
        opts["trace_transforms"] = trace.transforms
    summary = summarize(result, requests, plan.options.slo, opts, start_s)
    summary.update(extra or {})
    summary["kv_cache"] = plan.kv_cache()
    summary["model"] = plan.model.describe()
    if plan.options.backend == "costmodel" and plan.options.profile is None:
        summary["hardware"] = plan.hardware.as_dict()
    texts = {"summary.json": json.dumps(jsonable(summary), indent=2) + "\n",
             **run_report_files(result, requests, jsonable(summary))}  # downsampled: cheap even for 500k steps
    # Every file is written to its temporary name first and renamed only when all are written, so a
    # full disk leaves the folder as it was (an --overwrite'n run is not half replaced).
    writers = {"requests.csv": lambda path: requests.to_csv(path, index=False),
               "steps.csv": lambda path: write_numeric_csv(steps_table(result), path),
               **{name: (lambda path, text=text: path.write_text(text)) for name, text in texts.items()}}
    with ExitStack() as files:
        temp = {name: files.enter_context(atomic_path(out / name)) for name in RUN_FILES}
        for name in RUN_FILES:
            try:
                writers[name](temp[name])
            except OSError as e:
                raise ServesimError(f"{out / name}: cannot write ({e.strerror or e}); the run folder is as it "
                                    "was") from None
    return summary
