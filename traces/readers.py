"""Reading a trace file in any supported format (`traces.formats` lists them), chosen from the
file's first line or named.

Files are parsed `chunk_rows` rows at a time, so memory beyond the resulting columns stays
bounded; gzip files are read as they are. A byte-order mark, CRLF or CR-only line ends, blank lines and a
missing final newline are accepted. Every problem is a `ServesimError` naming the file and line:
a token count above 2**31, a trace spanning more than 1e9 s, a row with a field too many.

Rows that cannot be replayed (a prompt or output of 0 tokens; BurstGPT's failed requests) are
dropped, counted in `Trace.dropped` and warned about, in every format.

| module         | reads                                                  |
|----------------|--------------------------------------------------------|
| textfile.py    | gzip or plain, UTF-8, the first non-blank line         |
| formats.py     | format names, columns, detection, limits               |
| csv_rows.py    | CSV in chunks, numeric checks with file:line           |
| canonical.py   | servesim's canonical CSV (with prefix hash ids)        |
| published.py   | Azure 2023/2024, BurstGPT, Vidur/Splitwise CSV         |
| mooncake.py    | Mooncake JSON Lines                                    |
| vllm_bench.py  | vLLM's `bench serve` result JSON (per-request starts)  |
| aiperf.py      | AIPerf's profile_export.jsonl (a record per request)   |
| builder.py     | the chunks into one `Trace`: drops, order, span        |

pandas parses the CSV formats (csv_rows.py), imported on first use; a clean Azure file
(published.read_plain_azure) and Mooncake's JSON Lines are read without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from sim.errors import ServesimError
from traces.aiperf import read_aiperf
from traces.builder import TraceBuilder
from traces.canonical import CanonicalRows
from traces.csv_rows import csv_chunks
from traces.formats import (
    CANONICAL_READ,
    CHUNK_ROWS,
    CSV_COLUMNS,
    FORMATS,
    detect_format,
    format_name,
    header,
)
from traces.mooncake import read_mooncake
from traces.published import AzureRows, BurstGptRows, VidurRows, read_plain_azure
from traces.textfile import READ_ERRORS, first_line, open_trace
from traces.trace import Trace
from traces.vllm_bench import read_vllm_bench

__all__ = ["CHUNK_ROWS", "FORMATS", "detect_format", "read_trace"]

# The column (or field) of each format's arrival time, as messages name it.
ARRIVAL = {"canonical": "arrival_s", "azure": "TIMESTAMP", "burstgpt": "Timestamp", "vidur": "arrived_at",
           "mooncake": "timestamp", "vllm-bench": "start_times",
           "aiperf": "request_start_ns"}


def read_trace(path: str | Path, fmt: str | None = None, *, model_filter: str | None = None,
               chunk_rows: int = CHUNK_ROWS) -> Trace:
    """Read a trace file in any supported format (detected when `fmt` is None).

    `model_filter` keeps one model of a BurstGPT trace; `chunk_rows` bounds the rows parsed at once.
    """
    path = Path(path)
    if fmt is not None:
        fmt = format_name(fmt)
    if chunk_rows < 1:
        raise ServesimError(f"chunk_rows must be at least 1, got {chunk_rows}")
    with open_trace(path) as handle:
        first, first_line_no = first_line(path, handle)
        if fmt is None:
            fmt = detect_format(path, first)
        if model_filter is not None and fmt != "burstgpt":
            raise ServesimError(f"{path}: --model-filter applies to BurstGPT traces only (this one is {fmt})")
        builder = TraceBuilder(path, fmt, ARRIVAL[fmt])
        try:
            if fmt == "mooncake":
                read_mooncake(builder, handle, first, first_line_no, chunk_rows)
            elif fmt == "vllm-bench":
                read_vllm_bench(builder, handle, first, first_line_no)
            elif fmt == "aiperf":
                read_aiperf(builder, handle, first, first_line_no)
            else:
                _read_csv(builder, handle, first, first_line_no, chunk_rows, model_filter)
        except READ_ERRORS as e:
            raise ServesimError(f"{path}: cannot read: {e}") from None
    return builder.trace()


def _read_csv(builder: TraceBuilder, handle: BinaryIO, first: str, header_line: int, chunk_rows: int,
              model_filter: str | None) -> None:
    path, fmt = builder.path, builder.fmt
    if "\r" in first:
        raise ServesimError(f"{path}:{header_line}: a carriage return (CR) inside the header line; "
                            f"save the file with one kind of line end")
    names = header(first)
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ServesimError(f"{path}:{header_line}: column {twice!r} appears twice in the header")
    for name in CSV_COLUMNS[fmt]:
        if name not in names:
            raise ServesimError(f"{path}:{header_line}: missing column {name!r} (the header has {first.strip()[:200]})")
    if fmt == "azure" and read_plain_azure(builder, handle, names, header_line, chunk_rows):
        return  # a clean file, read without pandas
    if fmt == "canonical":
        unread = [name for name in names if name not in CANONICAL_READ]
        if unread:  # a misspelt optional column ("priorty") would otherwise be read as absent
            builder.warnings.append(f"{path}:{header_line}: column{'s' * (len(unread) != 1)} "
                                    f"{', '.join(map(repr, unread[:5]))}{', ...' if len(unread) > 5 else ''} not read; "
                                    f"a canonical trace's columns are {', '.join(CANONICAL_READ)}")
        if ("hash_ids" in names) != ("hash_block_tokens" in names):
            builder.warnings.append(
                f"{path}:{header_line}: hash_ids without hash_block_tokens: each hash taken for a block of "
                f"{builder.hash_block_tokens} tokens (Mooncake's)" if "hash_ids" in names else
                f"{path}:{header_line}: hash_block_tokens without hash_ids: no prefix to share, the column is not read")
        rows = CanonicalRows(builder, names)
    elif fmt == "azure":
        rows = AzureRows(builder)
    elif fmt == "burstgpt":
        rows = BurstGptRows(builder, model_filter)
    else:
        rows = VidurRows(builder)
    for chunk in csv_chunks(path, handle, names, header_line, chunk_rows):
        if len(chunk.frame):
            rows.add(chunk)
    rows.finish()
