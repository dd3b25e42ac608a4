"""A run folder written as the replay goes: the requests and steps tables in batches, the summary's
sketches and the step timeline updated from them, then summary.json, digest.json and report.html.

A streamed replay (sim/app/replay.py: replay_to) feeds it request by request and batch of steps by
batch of steps while the engine runs; an in-memory result (`write_run`) feeds it the same things
afterwards. Both write the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from reports.digest import NUM_TIMELINE_BINS, TIMELINE, run_digest
from reports.metrics import step_table_columns, summarize
from reports.outcomes import RequestOutcomes
from reports.run_tables import TableWriter
from reports.timeline import StepTimeline
from sim.engine import SimResult
from sim.errors import ServesimError
from sim.jsonable import jsonable
from sim.request import Request
from sim.step_log import BATCH_ROWS

TABLE_FORMATS = ("parquet", "csv")


class RunFolder:
    def __init__(self, out: Path, options: dict, slo, steps: str = "parquet", requests: str = "csv"):
        """`options`: the run's options as the summary records them; `steps`: parquet, csv or none;
        `requests`: csv or parquet."""
        if steps not in (*TABLE_FORMATS, "none"):
            raise ServesimError(f"--steps must be parquet, csv or none, got {steps!r}")
        if requests not in TABLE_FORMATS:
            raise ServesimError(f"--requests must be csv or parquet, got {requests!r}")
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.options = options
        self.outcomes = RequestOutcomes(slo, TableWriter(out, "requests", requests))
        self.steps_writer = TableWriter(out, "steps", steps) if steps != "none" else None
        self.timeline = StepTimeline(TIMELINE)

    def on_request(self, position: int, request: Request, token_times) -> None:
        """A request ended; `position`: its place in arrival order; `token_times`: its tokens' times."""
        gaps = None
        if request.finish_s is not None and token_times is not None and len(token_times) > 1:
            gaps = np.diff(np.asarray(token_times, dtype=np.float64))
        self.outcomes.add(position, request, gaps)

    def on_steps(self, log_columns: dict[str, np.ndarray], first_step: int) -> None:
        """A batch of steps from the step log (its arrays are valid during this call only)."""
        if self.steps_writer is not None:
            self.steps_writer.write(step_table_columns(log_columns, first_step))
        self.timeline.add(log_columns["start_s"], log_columns)

    def finish(self, result: SimResult) -> dict:
        """Close the tables; write summary.json, digest.json and report.html; return the summary."""
        from reports.html import write_run_report

        self.outcomes.close()
        if self.steps_writer is not None:
            if not self.steps_writer.num_rows:  # no step at all: the table still gets its columns
                self.steps_writer.write(step_table_columns(result.steps.columns()))
            self.steps_writer.close()
        summary = jsonable(summarize(result, self.outcomes, self.options))
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_run_report(self.out, summary, run_digest(self.outcomes, self.timeline.timeline(NUM_TIMELINE_BINS)))
        return summary


def write_run_folder(out: Path, result: SimResult, options: dict, slo, steps: str = "parquet",
                     requests: str = "csv", spill_rows: int = BATCH_ROWS) -> dict:
    """The run folder of an in-memory result (every request and token time kept)."""
    folder = RunFolder(out, options, slo, steps, requests)
    for position, r in enumerate(result.requests):
        folder.on_request(position, r, result.tokens_of(position))
    columns = result.steps.columns()
    for start in range(0, len(result.steps), spill_rows):  # the batches a streamed replay's step log makes
        folder.on_steps({name: values[start:start + spill_rows] for name, values in columns.items()}, start)
    return folder.finish(result)
