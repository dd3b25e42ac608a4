"""Trace readers for the public formats, chosen from the file's first line (or `fmt`).

| format    | first line                                                        | arrival          |
|-----------|-------------------------------------------------------------------|------------------|
| canonical | arrival_s,prompt_tokens,output_tokens[,request_id][,hash_ids,hash_block_tokens] | seconds |
| azure     | TIMESTAMP,ContextTokens,GeneratedTokens (Azure 2023 and 2024)     | date and time    |
| burstgpt  | Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type | seconds       |
| vidur     | arrived_at,num_prefill_tokens,num_decode_tokens (Vidur/Splitwise) | seconds          |
| mooncake  | JSON Lines: timestamp, input_length, output_length, hash_ids      | milliseconds     |

Files are parsed `chunk_rows` rows at a time, so memory beyond the resulting columns stays
bounded; gzip files are read as they are. A byte-order mark, CRLF line ends, blank lines and a
missing final newline are accepted. Every problem is a `ServesimError` naming the file and line.

Rows of the published formats that cannot be replayed (BurstGPT's failed requests have 0
response tokens; a prompt or output of 0 tokens) are dropped, counted in `Trace.dropped` and
warned about. In canonical CSV, servesim's own format, such a row is an error.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import pandas as pd

from sim.errors import ServesimError
from traces.trace import Trace

CHUNK_ROWS = 250_000
MOONCAKE_BLOCK_TOKENS = 512

CANONICAL = ("arrival_s", "prompt_tokens", "output_tokens")
AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT = ("Timestamp", "Model", "Request tokens", "Response tokens")
VIDUR = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
MOONCAKE = ("timestamp", "input_length", "output_length")
CSV_COLUMNS = {"canonical": CANONICAL, "azure": AZURE, "burstgpt": BURSTGPT, "vidur": VIDUR}
FORMATS = ("canonical", "azure", "mooncake", "burstgpt", "vidur")
ALIASES = {"azure2023": "azure", "azure2024": "azure", "splitwise": "vidur", "jsonl": "mooncake"}
# Columns kept as text (the others are left to pandas' fast numeric parsing).
TEXT_COLUMNS = ("request_id", "hash_ids", "TIMESTAMP", "Model", "Log Type")


def read_trace(path: str | Path, fmt: str | None = None, *, model_filter: str | None = None,
               chunk_rows: int = CHUNK_ROWS) -> Trace:
    """Read a trace file in any supported format (detected when `fmt` is None).

    `model_filter` keeps one model of a BurstGPT trace; `chunk_rows` bounds the rows parsed at once.
    """
    path = Path(path)
    if fmt is not None:
        fmt = ALIASES.get(fmt.lower(), fmt.lower())
        if fmt not in FORMATS:
            raise ServesimError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if chunk_rows < 1:
        raise ServesimError(f"chunk_rows must be at least 1, got {chunk_rows}")
    with _open(path) as handle:
        first, first_line = _first_line(path, handle)
        if fmt is None:
            fmt = detect_format(path, first)
        if model_filter is not None and fmt != "burstgpt":
            raise ServesimError(f"{path}: --model-filter applies to BurstGPT traces only (this one is {fmt})")
        builder = _Builder(path, fmt)
        try:
            if fmt == "mooncake":
                _read_mooncake(builder, handle, first, first_line, chunk_rows)
            else:
                _read_csv(builder, handle, first, first_line, chunk_rows, model_filter)
        except (OSError, EOFError, zlib.error) as e:
            raise ServesimError(f"{path}: cannot read: {e}") from None
    return builder.trace()


def detect_format(path: Path, first: str) -> str:
    """The format of a file from its first non-blank line (a CSV header or a JSON object)."""
    if first.lstrip().startswith("{") or _suffix(path) in (".jsonl", ".json"):
        return "mooncake"
    names = set(_header(first))
    overlap = {fmt: len(set(columns) & names) for fmt, columns in CSV_COLUMNS.items()}
    best = max(overlap, key=overlap.get)
    if overlap[best]:
        return best  # a missing column is named when the header is checked
    expected = "; ".join(f"{fmt}: {','.join(cols)}" for fmt, cols in CSV_COLUMNS.items())
    raise ServesimError(f"{path}:1: unknown trace format with columns {first.strip()!r}; expected {expected}, "
                        f"or JSON Lines with {','.join(MOONCAKE)} (or name one with --format)")


# Opening: gzip or plain, first non-blank line, byte-order mark.

def _suffix(path: Path) -> str:
    suffixes = path.suffixes
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
    return suffixes[-1].lower() if suffixes else ""


def _open(path: Path) -> BinaryIO:
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise ServesimError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ServesimError(f"{path}: is a directory, not a trace file") from None
    except OSError as e:
        raise ServesimError(f"{path}: cannot read: {e.strerror}") from None
    is_gzip = handle.read(2) == b"\x1f\x8b"
    if is_gzip:
        handle.close()
        return gzip.open(path, "rb")
    handle.seek(0)
    return handle


def _decode(path: Path, line_no: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError:
        raise ServesimError(f"{path}:{line_no}: not a text file (not UTF-8)") from None


def _first_line(path: Path, handle: BinaryIO) -> tuple[str, int]:
    """The first non-blank line and its number; `handle` is left just after it."""
    line_no = 0
    try:
        for raw in handle:
            line_no += 1
            text = _decode(path, line_no, raw).strip()
            if text:
                return text, line_no
    except (OSError, EOFError, zlib.error) as e:
        raise ServesimError(f"{path}: cannot read: {e}") from None
    raise ServesimError(f"{path}: the file is empty")


def _header(line: str) -> list[str]:
    return [name.strip() for name in next(csv.reader([line]))]


# Accumulating parsed chunks.

@dataclass
class _Builder:
    """Parsed chunks of one file, their dropped rows and the first out-of-order line."""

    path: Path
    fmt: str
    arrival: list[np.ndarray] = field(default_factory=list)  # in units of 1/arrival_per_s seconds
    prompt: list[np.ndarray] = field(default_factory=list)
    output: list[np.ndarray] = field(default_factory=list)
    request_ids: list[str] | None = None
    hash_ids: list[np.ndarray] | None = None
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    arrival_per_s: float = 1.0  # 1e9 for nanosecond stamps, 1e3 for milliseconds
    dropped: dict[str, int] = field(default_factory=dict)
    first_dropped_line: dict[str, int] = field(default_factory=dict)
    last_arrival: float | None = None
    first_unordered_line: int | None = None

    def drop(self, reason: str, mask: np.ndarray, lines: np.ndarray) -> None:
        n = int(mask.sum())
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n
            self.first_dropped_line.setdefault(reason, int(lines[np.argmax(mask)]))

    def add(self, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, lines: np.ndarray) -> None:
        if not len(arrival):
            return
        if self.first_unordered_line is None:
            previous = np.concatenate([[arrival[0] if self.last_arrival is None else self.last_arrival], arrival])
            down = np.diff(previous) < 0
            if down.any():
                self.first_unordered_line = int(lines[np.argmax(down)])
        self.last_arrival = arrival[-1]
        self.arrival.append(arrival)
        self.prompt.append(prompt)
        self.output.append(output)

    def trace(self) -> Trace:
        path = self.path
        warnings = [f"{path}:{self.first_dropped_line[reason]}: dropped {n} request{'s' * (n != 1)} with {reason}"
                    for reason, n in self.dropped.items() if not reason.startswith("model ")]
        if not self.arrival:
            if self.dropped:
                counts = ", ".join(f"{n} with {reason}" for reason, n in self.dropped.items())
                raise ServesimError(f"{path}: no requests left to replay (dropped {counts})")
            raise ServesimError(f"{path}: the trace has a header but no requests")
        arrival = np.concatenate(self.arrival)
        prompt = np.concatenate(self.prompt)
        output = np.concatenate(self.output)
        arrival = (arrival - arrival.min()) / self.arrival_per_s  # exact differences before the division
        request_ids, hash_ids = self.request_ids, self.hash_ids
        if self.first_unordered_line is not None:
            warnings.append(f"{path}:{self.first_unordered_line}: arrivals are out of order; "
                            f"sorted them by arrival time")
            order = np.argsort(arrival, kind="stable")
            arrival, prompt, output = arrival[order], prompt[order], output[order]
            positions = order.tolist()
            if request_ids is not None:
                request_ids = [request_ids[i] for i in positions]
            if hash_ids is not None:
                hash_ids = [hash_ids[i] for i in positions]
        arrival = arrival - arrival[0]
        return Trace(arrival, prompt, output, request_ids, hash_ids, self.hash_block_tokens, source=str(path),
                     format=self.fmt, warnings=warnings, dropped=dict(self.dropped))


# CSV formats.

@dataclass
class _Chunk:
    """One chunk of CSV rows and the file line of each."""

    path: Path
    frame: pd.DataFrame
    lines: np.ndarray  # [rows] int64, 1-based file line of each row

    def where(self, row: int) -> str:
        return f"{self.path}:{int(self.lines[row])}"

    def column(self, name: str) -> pd.Series:
        if name not in self.frame.columns:
            raise ServesimError(f"{self.path}: missing column {name!r} (the header has "
                                f"{','.join(self.frame.columns)})")
        return self.frame[name]

    def text(self, name: str) -> pd.Series:
        return self.column(name).astype(str).str.strip()

    def numbers(self, name: str) -> np.ndarray:
        """A numeric column as float64: every value present, a finite number, not negative."""
        col = self.column(name)
        if pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col):
            values = col.to_numpy(dtype=np.float64)  # pandas parsed every value: none is missing
        else:
            text = col.astype(str).str.strip()
            values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64)
            bad = np.isnan(values)
            if bad.any():
                row = int(np.argmax(bad))
                what = "missing" if text.iloc[row] == "" else f"not a number: {text.iloc[row]!r}"
                raise ServesimError(f"{self.where(row)}: {name} is {what}")
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            row = int(np.argmax(bad))
            what = "must be finite" if not np.isfinite(values[row]) else "must not be negative"
            raise ServesimError(f"{self.where(row)}: {name} {what}, got {col.iloc[row]}")
        return values

    def counts(self, name: str) -> np.ndarray:
        """A token-count column as int64: whole numbers, not negative."""
        values = self.numbers(name)
        frac = values != np.floor(values)
        if frac.any():
            row = int(np.argmax(frac))
            raise ServesimError(f"{self.where(row)}: {name} must be a whole number, got {self.column(name).iloc[row]}")
        return values.astype(np.int64)


def _csv_chunks(path: Path, handle: BinaryIO, header: list[str], header_line: int,
                chunk_rows: int) -> Iterator[_Chunk]:
    """The data rows in chunks, blank lines left out; a row's line is header_line + 1 + its index."""
    text_columns = {name: str for name in header if name in TEXT_COLUMNS}
    try:
        reader = pd.read_csv(handle, header=None, names=header, index_col=False, skip_blank_lines=False,
                             keep_default_na=False, dtype=text_columns,
                             chunksize=chunk_rows, encoding="utf-8")
        for frame in reader:
            frame = _without_blank_rows(frame)
            yield _Chunk(path, frame, frame.index.to_numpy(dtype=np.int64) + header_line + 1)
    except pd.errors.ParserError as e:
        raise ServesimError(_parser_error(path, str(e).strip(), header_line)) from None
    except UnicodeDecodeError:
        raise ServesimError(f"{path}: not a text file (not UTF-8)") from None


def _parser_error(path: Path, message: str, header_line: int) -> str:
    """pandas counts lines from the one after the header; name the file's line instead."""
    m = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", message)
    if m:
        expected, line, saw = (int(g) for g in m.groups())
        return f"{path}:{line + header_line}: expected {expected} fields as in the header, saw {saw}"
    return f"{path}: not a readable CSV file ({message})"


def _without_blank_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows of a blank line have every field empty; a chunk with a numeric column has none."""
    if len(frame.columns) == 0 or any(pd.api.types.is_numeric_dtype(frame[c]) for c in frame.columns):
        return frame
    blank = np.ones(len(frame), dtype=bool)
    for name in frame.columns:
        blank &= (frame[name].astype(str).str.strip() == "").to_numpy()
    return frame[~blank] if blank.any() else frame


def _read_csv(builder: _Builder, handle: BinaryIO, first: str, header_line: int, chunk_rows: int,
              model_filter: str | None) -> None:
    path, fmt = builder.path, builder.fmt
    header = _header(first)
    if len(set(header)) != len(header):
        twice = next(name for name in header if header.count(name) > 1)
        raise ServesimError(f"{path}:{header_line}: column {twice!r} appears twice in the header")
    for name in CSV_COLUMNS[fmt]:
        if name not in header:
            raise ServesimError(f"{path}:{header_line}: missing column {name!r} (the header has {first.strip()})")
    parse = {"canonical": _canonical, "azure": _azure, "vidur": _vidur}.get(fmt)
    models: set[str] = set()
    if fmt == "canonical":
        builder.request_ids = [] if "request_id" in header else None
        builder.hash_ids = [] if "hash_ids" in header else None
        builder.hash_block_tokens = MOONCAKE_BLOCK_TOKENS
    for chunk in _csv_chunks(path, handle, header, header_line, chunk_rows):
        if len(chunk.frame):
            if fmt == "burstgpt":
                _burstgpt(builder, chunk, model_filter, models)
            else:
                parse(builder, chunk)
    if fmt == "canonical" and builder.request_ids is not None:
        _check_unique(path, builder.request_ids)
    if model_filter is not None and not builder.arrival and builder.dropped.get(f"model other than {model_filter}"):
        raise ServesimError(f"{path}: no request of model {model_filter!r}; the trace has "
                            f"{', '.join(sorted(models))}")


def _keep_nonzero(builder: _Builder, chunk: _Chunk, keep: np.ndarray, named: dict[str, np.ndarray]) -> np.ndarray:
    """Drop (and count) rows whose token counts are 0; `named` maps a column name to its counts."""
    for name, values in named.items():
        zero = keep & (values == 0)
        builder.drop(f"0 {name}", zero, chunk.lines)
        keep = keep & ~zero
    return keep


def _add(builder: _Builder, chunk: _Chunk, keep: np.ndarray | None, arrival: np.ndarray, prompt: np.ndarray,
         output: np.ndarray) -> None:
    if keep is None or keep.all():
        builder.add(arrival, prompt, output, chunk.lines)
    else:
        builder.add(arrival[keep], prompt[keep], output[keep], chunk.lines[keep])


def _canonical(builder: _Builder, chunk: _Chunk) -> None:
    arrival = chunk.numbers("arrival_s")
    prompt = chunk.counts("prompt_tokens")
    output = chunk.counts("output_tokens")
    for name, values in (("prompt_tokens", prompt), ("output_tokens", output)):
        if (values < 1).any():
            row = int(np.argmax(values < 1))
            raise ServesimError(f"{chunk.where(row)}: {name} must be a whole number of at least 1, got {values[row]}")
    if builder.request_ids is not None:
        builder.request_ids.extend(chunk.text("request_id").tolist())
    if builder.hash_ids is not None:
        block_tokens = _hash_block_tokens(builder, chunk)
        builder.hash_ids.extend(_parse_hash_ids(chunk, prompt, block_tokens))
    builder.add(arrival, prompt, output, chunk.lines)


def _hash_block_tokens(builder: _Builder, chunk: _Chunk) -> int:
    """The one `hash_block_tokens` of a canonical trace with hash ids (512 when the column is absent)."""
    if "hash_block_tokens" not in chunk.frame.columns:
        return builder.hash_block_tokens
    values = chunk.counts("hash_block_tokens")
    if builder.hash_ids:
        expected = builder.hash_block_tokens
    else:
        expected = int(values[0])
        if expected < 1:
            raise ServesimError(f"{chunk.where(0)}: hash_block_tokens must be at least 1, got {expected}")
        builder.hash_block_tokens = expected
    differs = values != expected
    if differs.any():
        row = int(np.argmax(differs))
        raise ServesimError(f"{chunk.where(row)}: hash_block_tokens is {values[row]}, but earlier lines have "
                            f"{expected}; a trace has one hash block size")
    return expected


def _parse_hash_ids(chunk: _Chunk, prompt: np.ndarray, block_tokens: int) -> list[np.ndarray]:
    """Space-separated hash ids, one per `block_tokens` prompt tokens."""
    out = []
    texts = chunk.text("hash_ids").tolist()
    needed = -(-prompt // block_tokens)
    for row, text in enumerate(texts):
        try:
            ids = np.array(text.split(), dtype=np.int64)
        except (ValueError, OverflowError):
            raise ServesimError(f"{chunk.where(row)}: hash_ids must be whole numbers separated by spaces, "
                                f"got {text[:60]!r}") from None
        _check_hash_ids(chunk.where(row), ids, int(prompt[row]), int(needed[row]), block_tokens, "prompt_tokens")
        out.append(ids[:needed[row]])
    return out


def _check_hash_ids(where: str, ids: np.ndarray, prompt: int, needed: int, block_tokens: int,
                    prompt_name: str) -> None:
    if len(ids) < needed:
        raise ServesimError(f"{where}: {len(ids)} hash_ids cannot cover {prompt_name} {prompt}: it needs "
                            f"{needed}, one per {block_tokens} tokens")
    if len(ids) and ids.min() < 0:
        raise ServesimError(f"{where}: hash_ids must not be negative, got {int(ids.min())}")


def _check_unique(path: Path, request_ids: list[str]) -> None:
    if len(set(request_ids)) == len(request_ids):
        return
    seen: set[str] = set()
    for rid in request_ids:
        if rid in seen:
            raise ServesimError(f"{path}: request_id {rid!r} appears twice")
        seen.add(rid)


def _azure(builder: _Builder, chunk: _Chunk) -> None:
    stamps = chunk.text("TIMESTAMP")
    times = pd.to_datetime(stamps, format="ISO8601", errors="coerce", utc=True)
    bad = times.isna().to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        raise ServesimError(f"{chunk.where(row)}: TIMESTAMP {stamps.iloc[row]!r} is not a date and time")
    ns = times.dt.tz_localize(None).to_numpy().astype("datetime64[ns]").astype(np.int64)
    builder.arrival_per_s = 1e9
    prompt = chunk.counts("ContextTokens")
    output = chunk.counts("GeneratedTokens")
    keep = _keep_nonzero(builder, chunk, np.ones(len(ns), dtype=bool),
                         {"ContextTokens": prompt, "GeneratedTokens": output})
    _add(builder, chunk, keep, ns, prompt, output)


def _burstgpt(builder: _Builder, chunk: _Chunk, model_filter: str | None, models: set[str]) -> None:
    arrival = chunk.numbers("Timestamp")
    prompt = chunk.counts("Request tokens")
    output = chunk.counts("Response tokens")
    keep = np.ones(len(arrival), dtype=bool)
    if model_filter is not None:
        model = chunk.text("Model")
        models.update(model.unique().tolist())
        other = (model.str.lower() != model_filter.lower()).to_numpy()
        builder.drop(f"model other than {model_filter}", other, chunk.lines)
        keep &= ~other
    failed = keep & (output == 0)
    builder.drop("0 Response tokens (failed)", failed, chunk.lines)
    keep &= ~failed
    keep = _keep_nonzero(builder, chunk, keep, {"Request tokens": prompt})
    _add(builder, chunk, keep, arrival, prompt, output)


def _vidur(builder: _Builder, chunk: _Chunk) -> None:
    arrival = chunk.numbers("arrived_at")
    prompt = chunk.counts("num_prefill_tokens")
    output = chunk.counts("num_decode_tokens")
    keep = _keep_nonzero(builder, chunk, np.ones(len(arrival), dtype=bool),
                         {"num_prefill_tokens": prompt, "num_decode_tokens": output})
    _add(builder, chunk, keep, arrival, prompt, output)


# Mooncake JSON Lines.

def _read_mooncake(builder: _Builder, handle: BinaryIO, first: str, first_line: int, chunk_rows: int) -> None:
    path = builder.path
    builder.hash_block_tokens = MOONCAKE_BLOCK_TOKENS
    builder.arrival_per_s = 1e3
    rows: list[tuple[float, int, int, int]] = []  # (timestamp_ms, prompt, output, line)
    has_hashes: bool | None = None

    def flush() -> None:
        if rows:
            arrival, prompt, output, lines = (np.array(col) for col in zip(*rows))
            builder.add(arrival.astype(np.float64), prompt.astype(np.int64), output.astype(np.int64),
                        lines.astype(np.int64))
            rows.clear()

    def numbered_lines() -> Iterator[tuple[int, str]]:
        yield first_line, first
        for line_no, raw in enumerate(handle, start=first_line + 1):
            yield line_no, _decode(path, line_no, raw)

    for line_no, text in numbered_lines():
        text = text.strip()
        if not text:
            continue
        where = f"{path}:{line_no}"
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise ServesimError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise ServesimError(f"{where}: expected a JSON object with {', '.join(MOONCAKE)}, got {text[:40]!r}")
        for name in MOONCAKE:
            if name not in record:
                raise ServesimError(f"{where}: missing field {name!r}")
        timestamp_ms = _json_number(where, record, "timestamp", whole=False)
        prompt = _json_number(where, record, "input_length", whole=True)
        output = _json_number(where, record, "output_length", whole=True)
        if has_hashes is None:
            has_hashes = "hash_ids" in record
            builder.hash_ids = [] if has_hashes else None
        if has_hashes:
            ids = record.get("hash_ids")
            if ids is None:
                raise ServesimError(f"{where}: missing field 'hash_ids' (earlier lines have it)")
            array = np.array(ids) if isinstance(ids, list) else None
            if array is None or (len(array) and array.dtype.kind not in "iu"):
                raise ServesimError(f"{where}: hash_ids must be a list of whole numbers, got {str(ids)[:40]}")
            needed = -(-prompt // MOONCAKE_BLOCK_TOKENS)
            _check_hash_ids(where, array, prompt, needed, MOONCAKE_BLOCK_TOKENS, "input_length")
        line = np.array([line_no])
        if prompt == 0 or output == 0:
            name = "input_length" if prompt == 0 else "output_length"
            builder.drop(f"0 {name}", np.array([True]), line)
            continue
        if has_hashes:
            builder.hash_ids.append(array[:needed].astype(np.int64))
        rows.append((timestamp_ms, prompt, output, line_no))
        if len(rows) >= chunk_rows:
            flush()
    flush()


def _json_number(where: str, record: dict, name: str, whole: bool):
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ServesimError(f"{where}: {name} must be a number, got {json.dumps(value)[:40]}")
    if not np.isfinite(value):
        raise ServesimError(f"{where}: {name} must be finite, got {value}")
    if value < 0:
        raise ServesimError(f"{where}: {name} must not be negative, got {value}")
    if whole:
        if value != int(value):
            raise ServesimError(f"{where}: {name} must be a whole number, got {value}")
        return int(value)
    return value
