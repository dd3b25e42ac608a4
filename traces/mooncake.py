"""Mooncake's JSON Lines traces: one object per line with `timestamp` (milliseconds),
`input_length`, `output_length` and `hash_ids`, one id per 512 prompt tokens."""

from __future__ import annotations

import json
from typing import BinaryIO

import numpy as np

from sim.errors import ServesimError
from traces.builder import TraceBuilder, check_hash_ids
from traces.formats import MOONCAKE, MOONCAKE_BLOCK_TOKENS, json_count, json_line, json_number
from traces.textfile import text_lines


def read_mooncake(builder: TraceBuilder, handle: BinaryIO, first: str, first_line: int, chunk_rows: int) -> None:
    path = builder.path
    builder.hash_block_tokens = MOONCAKE_BLOCK_TOKENS
    builder.arrival_per_s = 1e3
    rows: list[tuple[float, int, int, int]] = []  # (timestamp_ms, prompt, output, line)
    hashes: list[np.ndarray] = []
    has_hashes: bool | None = None
    first_where = ""  # the first record's place, which decides whether lines have hash_ids

    def flush() -> None:
        if rows:
            arrival, prompt, output, lines = (np.array(col) for col in zip(*rows))
            builder.add(arrival.astype(np.float64), prompt.astype(np.int64), output.astype(np.int64),
                        lines.astype(np.int64), hash_ids=list(hashes) if has_hashes else None)
            rows.clear()
            hashes.clear()

    for where, line_no, text in text_lines(path, handle, first, first_line):
        record = json_line(where, text)
        if not isinstance(record, dict):
            raise ServesimError(f"{where}: expected a JSON object with {', '.join(MOONCAKE)}, got {text[:40]!r}")
        for name in MOONCAKE:
            if name not in record:
                raise ServesimError(f"{where}: missing field {name!r}")
        timestamp_ms = json_number(where, "timestamp", record["timestamp"])
        prompt = json_count(where, "input_length", record["input_length"])
        output = json_count(where, "output_length", record["output_length"])
        if has_hashes is None:
            has_hashes = "hash_ids" in record
            builder.hash_ids = [] if has_hashes else None
            first_where = where
        elif not has_hashes and "hash_ids" in record:
            # (found by a review with odd traces: a later line's hash_ids were dropped without a word)
            raise ServesimError(f"{where}: has hash_ids and {first_where} has none: give every line hash_ids, or "
                                "none")
        if has_hashes:
            if "hash_ids" not in record:
                raise ServesimError(f"{where}: missing field 'hash_ids' (earlier lines have it)")
            array = _whole_numbers(record["hash_ids"])
            if array is None:
                raise ServesimError(f"{where}: hash_ids must be a list of whole numbers, each a 64-bit integer, "
                                    f"got {_short(record['hash_ids'])}")
            check_hash_ids(where, array, prompt, MOONCAKE_BLOCK_TOKENS, "input_length")
        if prompt == 0 or output == 0:
            name = "input_length" if prompt == 0 else "output_length"
            builder.drop(f"0 {name}", np.array([True]), np.array([line_no]))
            continue
        if has_hashes:
            hashes.append(array.astype(np.int64))
        rows.append((timestamp_ms, prompt, output, line_no))
        if len(rows) >= chunk_rows:
            flush()
    flush()



def _whole_numbers(ids) -> np.ndarray | None:
    """A JSON list of whole numbers as an array; None for anything else (null, a nested list)."""
    if not isinstance(ids, list):
        return None
    try:
        array = np.array(ids)
    except (ValueError, TypeError, OverflowError, RecursionError):  # lists of different lengths, too deep
        return None
    if array.ndim != 1 or (len(array) and array.dtype.kind not in "iu"):
        return None
    return array


def _short(value) -> str:
    """The start of a JSON value, for a message."""
    try:
        return json.dumps(value)[:40]
    except RecursionError:
        return "a list nested too deeply"
