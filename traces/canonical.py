"""Rows of canonical CSV, servesim's own format (what `sim trace convert` and `synth` write):

    arrival_s,prompt_tokens,output_tokens[,request_id][,hash_ids,hash_block_tokens][,priority]
    0.0,1200,64,a,0 1 2,512,0

`hash_ids` holds a request's prefix-block hash ids separated by spaces, exactly one per
`hash_block_tokens` prompt tokens (512 when that column is absent; one value per trace).
`priority` (a whole number, lower served first) is read by `--scheduling-policy priority`.
A row with a 0-token prompt or output is dropped and counted, as in the published formats.
"""

from __future__ import annotations

import numpy as np

from sim.errors import ServesimError
from traces.builder import TraceBuilder, check_hash_ids
from traces.csv_rows import Chunk


class CanonicalRows:
    def __init__(self, builder: TraceBuilder, header: list[str]):
        self.builder = builder
        self.has_ids = "request_id" in header
        self.has_hashes = "hash_ids" in header
        self.block_tokens_seen = False
        builder.request_ids = [] if self.has_ids else None
        builder.hash_ids = [] if self.has_hashes else None
        self.has_priority = "priority" in header
        self.id_lines: dict[str, int] = {}  # each request_id's line
        builder.priority = [] if self.has_priority else None

    def add(self, chunk: Chunk) -> None:
        builder = self.builder
        arrival = chunk.numbers("arrival_s")
        prompt = chunk.counts("prompt_tokens")
        output = chunk.counts("output_tokens")
        request_ids = chunk.text("request_id").tolist() if self.has_ids else None
        if request_ids is not None:  # each id once, the second named by its line and the first's
            first_line = self.id_lines
            for rid, line in zip(request_ids, chunk.lines.tolist()):
                if first_line.setdefault(rid, line) != line:
                    raise ServesimError(f"{builder.at(line)}: request_id {rid!r} appears twice (first at line "
                                        f"{first_line[rid]})")
        hash_ids = None
        if self.has_hashes:
            hash_ids = _parse_hash_ids(chunk, prompt, self._hash_block_tokens(chunk))
        keep = builder.keep_nonzero(np.ones(len(arrival), dtype=bool),
                                    {"prompt_tokens": prompt, "output_tokens": output}, chunk.lines)
        priority = _parse_priority(chunk) if self.has_priority else None
        builder.add(arrival, prompt, output, chunk.lines, keep=keep, request_ids=request_ids, hash_ids=hash_ids,
                    priority=priority)

    def finish(self) -> None:
        pass  # (each request_id is checked once as its row is read: `add`)

    def _hash_block_tokens(self, chunk: Chunk) -> int:
        """The one `hash_block_tokens` of the trace, set by its first row."""
        builder = self.builder
        if "hash_block_tokens" not in chunk.frame.columns:
            return builder.hash_block_tokens
        values = chunk.counts("hash_block_tokens")
        if not self.block_tokens_seen:
            if values[0] < 1:
                raise ServesimError(f"{chunk.where(0)}: hash_block_tokens must be at least 1, got {values[0]}")
            builder.hash_block_tokens = int(values[0])
            self.block_tokens_seen = True
        expected = builder.hash_block_tokens
        differs = values != expected
        if differs.any():
            row = int(np.argmax(differs))
            raise ServesimError(f"{chunk.where(row)}: hash_block_tokens is {values[row]}, but earlier lines have "
                                f"{expected}; a trace has one hash block size")
        return expected


def _parse_hash_ids(chunk: Chunk, prompt: np.ndarray, block_tokens: int) -> list[np.ndarray]:
    """Space-separated hash ids, one per `block_tokens` prompt tokens."""
    out = []
    for row, text in enumerate(chunk.text("hash_ids").tolist()):
        try:
            ids = np.array(text.split(), dtype=np.int64)
        except (ValueError, OverflowError):
            raise ServesimError(f"{chunk.where(row)}: hash_ids must be whole numbers separated by spaces, "
                                f"got {text[:60]!r}") from None
        check_hash_ids(chunk.where(row), ids, int(prompt[row]), block_tokens, "prompt_tokens")
        out.append(ids)
    return out


def _parse_priority(chunk: Chunk) -> np.ndarray:
    """Whole numbers, negative ones too (vLLM's priority is any int)."""
    import pandas as pd

    text = chunk.text("priority")
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values) | (values != np.floor(values)) | (np.abs(values) > 2**62)
    if bad.any():
        row = int(np.argmax(bad))
        value = values[row]
        what = ("a whole number of at most 2**62 in size" if np.isfinite(value) and value == np.floor(value)
                else "a whole number")  # (a whole number too large for a 64-bit integer is still whole)
        raise ServesimError(f"{chunk.where(row)}: priority must be {what}, got {text.iloc[row]!r}")
    return values.astype(np.int64)
