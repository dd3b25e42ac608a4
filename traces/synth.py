"""Seeded synthetic workloads: arrivals, lengths and multi-turn sessions.

Conversations (sessions) start by a Poisson process, or a gamma renewal process whose
inter-arrival coefficient of variation is `cv` (cv > 1 is burstier than Poisson, cv < 1 more
regular; cv = 1 is Poisson). A session has `turns` requests; each turn after the first arrives
an exponential think time after the previous one. Turn k's prompt is the whole conversation so
far (an optional system prompt, every earlier user message and answer) plus a new user message:

    turn 1 prompt: [system][user 1]
    turn 2 prompt: [system][user 1][answer 1][user 2]

Prefix sharing is written as hash ids (one per `hash_block_tokens` tokens): turn k+1 starts with
the ids of turn k's prompt, and every request starts with the system prompt's ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sim.errors import ServesimError
from traces.formats import MAX_SPAN_S, MAX_TOKENS
from traces.trace import Trace

ARRIVALS = ("poisson", "gamma")
MAX_REQUESTS = 100_000_000  # 100 M requests take ~3 GB of columns; more is a typo


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts: `fixed:N`, `uniform:LO:HI` (both ends included) or
    `zipf:S:LO:HI` (P(n) proportional to n**-S on LO..HI)."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str, option: str = "length") -> Lengths:
        kind, *parts = text.strip().split(":")
        arity = {"fixed": 1, "uniform": 2, "zipf": 3}
        if kind not in arity or len(parts) != arity[kind]:
            raise ServesimError(f"{option}: cannot read {text!r}; expected fixed:N, uniform:LO:HI or zipf:S:LO:HI")
        try:
            params = tuple(float(p) for p in parts)
        except ValueError:
            raise ServesimError(f"{option}: {text!r} has a value that is not a number") from None
        counts = params if kind != "zipf" else params[1:]
        if any(c < 1 or c != int(c) for c in counts):
            raise ServesimError(f"{option}: {text!r}: token counts must be whole numbers of at least 1")
        if any(c > MAX_TOKENS for c in counts):
            raise ServesimError(f"{option}: {text!r}: more tokens than any model takes (at most 2**31 = "
                                f"{MAX_TOKENS:,})")
        if kind != "fixed" and counts[0] > counts[1]:
            raise ServesimError(f"{option}: {text!r}: LO must not be above HI")
        if kind == "zipf" and not params[0] > 0:
            raise ServesimError(f"{option}: {text!r}: the zipf exponent S must be positive")
        return cls(kind, params)

    def __str__(self) -> str:
        return ":".join([self.kind] + [f"{p:g}" for p in self.params])

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(self.params[0]), dtype=np.int64)
        if self.kind == "uniform":
            lo, hi = (int(p) for p in self.params)
            return rng.integers(lo, hi + 1, size=n, dtype=np.int64)
        s, lo, hi = self.params[0], int(self.params[1]), int(self.params[2])
        support = np.arange(lo, hi + 1, dtype=np.int64)
        weights = support.astype(np.float64) ** -s
        return rng.choice(support, size=n, p=weights / weights.sum())


@dataclass(frozen=True)
class SynthConfig:
    num_requests: int = 1000
    rate: float = 1.0  # sessions started per second (requests per second when turns is fixed:1)
    arrival: str = "poisson"
    cv: float = 1.0  # inter-arrival coefficient of variation of gamma arrivals
    prompt: Lengths = Lengths("fixed", (512,))  # new user tokens per turn
    output: Lengths = Lengths("fixed", (128,))
    turns: Lengths = Lengths("fixed", (1,))
    think_time_s: float = 10.0  # mean gap between a session's turns
    system_prompt_tokens: int = 0  # a prefix shared by every request
    hash_block_tokens: int = 16
    seed: int = 0
    lengths_from: Trace | None = field(default=None, compare=False)  # resample (prompt, output) pairs

    def __post_init__(self) -> None:
        # One check at a time: a later one may divide by a value an earlier one rules out.
        checks = [
            lambda: (self.num_requests >= 1, f"--num-requests must be at least 1, got {self.num_requests}"),
            lambda: (self.num_requests <= MAX_REQUESTS,
                     f"--num-requests must be at most {MAX_REQUESTS:,}, got {self.num_requests}"),
            lambda: (self.rate > 0 and np.isfinite(self.rate), f"--rate must be a positive number, got {self.rate}"),
            lambda: (self.arrival in ARRIVALS, f"--arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}"),
            lambda: (self.cv > 0 and np.isfinite(self.cv), f"--cv must be a positive number, got {self.cv}"),
            lambda: (self.arrival == "gamma" or self.cv == 1.0, "--cv applies to gamma arrivals (--arrival gamma)"),
            lambda: (self.think_time_s >= 0, f"--think-time must not be negative, got {self.think_time_s}"),
            lambda: (self.think_time_s <= MAX_SPAN_S,
                     f"--think-time must be at most {MAX_SPAN_S:g} s, got {self.think_time_s}"),
            lambda: (self.hash_block_tokens >= 1,
                     f"--hash-block-tokens must be at least 1, got {self.hash_block_tokens}"),
            lambda: (self.hash_block_tokens <= MAX_TOKENS,
                     f"--hash-block-tokens must be at most 2**31, got {self.hash_block_tokens}"),
            lambda: (0 <= self.system_prompt_tokens <= MAX_TOKENS
                     and self.system_prompt_tokens % self.hash_block_tokens == 0,
                     (f"--system-prompt-tokens must be a multiple of --hash-block-tokens ({self.hash_block_tokens}) "
                     f"up to 2**31, got {self.system_prompt_tokens}")),
            lambda: (self.seed >= 0, f"--seed must not be negative, got {self.seed}"),
            lambda: (self.lengths_from is None or len(self.lengths_from) > 0, "--lengths-from: the trace is empty"),
        ]
        for check in checks:
            ok, message = check()
            if not ok:
                raise ServesimError(message)


def arrival_times(rng: np.random.Generator, n: int, rate: float, arrival: str = "poisson",
                  cv: float = 1.0) -> np.ndarray:
    """n arrival times starting at 0 with mean gap 1/rate."""
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def synthesize(config: SynthConfig) -> Trace:
    rng = np.random.default_rng(config.seed)
    n = config.num_requests
    turns = config.turns.sample(rng, n)
    num_sessions = int(np.searchsorted(np.cumsum(turns), n)) + 1
    turns = turns[:num_sessions]
    turns[-1] -= int(turns.sum()) - n  # the last session stops at n requests
    starts = arrival_times(rng, num_sessions, config.rate, config.arrival, config.cv)

    if config.lengths_from is not None:
        pick = rng.integers(0, len(config.lengths_from), size=n)
        user, output = config.lengths_from.prompt_tokens[pick], config.lengths_from.output_tokens[pick]
    else:
        user, output = config.prompt.sample(rng, n), config.output.sample(rng, n)
    think = rng.exponential(config.think_time_s, size=n) if config.think_time_s > 0 else np.zeros(n)

    is_multi_turn = bool((turns > 1).any())
    has_hashes = is_multi_turn or config.system_prompt_tokens > 0
    block = config.hash_block_tokens
    system_ids = np.arange(config.system_prompt_tokens // block, dtype=np.int64)
    next_id = len(system_ids)
    arrival = np.empty(n)
    prompt = np.empty(n, dtype=np.int64)
    request_ids: list[str] = []
    hash_ids: list[np.ndarray] = []
    i = 0
    for s, (start, num_turns) in enumerate(zip(starts.tolist(), turns.tolist())):
        context, ids, t = config.system_prompt_tokens, system_ids, start
        for k in range(num_turns):
            if k:
                t += think[i]
                context += int(output[i - 1])
            context += int(user[i])
            if context > MAX_TOKENS:
                raise ServesimError(f"session {s}'s turn {k + 1} has {context:,} prompt tokens, more than any model "
                                    f"takes (2**31): fewer --turns or shorter lengths")
            arrival[i], prompt[i] = t, context
            request_ids.append(f"s{s}-t{k + 1}")
            if has_hashes:
                # Keep the ids of everything already in the conversation; new ids for the rest.
                num_new = -(-context // block) - len(ids)
                ids = np.concatenate([ids, np.arange(next_id, next_id + num_new, dtype=np.int64)])
                next_id += num_new
                hash_ids.append(ids)
            i += 1
    if not (np.isfinite(arrival).all() and arrival.max() <= MAX_SPAN_S):  # beyond any real trace's span
        raise ServesimError(f"the trace would span {arrival.max():.3g} s, more than {MAX_SPAN_S:g} s: raise --rate "
                            f"or lower --think-time")
    order = np.argsort(arrival, kind="stable")
    positions = order.tolist()
    return Trace(arrival[order] - arrival[order][0], prompt[order], output.astype(np.int64)[order],
                 request_ids=[request_ids[j] for j in positions] if is_multi_turn else None,
                 hash_ids=[hash_ids[j] for j in positions] if has_hashes else None,
                 hash_block_tokens=block, source="synthetic", format="synthetic")
