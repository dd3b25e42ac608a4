"""Trace readers, chosen from the file's header.

- canonical CSV: `arrival_s,prompt_tokens,output_tokens` with an optional `request_id`.
- Azure LLM inference 2023/2024: `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock
  timestamps (7-digit fractions), CRLF line ends, often no final newline.

Every problem is reported as a `ServesimError` naming the file and line.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd

from sim.errors import ServesimError
from traces.trace import Trace

CANONICAL = ("arrival_s", "prompt_tokens", "output_tokens")
AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
FORMATS = ("canonical", "azure")


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ServesimError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ServesimError(f"{path}: is a directory, not a trace file") from None
    except OSError as e:
        raise ServesimError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ServesimError(f"{path}: not a text file (not UTF-8)") from None


def detect_format(header: list[str]) -> str | None:
    names = set(header)
    if set(CANONICAL) <= names:
        return "canonical"
    if set(AZURE) <= names:
        return "azure"
    return None


def read_trace(path: str | Path, fmt: str | None = None) -> Trace:
    path = Path(path)
    text = _read_text(path)
    if not text.strip():
        raise ServesimError(f"{path}: the file is empty")
    try:
        frame = pd.read_csv(io.StringIO(text), dtype=str, skip_blank_lines=True, keep_default_na=False)
    except pd.errors.ParserError as e:
        raise ServesimError(f"{path}: not a readable CSV file ({str(e).strip()})") from None
    header = [c.strip() for c in frame.columns]
    frame.columns = header
    detected = detect_format(header)
    fmt = fmt or detected
    if fmt is None:
        raise ServesimError(
            f"{path}: unknown trace format with columns {','.join(header)}; expected "
            f"{','.join(CANONICAL)}[,request_id] or {','.join(AZURE)}")
    if fmt not in FORMATS:
        raise ServesimError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "canonical":
        return _canonical(path, frame)
    return _azure(path, frame)


def _column(path: Path, frame: pd.DataFrame, name: str) -> pd.Series:
    if name not in frame.columns:
        raise ServesimError(f"{path}: missing column {name!r} (line 1 has {','.join(frame.columns)})")
    return frame[name].str.strip()


def _numbers(path: Path, frame: pd.DataFrame, name: str, integer: bool) -> np.ndarray:
    """A numeric column; names the first line (1-based, header is line 1) that is missing,
    not a number, negative or, for token counts, below 1."""
    col = _column(path, frame, name)
    values = pd.to_numeric(col, errors="coerce")
    bad = values.isna().to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        what = "missing" if col.iloc[row] == "" else f"not a number: {col.iloc[row]!r}"
        raise ServesimError(f"{path}:{row + 2}: {name} is {what}")
    array = values.to_numpy(dtype=np.float64)
    if integer:
        low = array < 1
        if low.any():
            row = int(np.argmax(low))
            raise ServesimError(f"{path}:{row + 2}: {name} must be a whole number of at least 1, got {col.iloc[row]}")
        frac = array != np.floor(array)
        if frac.any():
            row = int(np.argmax(frac))
            raise ServesimError(f"{path}:{row + 2}: {name} must be a whole number, got {col.iloc[row]}")
        return array.astype(np.int64)
    negative = array < 0
    if negative.any():
        row = int(np.argmax(negative))
        raise ServesimError(f"{path}:{row + 2}: {name} must not be negative, got {col.iloc[row]}")
    if not np.isfinite(array).all():
        row = int(np.argmax(~np.isfinite(array)))
        raise ServesimError(f"{path}:{row + 2}: {name} must be finite, got {col.iloc[row]}")
    return array


def _finish(path: Path, fmt: str, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray,
            request_ids: list[str] | None) -> Trace:
    if len(arrival) == 0:
        raise ServesimError(f"{path}: the trace has a header but no requests")
    warnings = []
    order = np.argsort(arrival, kind="stable")
    if (np.diff(arrival) < 0).any():
        first = int(np.argmax(np.diff(arrival) < 0)) + 1
        warnings.append(f"{path}:{first + 2}: arrivals are out of order; sorted them by arrival time")
        arrival, prompt, output = arrival[order], prompt[order], output[order]
        if request_ids is not None:
            request_ids = [request_ids[i] for i in order]
    arrival = arrival - arrival[0]
    return Trace(arrival, prompt, output, request_ids, source=str(path), format=fmt, warnings=warnings)


def _canonical(path: Path, frame: pd.DataFrame) -> Trace:
    arrival = _numbers(path, frame, "arrival_s", integer=False)
    prompt = _numbers(path, frame, "prompt_tokens", integer=True)
    output = _numbers(path, frame, "output_tokens", integer=True)
    request_ids = None
    if "request_id" in frame.columns:
        request_ids = frame["request_id"].str.strip().tolist()
        if len(set(request_ids)) != len(request_ids):
            seen: set[str] = set()
            for row, rid in enumerate(request_ids):
                if rid in seen:
                    raise ServesimError(f"{path}:{row + 2}: request_id {rid!r} appears twice")
                seen.add(rid)
    trace = _finish(path, "canonical", arrival, prompt, output, request_ids)
    return trace


def _azure(path: Path, frame: pd.DataFrame) -> Trace:
    stamps = _column(path, frame, "TIMESTAMP")
    times = pd.to_datetime(stamps, format="ISO8601", errors="coerce", utc=True)
    bad = times.isna().to_numpy()
    if bad.any():
        row = int(np.argmax(bad))
        raise ServesimError(f"{path}:{row + 2}: TIMESTAMP {stamps.iloc[row]!r} is not a date and time")
    ns = times.astype("int64").to_numpy()
    arrival = (ns - ns.min()) / 1e9
    prompt = _numbers(path, frame, "ContextTokens", integer=True)
    output = _numbers(path, frame, "GeneratedTokens", integer=True)
    return _finish(path, "azure", arrival, prompt, output, None)
