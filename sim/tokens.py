"""Deterministic synthetic token ids.

Traces carry no text, so token ids are a seeded hash of where the token comes from. A prompt
token of a request without prefix hashes is keyed by the request's index, so no two requests
share content. A prompt token covered by a trace's prefix-block hash id is keyed by that id
and the offset inside the block: requests sharing leading hash ids share identical token runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class TokenSpec:
    """What synthesised token ids depend on besides the request: the run's seed and the model's
    vocabulary size. Backends that need token ids (the real one) hold it; requests do not."""

    seed: int = 0
    vocab_size: int = 32000


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def hashed_ids(seed: int, keys: np.ndarray, offsets: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids for (key, offset) pairs; the same pair always gives the same id."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * _GOLDEN + keys.astype(np.uint64) * _M2 + offsets.astype(np.uint64) * _GOLDEN
        return (_mix(x) % np.uint64(vocab_size)).astype(np.int64)


def prompt_token_ids(seed: int, request_index: int, hash_ids: np.ndarray | None, hash_block_tokens: int,
                     start: int, end: int, vocab_size: int) -> np.ndarray:
    """Prompt token ids at positions [start, end)."""
    positions = np.arange(start, end, dtype=np.int64)
    if hash_ids is None:
        # Keys of requests without hashes live above 2**40 so they never meet a trace's hash id.
        keys = np.full(positions.shape, (1 << 40) + request_index, dtype=np.int64)
        return hashed_ids(seed, keys, positions, vocab_size)
    blocks = positions // hash_block_tokens
    keys = np.asarray(hash_ids, dtype=np.int64)[blocks]
    return hashed_ids(seed, keys, positions % hash_block_tokens, vocab_size)


def output_token_ids(seed: int, request_index: int, start: int, end: int, vocab_size: int) -> np.ndarray:
    """Synthetic ids of generated tokens [start, end) (counted from the first output token)."""
    keys = np.full(end - start, (1 << 41) + request_index, dtype=np.int64)
    return hashed_ids(seed, keys, np.arange(start, end, dtype=np.int64), vocab_size)
