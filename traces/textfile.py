"""Opening a trace file: gzip or plain, UTF-8 with an optional byte-order mark, the first
non-blank line. Every problem is a `ServesimError` naming the file (and line)."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import BinaryIO

from sim.errors import ServesimError

# What a truncated or corrupt gzip stream raises while it is read.
READ_ERRORS = (OSError, EOFError, zlib.error)


def open_trace(path: Path) -> BinaryIO:
    """The file's bytes, gunzipped when it starts with gzip's magic number."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 (returned to the caller, who closes it)
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


def decode(path: Path, line_no: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError:
        raise ServesimError(f"{path}:{line_no}: not a text file (not UTF-8)") from None


def first_line(path: Path, handle: BinaryIO) -> tuple[str, int]:
    """The first non-blank line and its number; `handle` is left just after it."""
    line_no = 0
    try:
        for raw in handle:
            line_no += 1
            text = decode(path, line_no, raw).strip()
            if text:
                return text, line_no
    except READ_ERRORS as e:
        raise ServesimError(f"{path}: cannot read: {e}") from None
    raise ServesimError(f"{path}: the file is empty")
