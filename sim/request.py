"""A request and its token state.

Prefill, chunked prefill and decode are one thing here: a request knows `num_tokens` tokens
(its prompt plus what it has generated) and has computed `num_computed_tokens` of them. A step
that brings `num_computed_tokens` up to `num_tokens` samples one new token. So the step that
computes the last prompt token emits the first output token, and a decoding request computes
exactly one token per step (the one it sampled last).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from sim import tokens


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"  # prefilled; its KV blocks are on their way to a decode replica
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass(eq=False, slots=True)
class Request:
    index: int  # position in the trace; also the key of its synthetic token ids
    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int  # output tokens to generate (vLLM's SamplingParams.max_tokens); exact: EOS is ignored
    hash_ids: np.ndarray | None = None  # prefix-block hash ids from the trace, if any
    hash_block_tokens: int = 512  # tokens covered by one hash id (the trace's unit)
    priority: int = 0  # under --scheduling-policy priority, lower is served first (vLLM's)

    # Token state: changed only by the policy (scheduling) and the engine (postprocess).
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    last_scheduled_step: int | None = None  # the engine step that last scheduled it; None: never
    admission_order: int = 0  # its place in the running list: the engine's admissions before it joined
    # Asynchronous scheduling (set by the engine): the step in which it last sampled a token, and the
    # last step in which it sampled one right after sampling one in the step before. vLLM scheduled
    # that step before the token before it was known (its placeholder), so while that step is in
    # flight its blocks are cached one token short (KVCacheManager.allocate_slots caches
    # min(num_computed + num_new, request.num_tokens)); BlockManager.num_cached_tokens.
    last_sampled_step: int = -1
    cached_short_step: int = -1

    # Timeline and counters.
    first_scheduled_s: float | None = None
    first_step_start_s: float | None = None  # its first step's start (set by the engine): TTFT in parts
    client_sent_s: float | None = None  # when a client sent it, where an API server is modelled (else None)
    first_token_s: float | None = None
    finish_s: float | None = None
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    reject_reason: str | None = None
    sampled_token_ids: list[int] = field(default_factory=list)  # filled by a sampling backend
    token_times: list[float] | None = None  # each emitted token's time, while it is in the engine
    _block_hashes: list[int] | None = None
    _prefix_chain: list[int] | None = None
    _block_spans: list[tuple[int, int, int]] | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Computing only the token it sampled last. The policies' per-step loops ask it of every
        running request through `num_leading_decoding` and `split_decoding` (below)."""
        return self.num_output_tokens > 0 and self.num_computed_tokens == self.num_tokens - 1

    @property
    def max_kv_tokens(self) -> int:
        """KV slots the request needs at its longest: the last output token is never computed."""
        return self.num_prompt_tokens + self.max_tokens - 1

    def num_shared_blocks(self, block_size: int) -> int:
        """Leading full blocks whose content other requests may share: the prompt's full blocks
        when the trace gives prefix hashes, none otherwise (its token ids are its own)."""
        return self.num_prompt_tokens // block_size if self.hash_ids is not None else 0

    def block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """Keys of the first `num_blocks` (at least) full blocks of its tokens: equal keys mean
        equal token ids from the start to the end of the block, as vLLM's chained block hashes.

        A prompt token's id is fixed by the hash id of the trace block it lies in and its offset
        there (see `sim.tokens`), so a shared block's key mixes the chained hash of the trace's
        hash ids up to the one it ends in with the offset where it ends. Every other block holds
        tokens of this request alone (a prompt without trace hashes, or generated tokens), so its
        key is the request's and the block's number, negative so it meets no shared key.
        """
        keys = self._block_hashes
        if keys is None:
            keys = []
            num_shared = self.num_shared_blocks(block_size)
            if num_shared:
                h_tokens = self.hash_block_tokens
                last_token = np.arange(1, num_shared + 1, dtype=np.int64) * block_size - 1
                keys = tokens.hashed_ids(0, np.asarray(self.prefix_chain(block_size), dtype=np.int64)[last_token // h_tokens],
                                         last_token % h_tokens, 1 << 62).tolist()
            self._block_hashes = keys
        if len(keys) < num_blocks:
            base = -((self.index + 1) << 32)
            keys.extend(range(base - len(keys), base - num_blocks, -1))
        return keys

    def prefix_chain(self, block_size: int) -> list[int]:
        """chain[j]: the chained hash of the trace's hash ids 0..j, for each trace block that one of
        the prompt's full blocks ends in (empty without trace hashes). A shared block's key is a
        function of chain[j] of the trace block it ends in and of its offset there."""
        chain = self._prefix_chain
        if chain is None:
            chain = []
            num_shared = self.num_shared_blocks(block_size)
            if num_shared:
                parent = 0
                hash_ids: np.ndarray = self.hash_ids  # type: ignore[assignment]  # it has shared blocks
                for hash_id in hash_ids[:(num_shared * block_size - 1) // self.hash_block_tokens + 1].tolist():
                    parent = hash((parent, hash_id))
                    chain.append(parent)
            self._prefix_chain = chain
        return chain

    def block_spans(self, block_size: int) -> list[tuple[int, int, int]]:
        """(chain[j], first, end) for each trace block j of `prefix_chain` that a block ends in:
        blocks [first, end) end there (the last span's `end` may pass the prompt's full blocks)."""
        spans = self._block_spans
        if spans is None:
            h_tokens = self.hash_block_tokens
            spans = [(chain_hash, j * h_tokens // block_size, (j + 1) * h_tokens // block_size)
                     for j, chain_hash in enumerate(self.prefix_chain(block_size))]
            if block_size > h_tokens:  # then no block ends in some trace blocks
                spans = [span for span in spans if span[2] > span[1]]
            self._block_spans = spans
        return spans

    def drop_block_hashes(self) -> None:
        """Forget the block keys (a finished request needs them no more; they are recomputed if asked)."""
        self._block_hashes = None
        self._prefix_chain = None
        self._block_spans = None

    def token_ids(self, start: int, end: int, spec: tokens.TokenSpec) -> np.ndarray:
        """Ids of the known tokens at positions [start, end): synthesised from `spec` (the run's
        seed and the model's vocabulary), except those a sampling backend really produced."""
        p = self.num_prompt_tokens
        parts = []
        if start < p:
            parts.append(tokens.prompt_token_ids(spec.seed, self.index, self.hash_ids,
                                                 self.hash_block_tokens, start, min(end, p), spec.vocab_size))
        if end > p:
            a, b = max(start, p) - p, end - p
            if self.sampled_token_ids:
                parts.append(np.asarray(self.sampled_token_ids[a:b], dtype=np.int64))
            else:
                parts.append(tokens.output_token_ids(spec.seed, self.index, a, b, spec.vocab_size))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


# `Request.is_decoding` over a step's running requests, in bulk: the policies ask it of every running
# request on every step, and a property call per request is a measurable share of a replay, so its
# test is written out here (the same expression: tests/test_request.py checks both against it).

def num_leading_decoding(requests: list[Request]) -> int:
    """How many of `requests`, from the first, are decoding (`Request.is_decoding`)."""
    n = 0
    for r in requests:
        g = r.num_output_tokens
        if not (g and r.num_computed_tokens == r.num_prompt_tokens + g - 1):
            break
        n += 1
    return n


def split_decoding(requests: list[Request]) -> tuple[list[Request], list[Request]]:
    """`requests` split into those decoding (`Request.is_decoding`) and the others, each in order."""
    decoding: list[Request] = []
    others: list[Request] = []
    for r in requests:
        g = r.num_output_tokens
        (decoding if g and r.num_computed_tokens == r.num_prompt_tokens + g - 1 else others).append(r)
    return decoding, others
