"""Writing a trace as canonical CSV, which `read_trace` reads back to the same requests.

    arrival_s,prompt_tokens,output_tokens[,request_id][,hash_ids,hash_block_tokens][,priority]
    0.0,1200,64,a,0 1 2,512

`hash_ids` holds a request's prefix-block hash ids separated by spaces; `hash_block_tokens`
repeats the tokens one id covers (one value per trace). Arrival times are written with the
shortest text that reads back to the same float. A name ending in `.gz` is gzip-compressed.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pandas as pd

from traces.formats import CHUNK_ROWS
from traces.trace import Trace

MAX_IDS_PER_PIECE = 1 << 20  # hash ids formatted as text at a time (about 8 MB of it)


def write_canonical(trace: Trace, out: str | Path, chunk_rows: int = CHUNK_ROWS, *,
                    compress: bool | None = None) -> None:
    """`compress` gzips the file (default: when `out` ends in .gz). An OSError (a full disk) is left
    to the caller: the CLI writes into `sim.app.outputs.atomic_path`, which keeps the old file."""
    out = Path(out)
    if compress is None:
        compress = out.suffix == ".gz"
    opener = gzip.open if compress else open
    with opener(out, "wt", encoding="utf-8", newline="") as handle:
        for i, (start, end) in enumerate(_pieces(trace, chunk_rows)):
            _frame(trace, start, end).to_csv(handle, header=i == 0, index=False, lineterminator="\n")


def write_canonical_chunks(chunks, out: str | Path, *, compress: bool | None = None) -> int:
    """Write traces one after another (a large trace made in pieces, all with the same columns) as
    one canonical CSV, as write_canonical does; returns the rows written."""
    out = Path(out)
    if compress is None:
        compress = out.suffix == ".gz"
    opener = gzip.open if compress else open
    num_rows = 0
    with opener(out, "wt", encoding="utf-8", newline="") as handle:
        for chunk in chunks:
            for start, end in _pieces(chunk, CHUNK_ROWS):
                _frame(chunk, start, end).to_csv(handle, header=num_rows == 0, index=False, lineterminator="\n")
                num_rows += end - start
    return num_rows


def _pieces(trace: Trace, chunk_rows: int) -> list[tuple[int, int]]:
    """Row ranges to format at a time: at most `chunk_rows` rows and, where requests carry hash ids,
    about `max_ids` ids, so that a trace of long multi-turn sessions (each turn repeating the ids of
    the whole conversation) is never held as text all at once. At least one range, and at least
    one row in each."""
    n, max_ids = len(trace), MAX_IDS_PER_PIECE
    if trace.hash_ids is None:
        return [(start, min(start + chunk_rows, n)) for start in range(0, n, chunk_rows)] or [(0, 0)]
    pieces, start, ids = [], 0, 0
    for i, row_ids in enumerate(trace.hash_ids):
        if i > start and (i - start >= chunk_rows or ids + len(row_ids) > max_ids):
            pieces.append((start, i))
            start, ids = i, 0
        ids += len(row_ids)
    pieces.append((start, n))
    return pieces


def _frame(trace: Trace, start: int, end: int) -> pd.DataFrame:
    columns = {
        "arrival_s": trace.arrival_s[start:end],
        "prompt_tokens": trace.prompt_tokens[start:end],
        "output_tokens": trace.output_tokens[start:end],
    }
    if trace.request_ids is not None:
        columns["request_id"] = trace.request_ids[start:end]
    if trace.hash_ids is not None:
        columns["hash_ids"] = [" ".join(map(str, ids.tolist())) for ids in trace.hash_ids[start:end]]
        columns["hash_block_tokens"] = trace.hash_block_tokens
    if trace.priority is not None:
        columns["priority"] = trace.priority[start:end]
    return pd.DataFrame(columns)
