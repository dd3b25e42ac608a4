"""The step log: one row per engine step, in growable numpy arrays.

A single step writes one row; a fast-forwarded run of steps writes a slice. Columns are the
engine's (`STEP_COLUMNS`) plus the backend's own breakdown keys (seconds per part of the step).
"""

from __future__ import annotations

import numpy as np

STEP_COLUMNS = ("start_s", "seconds", "num_prefill_tokens", "num_decode_tokens", "num_requests",
                "num_kv_blocks_used", "num_waiting", "num_preemptions")


class StepLog:
    """Per-step columns in growable numpy arrays: a single step writes one row, a run of steps a
    slice (a scalar fills the slice). The breakdown keys are the backend's own."""

    def __init__(self) -> None:
        self._capacity = 1024
        self._num_steps = 0
        self._columns: dict[str, np.ndarray] = {
            name: np.zeros(self._capacity, dtype=np.float64 if name in ("start_s", "seconds") else np.int32)
            for name in STEP_COLUMNS}  # counts fit in int32; millions of steps stay small
        self._breakdown: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self._num_steps

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

    def append(self, row: tuple, breakdown: dict[str, float]) -> None:
        """Write one step: `row` in STEP_COLUMNS order."""
        i = self._num_steps
        if i == self._capacity:
            self._reserve(1)
        for column, value in zip(self._columns.values(), row):
            column[i] = value
        for key, value in breakdown.items():
            column = self._breakdown.get(key)
            if column is None:
                self._write(self._breakdown, key, i, i + 1, value)
            else:
                column[i] = value
        self._num_steps = i + 1

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
        for key, value in breakdown.items():
            column = table.get(key)
            if column is None:
                self._write(table, key, start, end, value)
            else:
                column[start:end] = value
        self._num_steps = end

    def columns(self) -> dict[str, np.ndarray]:
        """Every column (the breakdown keys too) as one array of length len(self)."""
        n = self._num_steps
        out = {name: values[:n] for name, values in self._columns.items()}
        out.update({key: values[:n] for key, values in self._breakdown.items()})
        return out

    @property
    def breakdown_keys(self) -> list[str]:
        return list(self._breakdown)

    def __getattr__(self, name: str) -> np.ndarray:
        if name in STEP_COLUMNS:
            return self._columns[name][:self._num_steps]
        raise AttributeError(name)
