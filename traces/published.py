"""Rows of the published CSV traces: Azure LLM inference 2023/2024, BurstGPT, Vidur/Splitwise.

Rows these traces hold but a replay cannot use (BurstGPT's failed requests have 0 response
tokens; a prompt or output of 0 tokens) are dropped, counted in `Trace.dropped` and warned about.

Azure's TIMESTAMP is a date and time: the 2023 files give none a time zone, the 2024 files give
every one `+00:00`. Stamps with a zone are converted to UTC. A file mixing stamps with and
without a zone is refused (the zone-less ones could be in any zone); stamps whose UTC offsets
differ are converted to UTC with a warning naming the first line whose offset changes.

A clean Azure file (every row `YYYY-MM-DD HH:MM:SS[.fraction],tokens,tokens`, no zone, no quotes,
no blank line: the 2023 files) is read without pandas by `read_plain_azure`, whose import costs
more than reading the file; anything else goes through pandas (`AzureRows`), which names every
problem with its file and line.
"""

from __future__ import annotations

import re
from datetime import date, datetime
from itertools import islice
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from sim.errors import ServesimError
from traces.builder import TraceBuilder
from traces.csv_rows import Chunk
from traces.formats import AZURE, MAX_TOKENS

if TYPE_CHECKING:
    import pandas as pd

# A UTC offset at the end of an ISO 8601 stamp (after its time): Z, +HH, +HHMM or +HH:MM.
OFFSET = r"\d:\d\d(?::\d\d(?:[.,]\d*)?)?\s*([zZ]|[+-]\d\d(?::?\d\d)?)\s*$"


def _why_not_a_time(stamp: str) -> str:
    """Why pandas read `stamp` as no time: not a date and time at all, or one outside the arrival
    clock's range (nanoseconds since 1970 in 64 bits: 1677-09-22 to 2262-04-11), as 9999-12-31 is."""
    try:
        when = datetime.fromisoformat(str(stamp).strip().replace("Z", "+00:00")).replace(tzinfo=None)
    except ValueError:
        return "is not a date and time"
    if datetime(1677, 9, 22) <= when <= datetime(2262, 4, 11):
        return "is not a date and time"
    return OUTSIDE


OUTSIDE = "is outside the times servesim reads (1677-09-22 to 2262-04-11: nanoseconds since 1970 in 64 bits)"


class AzureRows:
    def __init__(self, builder: TraceBuilder):
        builder.arrival_per_s, builder.arrival_is_date = 1e9, True
        self.builder = builder
        self.first: tuple[bool, int, str] | None = None  # (has a zone, line, stamp) of the first row
        self.offset: tuple[str, int, str] | None = None  # (UTC offset, line, stamp) of the first zoned row
        self.warned = False

    def add(self, chunk: Chunk) -> None:
        import pandas as pd

        stamps = chunk.text("TIMESTAMP")
        try:  # one parse when the chunk has one offset, or none (every published file)
            times = pd.to_datetime(stamps, format="ISO8601", errors="coerce")
            is_mixed = False
        except ValueError:  # pandas: "Mixed timezones detected"
            times = pd.to_datetime(stamps, format="ISO8601", errors="coerce", utc=True)
            is_mixed = True
        bad = times.isna().to_numpy()
        if bad.any():
            row = int(np.argmax(bad))
            raise ServesimError(f"{chunk.where(row)}: TIMESTAMP {stamps.iloc[row]!r} {_why_not_a_time(stamps.iloc[row])}")
        if is_mixed:
            self._check_mixed(chunk, stamps)
        else:
            self._check_one_zone(chunk, stamps, times.dt.tz)
        if times.dt.tz is not None:
            times = times.dt.tz_convert("UTC").dt.tz_localize(None)
        try:  # pandas 3 parses to microseconds: a stamp past 2262 has no nanoseconds in 64 bits
            times = times.dt.as_unit("ns")
        except pd.errors.OutOfBoundsDatetime:
            outside = ((times < pd.Timestamp.min) | (times > pd.Timestamp.max)).to_numpy()
            row = int(np.argmax(outside))
            raise ServesimError(f"{chunk.where(row)}: TIMESTAMP {stamps.iloc[row]!r} {OUTSIDE}") from None
        ns = times.to_numpy().astype("datetime64[ns]").astype(np.int64)
        prompt = chunk.counts("ContextTokens")
        output = chunk.counts("GeneratedTokens")
        keep = self.builder.keep_nonzero(np.ones(len(ns), dtype=bool),
                                         {"ContextTokens": prompt, "GeneratedTokens": output}, chunk.lines)
        self.builder.add(ns, prompt, output, chunk.lines, keep=keep)

    def finish(self) -> None:
        pass

    def _check_one_zone(self, chunk: Chunk, stamps: pd.Series, tz) -> None:
        """Every stamp of the chunk has no zone (tz None), or the same offset."""
        if self.first is None:
            self.first = (tz is not None, int(chunk.lines[0]), stamps.iloc[0])
        if (tz is not None) != self.first[0]:
            self._refuse(chunk, stamps, 0)
        if tz is not None:
            self._check_offsets(chunk, stamps, np.full(len(stamps), _normal_offset(str(tz)), dtype=object))

    def _check_mixed(self, chunk: Chunk, stamps: pd.Series) -> None:
        """A chunk with several offsets, or stamps with and without a zone (rare: read row by row)."""
        offsets = stamps.str.extract(OFFSET, expand=False)
        zoned = offsets.notna().to_numpy()
        if self.first is None:
            self.first = (bool(zoned[0]), int(chunk.lines[0]), stamps.iloc[0])
        differs = zoned != self.first[0]
        if differs.any():
            self._refuse(chunk, stamps, int(np.argmax(differs)))
        self._check_offsets(chunk, stamps, offsets.map(_normal_offset).to_numpy(dtype=object))

    def _refuse(self, chunk: Chunk, stamps: pd.Series, row: int) -> None:
        has_zone, line, stamp = self.first
        this, that = ("no time zone", "one") if has_zone else ("a time zone", "none")
        raise ServesimError(f"{chunk.where(row)}: TIMESTAMP {stamps.iloc[row]!r} has {this}, but line {line}'s "
                            f"{stamp!r} has {that}; a stamp without a zone could be in any zone: give every "
                            f"stamp a zone (e.g. +00:00), or none")

    def _check_offsets(self, chunk: Chunk, stamps: pd.Series, offsets: np.ndarray) -> None:
        """Warn once, at the first stamp whose UTC offset differs from the first stamp's."""
        if self.offset is None:
            self.offset = (offsets[0], int(chunk.lines[0]), stamps.iloc[0])
        first, line, stamp = self.offset
        differs = offsets != first
        if self.warned or not differs.any():
            return
        row = int(np.argmax(differs))
        self.warned = True
        self.builder.warnings.append(
            f"{chunk.where(row)}: TIMESTAMP {stamps.iloc[row]!r} has UTC offset {offsets[row]}, line {line} "
            f"({stamp!r}) has {first}; converted every stamp to UTC")


# Clean rows, one a line: a date and time without a zone (0 to 9 digits of a second's fraction), two counts.
PLAIN_ROWS = re.compile(rb"^(\d{4}-\d\d-\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?,(\d{1,10}),(\d{1,10})\r?$",
                        re.MULTILINE)
EPOCH_DAY = date(1970, 1, 1).toordinal()
NS_PER_S = 10**9


def read_plain_azure(builder: TraceBuilder, handle: BinaryIO, names: list[str], header_line: int,
                     chunk_rows: int) -> bool:
    """Read the rows after the header if every one is clean (see the module's docstring), giving
    the builder what `AzureRows` gives it: the same nanoseconds as pd.to_datetime(format="ISO8601"),
    the same counts and drops. If a row is not clean, nothing is added, `handle` is put back where
    it was and False returned: AzureRows reads the file (and names what is wrong)."""
    if names != list(AZURE):
        return False
    start = handle.tell()
    chunks = []
    while lines := list(islice(handle, chunk_rows)):
        chunk = _plain_chunk(lines)
        if chunk is None:
            break
        chunks.append(chunk)
    else:
        if chunks:
            _add_plain_chunks(builder, chunks, header_line)
            return True
    handle.seek(start)
    return False


def _plain_chunk(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The nanoseconds and counts of clean rows; None if a line is not one."""
    rows = PLAIN_ROWS.findall(b"".join(lines))
    if len(rows) != len(lines):  # a line matches once at most (the pattern spans it all, and no line end)
        return None
    day, hours, minutes, seconds, fraction, context, generated = zip(*rows)
    midnight = {d: _midnight_ns(d) for d in set(day)}
    if None in midnight.values():
        return None
    hours, minutes, seconds = (_two_digits(column) for column in (hours, minutes, seconds))
    context, generated = (np.array(list(map(int, column)), dtype=np.int64) for column in (context, generated))
    if (hours > 23).any() or (minutes > 59).any() or (seconds > 59).any() or (context > MAX_TOKENS).any() \
            or (generated > MAX_TOKENS).any():
        return None
    ns = np.array([midnight[d] for d in day], dtype=np.int64) + ((hours * 60 + minutes) * 60 + seconds) * NS_PER_S
    ns += _nanoseconds(fraction)
    return ns, context, generated


def _two_digits(column: tuple[bytes, ...]) -> np.ndarray:
    """Fields of two digits each (the pattern's \\d\\d) as numbers, from their bytes at once."""
    digits = np.frombuffer(b"".join(column), dtype=np.uint8).reshape(-1, 2).astype(np.int64) - ord("0")
    return digits[:, 0] * 10 + digits[:, 1]


NINE_PLACES = 10 ** np.arange(8, -1, -1, dtype=np.int64)  # a second's fraction: 0.1 s is 10**8 ns


def _nanoseconds(fraction: tuple[bytes, ...]) -> np.ndarray:
    """A second's fraction of 0 to 9 digits (the pattern's \\d{1,9}, or none) in nanoseconds:
    int(f.ljust(9, b"0")) of each, from their bytes at once (numpy pads the fields with NUL)."""
    digits = np.array(fraction, dtype="S9").view(np.uint8).reshape(-1, 9).astype(np.int64)
    return np.where(digits > 0, digits - ord("0"), 0) @ NINE_PLACES


def _midnight_ns(day: bytes) -> int | None:
    """YYYY-MM-DD's first nanosecond since the epoch; None for no such date, or one outside the
    years where pandas and this reader surely agree (pandas' nanoseconds end in 2262)."""
    year, month, dom = int(day[:4]), int(day[5:7]), int(day[8:10])
    if not 1700 <= year <= 2200:
        return None
    try:
        return (date(year, month, dom).toordinal() - EPOCH_DAY) * 86400 * NS_PER_S
    except ValueError:
        return None


def _add_plain_chunks(builder: TraceBuilder, chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                      header_line: int) -> None:
    builder.arrival_per_s, builder.arrival_is_date = 1e9, True
    first_line = header_line + 1
    for ns, context, generated in chunks:
        lines = np.arange(first_line, first_line + len(ns), dtype=np.int64)
        first_line += len(ns)
        keep = builder.keep_nonzero(np.ones(len(ns), dtype=bool),
                                    {"ContextTokens": context, "GeneratedTokens": generated}, lines)
        builder.add(ns, context, generated, lines, keep=keep)


def _normal_offset(text: str) -> str:
    """'Z', 'UTC', '+02', '+0200', 'UTC+02:00' -> '+00:00' or '+02:00'."""
    text = str(text).strip().removeprefix("UTC")
    if text in ("", "z", "Z"):
        return "+00:00"
    digits = text[1:].replace(":", "")
    return f"{text[0]}{digits[:2]}:{digits[2:4] or '00'}"


class BurstGptRows:
    """BurstGPT's rows. Its Total tokens is Request tokens + Response tokens in the published files;
    rows where it is not (a column shifted or edited) are replayed from Request and Response tokens
    and warned about, with the first such line and how many."""

    def __init__(self, builder: TraceBuilder, model_filter: str | None):
        self.builder = builder
        self.model_filter = model_filter
        self.models: set[str] = set()
        self.num_off_total = 0
        self.first_off_total: str | None = None  # the first such row, in words

    def add(self, chunk: Chunk) -> None:
        builder = self.builder
        arrival = chunk.numbers("Timestamp")
        prompt = chunk.counts("Request tokens")
        output = chunk.counts("Response tokens")
        keep = np.ones(len(arrival), dtype=bool)
        if self.model_filter is not None:
            model = chunk.text("Model")
            self.models.update(model.unique().tolist())
            other = (model.str.lower() != self.model_filter.lower()).to_numpy()
            builder.drop(f"model other than {self.model_filter}", other, chunk.lines)
            keep &= ~other
        failed = keep & (output == 0)
        builder.drop("0 Response tokens (failed)", failed, chunk.lines)
        keep &= ~failed
        keep = builder.keep_nonzero(keep, {"Request tokens": prompt}, chunk.lines)
        self._check_totals(chunk, prompt, output, keep)
        builder.add(arrival, prompt, output, chunk.lines, keep=keep)

    def _check_totals(self, chunk: Chunk, prompt: np.ndarray, output: np.ndarray, keep: np.ndarray) -> None:
        import pandas as pd

        total = pd.to_numeric(chunk.column("Total tokens").astype(str).str.strip(), errors="coerce").to_numpy(float)
        off = keep & (total != prompt + output)  # (a blank or non-numeric total, NaN, counts as off too)
        n = int(off.sum())
        if n:
            self.num_off_total += n
            if self.first_off_total is None:
                row = int(np.argmax(off))
                self.first_off_total = (f"{chunk.where(row)}: Total tokens {chunk.column('Total tokens').iloc[row]} "
                                        f"is not Request tokens + Response tokens ({prompt[row]} + {output[row]})")

    def finish(self) -> None:
        builder, wanted = self.builder, self.model_filter
        if self.num_off_total:
            n = self.num_off_total
            # Counted over the file's rows as read (--limit and --time-window cut the trace after): "replayed"
            # named 4 rows where --limit 1 replayed none of them.
            builder.warnings.append(f"{self.first_off_total}; {n} row{'s' * (n != 1)} of the file so: their requests "
                                    "take Request and Response tokens (check the columns)")
        if wanted is not None and not builder.arrival and builder.dropped.get(f"model other than {wanted}"):
            raise ServesimError(f"{builder.path}: no request of model {wanted!r}; the trace has "
                                f"{', '.join(sorted(self.models))}")


class VidurRows:
    def __init__(self, builder: TraceBuilder):
        self.builder = builder

    def add(self, chunk: Chunk) -> None:
        arrival = chunk.numbers("arrived_at")
        prompt = chunk.counts("num_prefill_tokens")
        output = chunk.counts("num_decode_tokens")
        keep = self.builder.keep_nonzero(np.ones(len(arrival), dtype=bool),
                                         {"num_prefill_tokens": prompt, "num_decode_tokens": output}, chunk.lines)
        self.builder.add(arrival, prompt, output, chunk.lines, keep=keep)

    def finish(self) -> None:
        pass
