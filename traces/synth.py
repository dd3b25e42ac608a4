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

Diurnal pattern (`diurnal` = A in [0, 1)): sessions start at the rate

    rate(t) = rate * (1 - A * cos(2 pi t / period))      (period: a day, 86,400 s, by default)

lowest (rate * (1 - A)) at t = 0, midnight if the trace starts then, highest (rate * (1 + A)) half
a period later, and `rate` on average over whole periods. A = 0.5 gives a 3:1 peak-to-trough ratio.
The starts are drawn for the constant rate and mapped through the inverse of the cumulative rate
(time rescaling): a session drawn at time u starts at the t with t - A period / (2 pi) sin(2 pi t /
period) = u, so gamma arrivals keep their burstiness relative to the local rate.

Large traces are made in chunks of CHUNK_REQUESTS requests, each from its own seeded generator
(the first from `seed` itself, so a trace of up to CHUNK_REQUESTS requests is one chunk), and
come out in arrival order chunk by chunk: `synthesize_chunks` never holds more than about two
chunks, and `sim trace synth` writes them as they come (ten million requests in a few hundred
MB of memory).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from sim.config import GAMMA_CV
from sim.errors import ServesimError
from traces.formats import MAX_SPAN_S, MAX_TOKENS
from traces.trace import Trace

ARRIVALS = ("poisson", "gamma")
MAX_REQUESTS = 100_000_000  # 100 M requests take ~3 GB of columns; more is a typo
CHUNK_REQUESTS = 1 << 20
DAY_S = 86_400.0


ZIPF_MAX_VALUES = 2**24  # values a zipf:S:LO:HI spans at most: 16,777,216, the longest context --max-model-len takes


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
        if not all(math.isfinite(p) for p in params):  # (nan and inf were internal errors)
            raise ServesimError(f"{option}: {text!r} has a value that is not a finite number")
        counts = params if kind != "zipf" else params[1:]
        if any(c < 1 or c != int(c) for c in counts):
            what = "turns" if "turn" in option else "token counts"
            raise ServesimError(f"{option}: {text!r}: {what} must be whole numbers of at least 1")
        if any(c > MAX_TOKENS for c in counts):
            raise ServesimError(f"{option}: {text!r}: more tokens than any model takes (at most 2**31 = "
                                f"{MAX_TOKENS:,})")
        if kind != "fixed" and counts[0] > counts[1]:
            raise ServesimError(f"{option}: {text!r}: LO must not be above HI")
        if kind == "zipf" and not params[0] > 0:
            raise ServesimError(f"{option}: {text!r}: the zipf exponent S must be positive")
        if kind == "zipf" and counts[1] - counts[0] + 1 > ZIPF_MAX_VALUES:
            # Sampled over its whole support (a weight per value): 2**31 values took 16 GB and more.
            raise ServesimError(f"{option}: {text!r}: zipf spans at most {ZIPF_MAX_VALUES:,} values (HI - LO + 1), "
                                f"got {int(counts[1] - counts[0] + 1):,}")
        return cls(kind, params)

    @property
    def max(self) -> int:
        return int(self.params[0] if self.kind == "fixed" else self.params[-1])

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
        total = weights.sum()
        if not (total > 0 and math.isfinite(total)):  # a large S underflows every n**-S: weigh (n / LO)**-S
            weights = (support.astype(np.float64) / lo) ** -s
            total = weights.sum()
        return rng.choice(support, size=n, p=weights / total)


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
    diurnal: float = 0.0  # amplitude A of the daily rate pattern (module docstring); 0: constant rate
    diurnal_period_s: float = DAY_S

    def __post_init__(self) -> None:
        # One check at a time: a later one may divide by a value an earlier one rules out.
        checks = [
            lambda: (self.num_requests >= 1, f"--num-requests must be at least 1, got {self.num_requests}"),
            lambda: (self.num_requests <= MAX_REQUESTS,
                     f"--num-requests must be at most {MAX_REQUESTS:,}, got {self.num_requests}"),
            lambda: (self.rate > 0 and np.isfinite(self.rate), f"--rate must be a positive number, got {self.rate}"),
            lambda: (self.arrival in ARRIVALS, f"--arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}"),
            lambda: (GAMMA_CV.contains(self.cv), f"--cv must be {GAMMA_CV.describe()}, got {self.cv}"),
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
            lambda: (0 <= self.diurnal < 1, f"--diurnal must be at least 0 and below 1, got {self.diurnal}"),
            lambda: (self.diurnal_period_s > 0 and np.isfinite(self.diurnal_period_s),
                     f"--diurnal-period must be a positive number of seconds, got {self.diurnal_period_s}"),
        ]
        for check in checks:
            ok, message = check()
            if not ok:
                raise ServesimError(message)


def arrival_times(rng: np.random.Generator, n: int, rate: float, arrival: str = "poisson",
                  cv: float = 1.0) -> np.ndarray:
    """n arrival times starting at 0 with mean gap 1/rate."""
    return np.concatenate([[0.0], np.cumsum(_gaps(rng, n - 1, rate, arrival, cv))])


def _gaps(rng: np.random.Generator, n: int, rate: float, arrival: str, cv: float) -> np.ndarray:
    if arrival == "poisson":
        return rng.exponential(1.0 / rate, size=n)
    shape = 1.0 / cv**2
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def diurnal_times(u: np.ndarray, amplitude: float, period_s: float) -> np.ndarray:
    """The times t at which the cumulative diurnal rate reaches the constant-rate times u: the t with
    t - amplitude * period / (2 pi) * sin(2 pi t / period) = u (Newton's method; the left side rises
    with slope between 1 - amplitude and 1 + amplitude, so it has exactly one solution). Near
    amplitude 1 the slope at the trough is nearly 0 and Newton's steps overshoot: then bisection
    on the bracket [u - amplitude / w, u + amplitude / w], which always holds the solution."""
    if amplitude == 0:
        return u
    w = 2 * math.pi / period_s
    t = u.copy()
    for _ in range(60):
        step = (t - amplitude / w * np.sin(w * t) - u) / (1 - amplitude * np.cos(w * t))
        t -= step
        if np.abs(step).max() <= 1e-12 * max(1.0, float(t[-1])):
            return t
    lo, hi = u - amplitude / w, u + amplitude / w
    for _ in range(2200):  # a float's bracket halves to nothing within ~2100 halvings
        if not (hi - lo > 1e-12 * np.maximum(1.0, np.abs(hi))).any():
            break
        mid = lo + (hi - lo) / 2
        below = mid - amplitude / w * np.sin(w * mid) < u
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return hi


def synthesize(config: SynthConfig) -> Trace:
    """The whole trace in memory (see `synthesize_chunks` for large ones)."""
    chunks = list(synthesize_chunks(config))
    if len(chunks) == 1:
        return chunks[0]
    first = chunks[0]
    return replace(
        first, arrival_s=np.concatenate([c.arrival_s for c in chunks]),
        prompt_tokens=np.concatenate([c.prompt_tokens for c in chunks]),
        output_tokens=np.concatenate([c.output_tokens for c in chunks]),
        request_ids=None if first.request_ids is None else [i for c in chunks for i in c.request_ids],
        hash_ids=None if first.hash_ids is None else [h for c in chunks for h in c.hash_ids])


def synthesize_chunks(config: SynthConfig, chunk_requests: int = CHUNK_REQUESTS) -> Iterator[Trace]:
    """The trace in pieces, in arrival order. Chunk k's sessions start after chunk k-1's; a session's
    later turns may arrive after the next chunk's first start, so each chunk's requests are held
    until no later chunk can arrive before them."""
    is_multi_turn = config.turns.max > 1
    has_hashes = is_multi_turn or config.system_prompt_tokens > 0
    block = config.hash_block_tokens
    state = {"next_id": config.system_prompt_tokens // block, "last_start": 0.0, "num_sessions": 0}
    held: list[_Requests] = []
    for k, start in enumerate(range(0, config.num_requests, chunk_requests)):
        chunk = _chunk(config, k, min(chunk_requests, config.num_requests - start), state, has_hashes)
        pending = _Requests.concatenate([*held, chunk])
        done = pending.arrival < chunk.first_start  # nothing later arrives before this chunk's first start
        held = [pending.take(~done)]
        if done.any():
            yield pending.take(done).trace(config, is_multi_turn, has_hashes)
    if held:
        yield held[0].trace(config, is_multi_turn, has_hashes)


@dataclass
class _Requests:
    """Requests in generation order, not yet emitted."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    request_ids: list[str]
    hash_ids: list[np.ndarray]
    first_start: float = 0.0

    @staticmethod
    def concatenate(parts: list[_Requests]) -> _Requests:
        return _Requests(np.concatenate([p.arrival for p in parts]), np.concatenate([p.prompt for p in parts]),
                         np.concatenate([p.output for p in parts]), [i for p in parts for i in p.request_ids],
                         [h for p in parts for h in p.hash_ids])

    def take(self, mask: np.ndarray) -> _Requests:
        positions = np.flatnonzero(mask).tolist()
        return _Requests(self.arrival[mask], self.prompt[mask], self.output[mask],
                         [self.request_ids[j] for j in positions] if self.request_ids else [],
                         [self.hash_ids[j] for j in positions] if self.hash_ids else [])

    def trace(self, config: SynthConfig, is_multi_turn: bool, has_hashes: bool) -> Trace:
        if not (np.isfinite(self.arrival).all() and self.arrival.max() <= MAX_SPAN_S):  # beyond any real trace's span
            raise ServesimError(f"the trace would span {self.arrival.max():.3g} s, more than {MAX_SPAN_S:g} s: raise "
                                f"--rate or lower --think-time")
        order = np.argsort(self.arrival, kind="stable")
        positions = order.tolist()
        return Trace(self.arrival[order], self.prompt[order], self.output[order],
                     request_ids=[self.request_ids[j] for j in positions] if is_multi_turn else None,
                     hash_ids=[self.hash_ids[j] for j in positions] if has_hashes else None,
                     hash_block_tokens=config.hash_block_tokens, source="synthetic", format="synthetic")


def _chunk(config: SynthConfig, k: int, n: int, state: dict, has_hashes: bool) -> _Requests:
    """Chunk k: n requests from its own generator (chunk 0's is seeded by `seed` itself)."""
    rng = np.random.default_rng(config.seed if k == 0 else [config.seed, k])
    turns = config.turns.sample(rng, n)
    num_sessions = int(np.searchsorted(np.cumsum(turns), n)) + 1
    turns = turns[:num_sessions]
    turns[-1] -= int(turns.sum()) - n  # the last session stops at n requests
    if k == 0:
        starts = arrival_times(rng, num_sessions, config.rate, config.arrival, config.cv)
    else:
        starts = state["last_start"] + np.cumsum(_gaps(rng, num_sessions, config.rate, config.arrival, config.cv))
    state["last_start"] = float(starts[-1])
    starts = diurnal_times(starts, config.diurnal, config.diurnal_period_s)

    if config.lengths_from is not None:
        pick = rng.integers(0, len(config.lengths_from), size=n)
        user, output = config.lengths_from.prompt_tokens[pick], config.lengths_from.output_tokens[pick]
    else:
        user, output = config.prompt.sample(rng, n), config.output.sample(rng, n)
    think = rng.exponential(config.think_time_s, size=n) if config.think_time_s > 0 else np.zeros(n)
    first_session = state["num_sessions"]
    state["num_sessions"] += num_sessions
    if not has_hashes:  # one turn each, nothing shared: no per-request Python
        return _Requests(starts, user.astype(np.int64), output.astype(np.int64), [], [], float(starts[0]))

    block = config.hash_block_tokens
    system_ids = np.arange(config.system_prompt_tokens // block, dtype=np.int64)
    next_id = state["next_id"]
    arrival = np.empty(n)
    prompt = np.empty(n, dtype=np.int64)
    request_ids: list[str] = []
    hash_ids: list[np.ndarray] = []
    i = 0
    for s, (start, num_turns) in enumerate(zip(starts.tolist(), turns.tolist()), start=first_session):
        context, t, first = config.system_prompt_tokens, start, i
        for turn in range(num_turns):
            if turn:
                t += think[i]
                context += int(output[i - 1])
            context += int(user[i])
            if context > MAX_TOKENS:
                raise ServesimError(f"session {s}'s turn {turn + 1} has {context:,} prompt tokens, more than any "
                                    f"model takes (2**31): fewer --turns or shorter lengths")
            arrival[i], prompt[i] = t, context
            request_ids.append(f"s{s}-t{turn + 1}")
            i += 1
        # Each turn keeps the ids of everything already in the conversation and takes new ids for
        # the rest, so every turn's ids are the start of the last turn's: one array per session,
        # and each turn a view of it (memory linear in the session's tokens, not quadratic).
        num_new = -(-context // block) - len(system_ids)
        session_ids = np.concatenate([system_ids, np.arange(next_id, next_id + num_new, dtype=np.int64)])
        next_id += num_new
        hash_ids.extend(session_ids[:-(-int(p) // block)] for p in prompt[first:i].tolist())
    state["next_id"] = next_id
    return _Requests(arrival, prompt, output.astype(np.int64), request_ids, hash_ids, float(starts[0]))


def write_synthetic(config: SynthConfig, out, compress: bool | None = None) -> tuple[int, float]:
    """Write the trace as canonical CSV chunk by chunk; returns (requests, span in seconds)."""
    from traces.writers import write_canonical_chunks

    span = [0.0]

    def chunks() -> Iterator[Trace]:
        for chunk in synthesize_chunks(config):
            span[0] = float(chunk.arrival_s[-1])
            yield chunk

    return write_canonical_chunks(chunks(), out, compress=compress), span[0]
