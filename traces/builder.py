"""Accumulating a trace as its rows are parsed, chunk by chunk: dropped rows counted by reason,
the first out-of-order line, the earliest and latest arrival (a span beyond `MAX_SPAN_S` is
refused), then one `Trace` with arrivals counted from the first request."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sim.errors import ServesimError
from traces.formats import LONG_SPAN_S, MAX_SPAN_S, MOONCAKE_BLOCK_TOKENS
from traces.trace import Trace

YEAR_S = 365.25 * 86400
RESOLUTION_S = 1e-6  # the coarsest step between representable arrival times accepted (_check_precision)


@dataclass
class TraceBuilder:
    """Parsed chunks of one file, their dropped rows, and what the whole file must be checked for."""

    path: Path
    fmt: str
    arrival_name: str  # the arrival column, as messages name it
    arrival_per_s: float = 1.0  # 1e9 for nanosecond stamps, 1e3 for milliseconds
    arrival_is_date: bool = False  # nanoseconds since the epoch (Azure's dates)
    arrival: list[np.ndarray] = field(default_factory=list)  # in units of 1/arrival_per_s seconds
    prompt: list[np.ndarray] = field(default_factory=list)
    output: list[np.ndarray] = field(default_factory=list)
    request_ids: list[str] | None = None
    hash_ids: list[np.ndarray] | None = None
    priority: list[np.ndarray] | None = None  # per chunk, when the trace has a priority column
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    warnings: list[str] = field(default_factory=list)  # from the format's reader (e.g. time zones)
    dropped: dict[str, int] = field(default_factory=dict)
    first_dropped_line: dict[str, int] = field(default_factory=dict)
    last_arrival: float | None = None
    first_unordered_line: int | None = None
    earliest: tuple[float, int] | None = None  # (arrival, line)
    latest: tuple[float, int] | None = None
    entries: bool = False  # the "lines" are requests' positions in one JSON document (vLLM bench results)
    measured: dict[str, np.ndarray] | None = None  # the whole trace's, in the order added (Trace.measured)

    def at(self, line: int) -> str:
        """Where a row is, for messages: file:line, or the request's position in a JSON document."""
        return f"{self.path}: request {line}" if self.entries else f"{self.path}:{line}"

    def drop(self, reason: str, mask: np.ndarray, lines: np.ndarray) -> None:
        n = int(mask.sum())
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n
            self.first_dropped_line.setdefault(reason, int(lines[np.argmax(mask)]))

    def keep_nonzero(self, keep: np.ndarray, named: dict[str, np.ndarray], lines: np.ndarray) -> np.ndarray:
        """Drop (and count) rows whose token counts are 0; `named` maps a column name to its counts."""
        for name, values in named.items():
            zero = keep & (values == 0)
            self.drop(f"0 {name}", zero, lines)
            keep = keep & ~zero
        return keep

    def add(self, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, lines: np.ndarray, *,
            keep: np.ndarray | None = None, request_ids: list[str] | None = None,
            hash_ids: list[np.ndarray] | None = None, priority: np.ndarray | None = None) -> None:
        """Rows of one chunk (those where `keep` is true); ids and priorities only when the trace has them."""
        if keep is not None and not keep.all():
            arrival, prompt, output, lines = arrival[keep], prompt[keep], output[keep], lines[keep]
            priority = None if priority is None else priority[keep]
            positions = np.flatnonzero(keep).tolist()
            request_ids = None if request_ids is None else [request_ids[i] for i in positions]
            hash_ids = None if hash_ids is None else [hash_ids[i] for i in positions]
        if not len(arrival):
            return
        if self.first_unordered_line is None:
            previous = np.concatenate([[arrival[0] if self.last_arrival is None else self.last_arrival], arrival])
            down = np.diff(previous) < 0
            if down.any():
                self.first_unordered_line = int(lines[np.argmax(down)])
        self.last_arrival = arrival[-1]
        low, high = int(np.argmin(arrival)), int(np.argmax(arrival))
        if self.earliest is None or arrival[low] < self.earliest[0]:
            self.earliest = (arrival[low], int(lines[low]))
        if self.latest is None or arrival[high] > self.latest[0]:
            self.latest = (arrival[high], int(lines[high]))
        self.arrival.append(arrival)
        self.prompt.append(prompt)
        self.output.append(output)
        if self.request_ids is not None:
            self.request_ids.extend(request_ids)
        if self.hash_ids is not None:
            self.hash_ids.extend(hash_ids)
        if self.priority is not None:
            self.priority.append(priority)

    def shown(self, value: float) -> str:
        """An arrival as the file wrote it, for messages."""
        if self.arrival_is_date:
            import pandas as pd  # only for a message: a replay never needs it

            return f"{self.arrival_name} {pd.Timestamp(int(value)).isoformat(sep=' ')}"  # UTC if zoned
        return f"{self.arrival_name} {value:g}"

    def _check_precision(self) -> None:
        """Arrivals stored as 64-bit floats are exact to a step that grows with their size: 2.4e-7 s
        for seconds, milliseconds, microseconds or nanoseconds since 1970, but 128 s for seconds near
        1e18. Refused when that step passes `RESOLUTION_S`: nearby arrivals would merge unseen."""
        for value, line in (self.earliest, self.latest):
            if not isinstance(value, (float, np.floating)):
                continue  # whole numbers (nanosecond dates) are exact
            step_s = float(np.spacing(abs(float(value)))) / self.arrival_per_s
            if step_s > RESOLUTION_S:
                raise ServesimError(f"{self.at(line)}: {self.shown(value)} is too large to keep its arrivals apart: "
                                    f"a number this large is exact only to {step_s:.3g} s; give arrival times from "
                                    "the trace's start (or since 1970)")

    def _check_span(self) -> None:
        (first, first_line), (last, last_line) = self.earliest, self.latest
        span_s = (float(last) - float(first)) / self.arrival_per_s  # int64 ns could overflow
        if np.isfinite(span_s) and span_s <= LONG_SPAN_S:
            return
        where = f"{self.at(last_line)}: {self.shown(last)} is {span_s:.4g} s ({span_s / YEAR_S:.3g} years) " \
                f"after the first arrival ({self.shown(first)}, {'request' if self.entries else 'line'} {first_line})"
        if not np.isfinite(span_s) or span_s > MAX_SPAN_S:
            raise ServesimError(f"{where}; a trace cannot span more than {MAX_SPAN_S:g} s: check the value")
        self.warnings.append(f"{where}; more than a year: check the value")

    def trace(self) -> Trace:
        path = self.path
        warnings = [f"{self.at(self.first_dropped_line[reason])}: dropped {n} request{'s' * (n != 1)} with {reason}"
                    for reason, n in self.dropped.items() if not reason.startswith("model ")]
        if not self.arrival:
            if self.dropped:
                counts = ", ".join(f"{n} with {reason}" for reason, n in self.dropped.items())
                raise ServesimError(f"{path}: no requests left to replay (dropped {counts})")
            raise ServesimError(f"{path}: the trace has a header but no requests")
        self._check_span()
        self._check_precision()
        warnings += self.warnings
        arrival = np.concatenate(self.arrival)
        prompt = np.concatenate(self.prompt)
        output = np.concatenate(self.output)
        arrival = (arrival - arrival.min()) / self.arrival_per_s  # exact differences before the division
        request_ids, hash_ids = self.request_ids, self.hash_ids
        priority = None if self.priority is None else np.concatenate(self.priority)
        measured = self.measured
        if self.first_unordered_line is not None:
            warnings.append(f"{self.at(self.first_unordered_line)}: arrivals are out of order; "
                            f"sorted them by arrival time")
            order = np.argsort(arrival, kind="stable")
            arrival, prompt, output = arrival[order], prompt[order], output[order]
            positions = order.tolist()
            if request_ids is not None:
                request_ids = [request_ids[i] for i in positions]
            if hash_ids is not None:
                hash_ids = [hash_ids[i] for i in positions]
            if priority is not None:
                priority = priority[order]
            if measured is not None:
                measured = {k: v[order] for k, v in measured.items()}
        arrival = arrival - arrival[0]
        return Trace(arrival, prompt, output, request_ids, hash_ids, self.hash_block_tokens, source=str(path),
                     format=self.fmt, warnings=warnings, dropped=dict(self.dropped), priority=priority,
                     measured=measured)


def check_hash_ids(where: str, ids: np.ndarray, prompt: int, block_tokens: int, prompt_name: str) -> None:
    """A request's prefix hash ids: exactly one per `block_tokens` prompt tokens, none negative."""
    needed = -(-prompt // block_tokens)
    if len(ids) != needed:
        what = "cannot cover" if len(ids) < needed else "are more than"
        raise ServesimError(f"{where}: {len(ids)} hash_ids {what} {prompt_name} {prompt}: it needs "
                            f"{needed}, one per {block_tokens} tokens")
    if len(ids) and ids.min() < 0:
        raise ServesimError(f"{where}: hash_ids must not be negative, got {int(ids.min())}")
    if len(ids) and ids.dtype.kind == "u" and ids.max() > np.iinfo(np.int64).max:
        raise ServesimError(f"{where}: hash_ids must be below 2**63, got {int(ids.max())}")
