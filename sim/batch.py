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

from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np


class FlatBatch(NamedTuple):
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32, request i owns rows [qsl[i], qsl[i+1])
    seq_lens: np.ndarray  # [num_reqs] int32, context length after this step
    block_table: np.ndarray  # [num_reqs, max_blocks] int32, padded with 0 past each seq_len
    slot_mapping: np.ndarray  # [num_tokens] int64, where each new K/V is written
    logits_indices: np.ndarray  # [num_logits] int64, rows that get a next-token distribution


@runtime_checkable
class TokenSource(Protocol):
    def token_ids(self, start: int, end: int) -> np.ndarray: ...


class _Entry:
    """A scheduled request given by hand (tests, calibration grids): what a `Request` provides."""

    __slots__ = ("request_id", "block_table", "token_source")

    def __init__(self, request_id: str, block_table: list[int], token_source: Any):
        self.request_id, self.block_table, self.token_source = request_id, block_table, token_source

    def token_ids(self, start: int, end: int, spec=None) -> np.ndarray:
        src = self.token_source
        if src is None:
            raise ValueError(f"request {self.request_id!r} was added to the batch without token ids")
        if isinstance(src, TokenSource):
            return src.token_ids(start, end)
        return np.asarray(src[start:end], dtype=np.int64)


class Batch:
    """Per scheduled request, in batch order, one list each. `requests` holds the scheduler's
    `Request` objects (or `_Entry`s for batches built by hand): each has request_id, block_table
    and token_ids(). A policy builds one on every step, so this is a plain class with slots."""

    __slots__ = ("requests", "num_computed_tokens", "num_scheduled_tokens", "needs_logits", "is_decode",
                 "num_leading_decodes")

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.num_computed_tokens: list[int] = []
        self.num_scheduled_tokens: list[int] = []
        self.needs_logits: list[bool] = []
        self.is_decode: list[bool] = []
        # Requests at the head of the batch that add_decodes put into it while it was empty:
        # decoding requests, one token each, so each emits a token after the step (Engine._apply_step's
        # fast loop).
        self.num_leading_decodes = 0

    def add(self, request_id: str, num_computed: int, num_scheduled: int, block_table: list[int],
            needs_logits: bool, is_decode: bool = False, token_source: Any = None) -> None:
        """Add a request by hand; `token_source` is anything with token_ids(start, end) or a
        sequence of all its known token ids."""
        self.add_request(_Entry(request_id, block_table, token_source), num_computed, num_scheduled,
                         needs_logits, is_decode)

    def add_request(self, request: Any, num_computed: int, num_scheduled: int, needs_logits: bool,
                    is_decode: bool) -> None:
        self.requests.append(request)
        self.num_computed_tokens.append(num_computed)
        self.num_scheduled_tokens.append(num_scheduled)
        self.needs_logits.append(needs_logits)
        self.is_decode.append(is_decode)

    def remove(self, request: Any) -> int:
        """Take a request back out of the batch (a request preempted after it was scheduled);
        returns the tokens it had."""
        i = next(k for k, r in enumerate(self.requests) if r is request)
        num_tokens = self.num_scheduled_tokens[i]
        if i < self.num_leading_decodes:
            self.num_leading_decodes -= 1
        for column in (self.requests, self.num_computed_tokens, self.num_scheduled_tokens, self.needs_logits,
                       self.is_decode):
            del column[i]
        return num_tokens

    def add_decodes(self, requests: list, num_computed: list[int]) -> None:
        """Add decoding requests (`Request.is_decoding`), one token each (the token each sampled
        last), in bulk; `num_computed`: their `num_computed_tokens`, a list the batch keeps."""
        n = len(requests)
        if self.requests:
            self.requests.extend(requests)
            self.num_computed_tokens.extend(num_computed)
            self.num_scheduled_tokens.extend([1] * n)
            self.needs_logits.extend([True] * n)
            self.is_decode.extend([True] * n)
        else:  # the common case: the step's first requests
            self.num_leading_decodes = n
            self.requests = requests[:]
            self.num_computed_tokens = num_computed
            self.num_scheduled_tokens = [1] * n
            self.needs_logits = [True] * n
            self.is_decode = [True] * n

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def block_tables(self) -> list[list[int]]:
        """Valid until the step's postprocess."""
        return [r.block_table for r in self.requests]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_decode_tokens(self) -> int:
        return self.is_decode.count(True)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    def flatten(self, block_size: int, token_spec=None) -> FlatBatch:
        """The seven arrays of the step, built with vectorised numpy (no loop over tokens).
        `token_spec` (sim.tokens.TokenSpec) synthesises the ids of scheduler requests' tokens;
        requests added by hand carry their own."""
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

        tables = self.block_tables
        max_blocks = max((len(t) for t in tables), default=0)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, table in enumerate(tables):
            block_table[i, :len(table)] = table
        slot_mapping = (block_table[req_indices, positions // block_size].astype(np.int64) * block_size
                        + positions % block_size)

        input_ids = np.concatenate([
            r.token_ids(c, c + n, token_spec) for r, c, n in zip(self.requests, self.num_computed_tokens, self.num_scheduled_tokens)
        ]) if num_reqs else np.zeros(0, dtype=np.int64)

        logits_indices = (query_start_loc[1:] - 1)[np.asarray(self.needs_logits, dtype=bool)].astype(np.int64)
        return FlatBatch(input_ids.astype(np.int64), positions, query_start_loc, seq_lens, block_table,
                         slot_mapping, logits_indices)

