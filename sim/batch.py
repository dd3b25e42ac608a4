"""One engine step's batch: what the policy schedules, what every backend executes.

Per scheduled request: its id, `num_computed_tokens` before the step, the tokens scheduled
this step, its block table and whether it needs logits (a partial prefill chunk does not).
`flatten` lays all scheduled tokens end to end, as a real model runner does:

    requests        A (decode)   B (mid-prompt)        C (new)
    input_ids       [a10       | b4 b5 b6 b7 b8      | c0 c1 c2]
    positions       [10        |  4  5  6  7  8      |  0  1  2]
    query_start_loc [0,          1,                    6,        9]
    seq_lens        [11,         9,                    3]

A token's position is its request's computed count plus its offset in this step's chunk; its
K/V goes to slot `block_table[pos // block_size] * block_size + pos % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


class FlatBatch(NamedTuple):
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32, request i owns rows [qsl[i], qsl[i+1])
    seq_lens: np.ndarray  # [num_reqs] int32, context length after this step
    block_table: np.ndarray  # [num_reqs, max_blocks] int32, padded with 0 past each seq_len
    slot_mapping: np.ndarray  # [num_tokens] int64, where each new K/V is written
    logits_indices: np.ndarray  # [num_logits] int64, rows that get a next-token distribution


@dataclass
class Batch:
    request_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # valid until the step's postprocess
    needs_logits: list[bool] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)
    # Per request, where its token ids come from: a `Request` (anything with token_ids(start, end))
    # or a plain sequence of all its known token ids.
    token_sources: list[Any] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)  # the scheduler's own objects, for postprocess

    def add(self, request_id: str, num_computed: int, num_scheduled: int, block_table: list[int],
            needs_logits: bool, is_decode: bool = False, token_source: Any = None, request: Any = None) -> None:
        self.request_ids.append(request_id)
        self.num_computed_tokens.append(num_computed)
        self.num_scheduled_tokens.append(num_scheduled)
        self.block_tables.append(block_table)
        self.needs_logits.append(needs_logits)
        self.is_decode.append(is_decode)
        self.token_sources.append(token_source)
        self.requests.append(request)

    def __len__(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    def flatten(self, block_size: int) -> FlatBatch:
        """The seven arrays of the step, built with vectorised numpy (no loop over tokens)."""
        num_reqs = len(self)
        num_scheduled = np.asarray(self.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.asarray(self.num_computed_tokens, dtype=np.int64)
        cu_num_tokens = np.cumsum(num_scheduled)
        num_tokens = int(cu_num_tokens[-1]) if num_reqs else 0

        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        query_start_loc[1:] = cu_num_tokens
        # [2, 5, 3] -> req_indices [0, 0, 1, 1, 1, 1, 1, 2, 2, 2], offsets [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
        offsets = np.arange(num_tokens) - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        positions = num_computed[req_indices] + offsets
        seq_lens = (num_computed + num_scheduled).astype(np.int32)

        max_blocks = max((len(t) for t in self.block_tables), default=0)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, table in enumerate(self.block_tables):
            block_table[i, :len(table)] = table
        slot_mapping = (block_table[req_indices, positions // block_size].astype(np.int64) * block_size
                        + positions % block_size)

        input_ids = np.concatenate([
            _token_ids(src, int(c), int(c + n)) for src, c, n in zip(self.token_sources, num_computed, num_scheduled)
        ]) if num_reqs else np.zeros(0, dtype=np.int64)

        logits_indices = (query_start_loc[1:] - 1)[np.asarray(self.needs_logits, dtype=bool)].astype(np.int64)
        return FlatBatch(input_ids.astype(np.int64), positions, query_start_loc, seq_lens, block_table,
                         slot_mapping, logits_indices)


def _token_ids(source: Any, start: int, end: int) -> np.ndarray:
    if hasattr(source, "token_ids"):
        return source.token_ids(start, end)
    return np.asarray(source[start:end], dtype=np.int64)
