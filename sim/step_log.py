"""The step log: one row per engine step, in growable numpy arrays.

A single step writes one row; a fast-forwarded run of steps writes a slice. Columns are the
engine's (`STEP_COLUMNS`) plus the backend's own breakdown keys (seconds per part of the step).

With a `sink`, the log hands its rows over in batches of `spill_rows` steps (the last one, shorter,
at `spill()`), so a replay of millions of steps holds only the latest ones: the sink gets each
batch as columns, and its first step's number. Without one it keeps every step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

BATCH_ROWS = 1 << 18  # steps per batch handed to a sink (a row group of the steps table)
STEP_COLUMNS = ("start_s", "seconds", "num_prefill_tokens", "num_decode_tokens", "num_requests",
                "num_kv_blocks_used", "num_waiting", "num_preemptions")


def _column(name: str) -> property:
    """One of STEP_COLUMNS read as an attribute of the log (`steps.start_s`): the steps held.

    Declared one by one rather than served by a `__getattr__`: a class with its own `__getattr__`
    keeps CPython (3.11) from specialising any attribute or method lookup on its instances, and the
    engine calls the log on every step (1.3% of a replay's instructions)."""

    def read(log: "StepLog") -> np.ndarray:
        return log._columns[name][:log._num_steps]

    return property(read, doc=f"The steps' {name}.")


class StepLog:
    """Per-step columns in growable numpy arrays: a single step writes one row, a run of steps a
    slice (a scalar fills the slice). The breakdown keys are the backend's own."""

    start_s = _column("start_s")
    seconds = _column("seconds")
    num_prefill_tokens = _column("num_prefill_tokens")
    num_decode_tokens = _column("num_decode_tokens")
    num_requests = _column("num_requests")
    num_kv_blocks_used = _column("num_kv_blocks_used")
    num_waiting = _column("num_waiting")
    num_preemptions = _column("num_preemptions")

    def __init__(self, sink: Callable[[dict[str, np.ndarray], int], None] | None = None,
                 spill_rows: int = BATCH_ROWS) -> None:
        self.sink = sink
        self.spill_rows = spill_rows
        self.num_spilled = 0  # steps already handed to the sink
        self._capacity = 1024
        self._num_steps = 0
        self._columns: dict[str, np.ndarray] = {
            name: np.zeros(self._capacity, dtype=np.float64 if name in ("start_s", "seconds") else np.int32)
            for name in STEP_COLUMNS}  # counts fit in int32; millions of steps stay small
        self._breakdown: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        """Steps logged, spilled ones included."""
        return self.num_spilled + self._num_steps

    def spill(self, whole_batches: bool = False) -> None:
        """Hand the rows held to the sink and forget them; with `whole_batches`, only whole batches
        of `spill_rows` rows (so batch sizes do not depend on how the steps were logged)."""
        sink = self.sink
        if sink is None:
            raise RuntimeError("internal error: StepLog.spill() without a sink")
        n = self._num_steps
        if whole_batches:
            n -= n % self.spill_rows
        if not n:
            return
        for start in range(0, n, self.spill_rows):
            end = min(start + self.spill_rows, n)
            sink({name: values[start:end] for name, values in self.columns().items()}, self.num_spilled)
            self.num_spilled += end - start
        left = self._num_steps - n
        for table, blank in ((self._columns, 0), (self._breakdown, np.nan)):
            for values in table.values():
                values[:left] = values[n:n + left]
                values[left:self._num_steps] = blank  # as new: a column left out of `extend` stays blank
        self._num_steps = left

    def _reserve(self, num_rows: int) -> None:
        needed = self._num_steps + num_rows
        if needed <= self._capacity:
            return
        while self._capacity < needed:
            self._capacity += self._capacity // 2
        for table in (self._columns, self._breakdown):
            for name, values in table.items():
                grown = np.zeros(self._capacity, dtype=values.dtype)
                grown[:self._num_steps] = values[:self._num_steps]
                table[name] = grown

    def _write(self, table: dict[str, np.ndarray], name: str, start: int, end: int, value) -> None:
        column = table.get(name)
        if column is None:  # a breakdown key seen for the first time
            column = table[name] = np.full(self._capacity, np.nan)
        column[start:end] = value

    def append_step(self, batch, start: float, result, num_used_blocks: int, num_waiting: int,
                    num_preempted: int) -> None:
        """Write one step of `batch` (a sim.batch.Batch) that started at `start` and cost `result`
        (the backend's StepResult): the row of a single step, whether stepped alone or the first
        step of a folded run."""
        num_decode = batch.num_decode_tokens
        self.append((start, result.seconds, batch.num_tokens - num_decode, num_decode, len(batch.requests),
                     num_used_blocks, num_waiting, num_preempted), result.breakdown)

    def append(self, row: tuple, breakdown: dict[str, float]) -> None:
        """Write one step: `row` in STEP_COLUMNS order."""
        i = self._num_steps
        if i == self._capacity:
            self._reserve(1)
        for column, value in zip(self._columns.values(), row):
            column[i] = value
        parts = self._breakdown
        try:
            for key, value in breakdown.items():
                parts[key][i] = value
        except KeyError:  # a breakdown key seen for the first time (its column is made: rewriting the others is harmless)
            for key, value in breakdown.items():
                self._write(parts, key, i, i + 1, value)
        self._num_steps = i + 1
        if self.sink is not None and self._num_steps >= self.spill_rows:
            self.spill(whole_batches=True)

    def extend(self, num_rows: int, columns: dict, breakdown: dict) -> None:
        """Write `num_rows` steps; each value is a scalar (the same for every row) or an array. A
        column left out stays 0."""
        start = self._num_steps
        end = start + num_rows
        if end > self._capacity:
            self._reserve(num_rows)
        table = self._columns
        for name, value in columns.items():
            table[name][start:end] = value
        table = self._breakdown
        try:
            for key, value in breakdown.items():
                table[key][start:end] = value
        except KeyError:  # a breakdown key seen for the first time, as in `append`
            for key, value in breakdown.items():
                self._write(table, key, start, end, value)
        self._num_steps = end
        if self.sink is not None and end >= self.spill_rows:
            self.spill(whole_batches=True)

    def drop_first(self, num_rows: int) -> None:
        """Forget the first `num_rows` steps (a log without a sink: all its steps are held), as if
        they had never been logged: sim bench leaves its warm-up's steps out (sim/app/bench.py)."""
        if self.sink is not None or self.num_spilled:
            raise RuntimeError("internal error: StepLog.drop_first() of a log that spills")
        if not num_rows:
            return
        n = self._num_steps - num_rows
        for table, blank in ((self._columns, 0), (self._breakdown, np.nan)):
            for values in table.values():
                values[:n] = values[num_rows:num_rows + n]
                values[n:self._num_steps] = blank  # as new, as `spill` leaves them
        self._num_steps = n

    def columns(self) -> dict[str, np.ndarray]:
        """Every column (the breakdown keys too) of the steps held (all of them without a sink)."""
        n = self._num_steps
        out = {name: values[:n] for name, values in self._columns.items()}
        out.update({key: values[:n] for key, values in self._breakdown.items()})
        return out

    @property
    def breakdown_keys(self) -> list[str]:
        return list(self._breakdown)

