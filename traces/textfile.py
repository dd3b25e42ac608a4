"""Opening a trace file: a regular file, gzip or plain, UTF-8 with an optional byte-order mark,
LF, CRLF or CR-only (old Mac) line ends, the first non-blank line. Every problem is a
`ServesimError` naming the file (and line)."""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from sim.errors import ServesimError

# What a truncated or corrupt gzip stream raises while it is read.
READ_ERRORS = (OSError, EOFError, zlib.error)

# How much is read to look at a file's start: its line ends, a CSV header. A longer first line is
# a JSON document (read up to JSON_LINE_BYTES) or not a trace.
HEAD_BYTES = 1 << 20
# The longest first line read: a vLLM bench result saved on one line (vllm_bench.MAX_BYTES).
JSON_LINE_BYTES = 2**31


# Compressed files servesim does not read, by their magic numbers
# (bzip2's: "BZh", the block size's digit and the first block's magic, which begins "1AY")
COMPRESSED = ((re.compile(rb"\xfd7zXZ\x00"), "an xz-compressed"), (re.compile(rb"BZh[1-9]1AY"), "a bzip2-compressed"),
              (re.compile(rb"PK\x03\x04"), "a zip"), (re.compile(rb"\x28\xb5\x2f\xfd"), "a zstd-compressed"),
              (re.compile(rb"\x04\x22\x4d\x18"), "an lz4-compressed"))


def open_trace(path: Path) -> BinaryIO:
    """The file's bytes, gunzipped when it starts with gzip's magic number, CR line ends read as LF."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ServesimError(f"{path}: no such file") from None
    except OSError as e:
        raise ServesimError(f"{path}: cannot read: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ServesimError(f"{path}: is a directory, not a trace file")
    if not stat.S_ISREG(mode):  # a pipe cannot seek back, a FIFO may never end, /dev/zero never does
        raise ServesimError(f"{path}: not a regular file (a pipe, a device...); save the trace to a file first")
    try:
        handle = open(path, "rb")  # noqa: SIM115 (returned to the caller, who closes it)
    except OSError as e:
        raise ServesimError(f"{path}: cannot read: {e.strerror}") from None
    try:
        magic = handle.read(8)
        if magic[:2] == b"\x1f\x8b":
            handle.close()
            handle = gzip.open(path, "rb")
        else:
            packed = next((name for start, name in COMPRESSED if start.match(magic)), None)
            if packed is not None:  # (else read as text: "not UTF-8", which says nothing of why)
                handle.close()
                raise ServesimError(f"{path}: {packed} file; servesim reads a trace as plain text or gzip: "
                                    "decompress it first")
        handle.seek(0)
        head = handle.read(HEAD_BYTES)
        handle.seek(0)
    except READ_ERRORS as e:
        handle.close()
        raise ServesimError(f"{path}: cannot read: {e}") from None
    if b"\r" in head and b"\n" not in head:
        return io.BufferedReader(_CrAsLf(handle), buffer_size=HEAD_BYTES)
    return handle


class _CrAsLf(io.RawIOBase):
    """A file whose lines end in CR alone, read with LF instead (byte for byte: offsets are the same)."""

    def __init__(self, handle: BinaryIO):
        self.handle = handle

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.handle.read(len(buffer)).replace(b"\r", b"\n")
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.handle.seek(offset, whence)

    def tell(self) -> int:
        return self.handle.tell()

    def close(self) -> None:
        self.handle.close()
        super().close()


def decode(path: Path, line_no: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
    except UnicodeDecodeError:
        raise ServesimError(f"{path}:{line_no}: not a text file (not UTF-8)") from None


def text_lines(path: Path, handle: BinaryIO, first: str, first_line: int) -> Iterator[tuple[str, int, str]]:
    """The non-blank lines of a line-per-record file from its first (`first`, read at `first_line`) on: each as
    (file:line, line number, the line stripped), the bytes decoded as `decode` does."""
    where_path = str(path)  # (formatting a Path on every line costs more than the line's checks)
    text = first.strip()
    if text:
        yield f"{where_path}:{first_line}", first_line, text
    for line_no, raw in enumerate(handle, start=first_line + 1):
        text = decode(path, line_no, raw).strip()
        if text:
            yield f"{where_path}:{line_no}", line_no, text


def first_line(path: Path, handle: BinaryIO) -> tuple[str, int]:
    """The first non-blank line and its number; `handle` is left just after it. A line is read
    whole only if it opens a JSON document: a CSV header is short."""
    line_no = 0
    try:
        while raw := handle.readline(HEAD_BYTES):
            line_no += 1
            if len(raw) == HEAD_BYTES and not raw.endswith(b"\n"):
                raw = _long_line(path, line_no, handle, raw)
            text = decode(path, line_no, raw).strip()
            if text:
                return text, line_no
    except READ_ERRORS as e:
        raise ServesimError(f"{path}: cannot read: {e}") from None
    raise ServesimError(f"{path}: the file is empty")


def _long_line(path: Path, line_no: int, handle: BinaryIO, start: bytes) -> bytes:
    """The rest of a line longer than HEAD_BYTES: a JSON document's, else refused."""
    if not start.lstrip(b"\xef\xbb\xbf \t\r").startswith(b"{"):
        raise ServesimError(f"{path}:{line_no}: the line is longer than {HEAD_BYTES:,} bytes: not a CSV header "
                            f"or JSON (or the file has no line ends)")
    raw = start + handle.readline(JSON_LINE_BYTES - len(start))
    if len(raw) == JSON_LINE_BYTES and not raw.endswith(b"\n"):
        raise ServesimError(f"{path}:{line_no}: the line is longer than {JSON_LINE_BYTES:,} bytes: not a trace")
    return raw
