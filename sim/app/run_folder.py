"""A run folder written as the replay goes: the requests and steps tables in batches, the summary's
sketches and the step timeline updated from them, then summary.json, digest.json and report.html.

A streamed replay (sim/app/replay.py: replay_to) feeds it request by request and batch of steps by
batch of steps while the engine runs; an in-memory result (`write_run_folder`) feeds it the same
things afterwards. Both write the same bytes. Every file is written under a temporary name and
renamed into place only when all are written (sim.app.outputs.atomic_path), so a failed run (a
full disk, an interrupt) leaves the folder as it was.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from reports.digest import NUM_TIMELINE_BINS, TIMELINE, run_digest
from reports.metrics import step_table_columns, summarize
from reports.outcomes import RequestOutcomes
from reports.run_tables import TableWriter
from reports.timeline import StepTimeline
from sim.app.outputs import atomic_path, sync_file
from sim.engine import SimResult
from sim.errors import ServesimError
from sim.jsonable import jsonable
from sim.request import Request
from sim.step_log import BATCH_ROWS

TABLE_FORMATS = ("parquet", "csv")


class RunFolder:
    def __init__(self, out: Path, options: dict, slo, steps: str = "parquet", requests: str = "csv",
                 request_columns: tuple[str, ...] = (), stream_interval: int = 1):
        """`options`: the run's options as the summary records them; `steps`: parquet, csv or none;
        `requests`: csv or parquet; `request_columns`: more columns of the requests table (a
        cluster's), their values given to on_request; `stream_interval`: vLLM's --stream-interval
        (reports.outcomes.RequestOutcomes)."""
        if steps not in (*TABLE_FORMATS, "none"):
            raise ServesimError(f"--steps must be parquet, csv or none, got {steps!r}")
        if requests not in TABLE_FORMATS:
            raise ServesimError(f"--requests must be csv or parquet, got {requests!r}")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ServesimError(f"{out}: cannot make the folder ({e.strerror or e})") from None
        self.out = out
        self.options = options
        self._requests_name, self._steps_name = f"requests.{requests}", f"steps.{steps}"
        self._written = {self._requests_name, self._steps_name}
        self._files = ExitStack()  # the temporary files, renamed into place when all are written
        self._temps: dict[str, Path] = {}  # file name -> its temporary path
        self.outcomes = RequestOutcomes(slo, TableWriter(self._temp(f"requests.{requests}"), requests),
                                        extra_columns=request_columns, stream_interval=stream_interval)
        self.steps_writer = TableWriter(self._temp(f"steps.{steps}"), steps) if steps != "none" else None
        self.timeline = StepTimeline(TIMELINE)

    def _temp(self, name: str) -> Path:
        path = self._temps[name] = self._files.enter_context(atomic_path(self.out / name))
        return path

    def on_request(self, position: int, request: Request, token_times, extra: tuple = ()) -> None:
        """A request ended; `position`: its place in arrival order; `token_times`: its tokens' times;
        `extra`: its values of the extra request columns."""
        try:
            self.outcomes.add(position, request, token_times if request.finish_s is not None else None, extra)
        except OSError as e:
            raise self._cannot_write(self._requests_name, e) from None

    def on_steps(self, log_columns: dict[str, np.ndarray], first_step: int, replica: np.ndarray | None = None) -> None:
        """A batch of steps from the step log (its arrays are valid during this call only); `replica`:
        which replica ran each (a cluster's steps)."""
        if self.steps_writer is not None:
            table = step_table_columns(log_columns, first_step)
            if replica is not None:
                table = {"step": table.pop("step"), "replica": replica, **table}
            try:
                self.steps_writer.write(table)
            except OSError as e:
                raise self._cannot_write(self._steps_name, e) from None
        self.timeline.add(log_columns["start_s"], log_columns)

    def finish(self, result: SimResult, extra: dict | None = None, start_s: float | None = None) -> dict:
        """Close the tables; write summary.json, digest.json and report.html; rename every file into
        place; return the summary. `extra`: more summary entries; `start_s`: see summarize."""
        from reports.html import run_report_files

        with self._files:
            name = self._requests_name
            try:
                self.outcomes.close()
                if self.steps_writer is not None:
                    name = self._steps_name
                    if not self.steps_writer.num_rows:  # no step at all: the table still gets its columns
                        self.steps_writer.write(step_table_columns(result.steps.columns()))
                    self.steps_writer.close()
                summary = summarize(result, self.outcomes, self.options, start_s)
                summary.update(extra or {})
                summary = jsonable(summary)
                digest = run_digest(self.outcomes, self.timeline.timeline(NUM_TIMELINE_BINS))
                texts = {"summary.json": json.dumps(summary, indent=2) + "\n", **run_report_files(summary, digest)}
                for name, text in texts.items():
                    self._temp(name).write_text(text)
                # Every file on disk before the first rename: a disk error then renames none of them.
                for name, path in self._temps.items():
                    sync_file(path)
            except OSError as e:
                raise self._cannot_write(name, e) from None
        for name in (f"{table}.{fmt}" for table in ("requests", "steps") for fmt in TABLE_FORMATS):
            if name not in self._written:  # an earlier run's table in another format (--overwrite)
                (self.out / name).unlink(missing_ok=True)
        return summary

    def _cannot_write(self, name: str, e: OSError) -> ServesimError:
        return ServesimError(f"{self.out / name}: cannot write ({e.strerror or e}); the run folder is as it was")

    def abort(self) -> None:
        """Remove the temporary files (the replay failed)."""
        self._files.__exit__(RuntimeError, RuntimeError("aborted"), None)


def write_run_folder(out: Path, result: SimResult, options: dict, slo, steps: str = "parquet",
                     requests: str = "csv", spill_rows: int = BATCH_ROWS, extra: dict | None = None,
                     start_s: float | None = None, stream_interval: int = 1) -> dict:
    """The run folder of an in-memory result (every request and token time kept)."""
    from reports import cluster
    from reports.metrics import is_cluster

    clustered = is_cluster(result)
    request_columns = cluster.request_columns(result) if clustered else {}
    rank_of = getattr(result, "rank_of", None)
    if rank_of is not None:  # a DP group's: the rank the balancer sent each request to
        request_columns = {"dp_rank": rank_of}
    folder = RunFolder(out, options, slo, steps, requests, tuple(request_columns), stream_interval)
    try:
        for position, r in enumerate(result.requests):
            folder.on_request(position, r, result.tokens_of(position),
                              tuple(values[position] for values in request_columns.values()))
        columns = result.steps.columns()
        replica = result.steps.replica if clustered else None
        for start in range(0, len(result.steps), spill_rows):  # the batches a streamed replay's step log makes
            end = start + spill_rows
            folder.on_steps({name: values[start:end] for name, values in columns.items()}, start,
                            None if replica is None else replica[start:end])
    except BaseException:
        folder.abort()
        raise
    return folder.finish(result, extra, start_s)
