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


def write_canonical(trace: Trace, out: str | Path, chunk_rows: int = CHUNK_ROWS, *,
                    compress: bool | None = None) -> None:
    """`compress` gzips the file (default: when `out` ends in .gz). An OSError (a full disk) is left
    to the caller: the CLI writes into `sim.app.outputs.atomic_path`, which keeps the old file."""
    out = Path(out)
    if compress is None:
        compress = out.suffix == ".gz"
    opener = gzip.open if compress else open
    with opener(out, "wt", encoding="utf-8", newline="") as handle:
        for start in range(0, max(len(trace), 1), chunk_rows):
            _frame(trace, start, start + chunk_rows).to_csv(handle, header=start == 0, index=False,
                                                            lineterminator="\n")


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
            _frame(chunk, 0, len(chunk)).to_csv(handle, header=num_rows == 0, index=False, lineterminator="\n")
            num_rows += len(chunk)
    return num_rows


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
