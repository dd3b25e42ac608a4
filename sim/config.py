"""Frozen configuration, one dataclass per concern, checked when it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.errors import ServesimError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ServesimError(message)


def check_block_size(block_size: int) -> None:
    """KV blocks hold a power of two of tokens (the kernels' tiles and vLLM's sizes are)."""
    _require(isinstance(block_size, int) and block_size >= 1 and block_size & (block_size - 1) == 0,
             f"--block-size must be a power of two, got {block_size}")


SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "chunked"  # a name of policies.POLICIES, or a user's FILE.py:Class (checked by load_policy)
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256  # requests running at once
    max_model_len: int | None = None  # prompt + output limit; None means the model's own limit
    # Admit a waiting request only if blocks for its whole current sequence are free, not just its
    # first chunk's (vLLM 0.33's scheduler_reserve_full_isl, default True).
    reserve_full_isl: bool = True
    # Cap of a prefill's chunk per step, in tokens; 0: no cap (vLLM's long_prefill_token_threshold).
    # vLLM lifts it in a step with only one request waiting or running.
    long_prefill_token_threshold: int = 0
    # fcfs: by arrival; priority: by the trace's priority (lower first), then arrival (vLLM's policy).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        _require(bool(self.policy), "--policy must not be empty")
        _require(
            self.max_num_batched_tokens >= 1,
            f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}",
        )
        _require(self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        # As in vLLM: every running request must be able to get its decode token in one step.
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
            f"--max-num-seqs ({self.max_num_seqs}), so that every running decode fits in one step",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            f"--max-model-len must be at least 2, got {self.max_model_len}",
        )
        _require(isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0,
                 f"--long-prefill-token-threshold must be a whole number >= 0, got {self.long_prefill_token_threshold}")
        _require(self.scheduling_policy in SCHEDULING_POLICIES,
                 f"unknown --scheduling-policy {self.scheduling_policy!r}; choose {' or '.join(SCHEDULING_POLICIES)}")


# The block manager keeps a few Python objects per KV block (~60 bytes): 2**25 blocks take ~2 GB of
# host memory. A larger cache (1e11 blocks) would fail with MemoryError long after the command started
# (sim.app.plan.resolve refuses it, once the real backend has had its say about its own memory).
MAX_NUM_BLOCKS = 2**25


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # vLLM's num_gpu_blocks_override (--num-gpu-blocks); None: derived as vLLM does
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        _require(
            self.num_blocks is None or self.num_blocks >= 1,
            f"--num-gpu-blocks must be at least 1, got {self.num_blocks}",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )


# --slo keys, the same for replay's goodput and capacity's criterion: each limits one latency.
SLO_KEYS = ("tbt", "ttft", "tpot", "e2e", "delay")  # tbt: time between tokens; delay: scheduling delay
SLO_ALIASES = {"itl": "tbt", "scheduling_delay": "delay", "e2el": "e2e"}


def parse_slo(text: str) -> dict[str, float | None]:
    """'tbt=0.1,ttft=2' -> {'tbt': 0.1, 'ttft': 2.0} (seconds); KEY=none lifts a limit. A key given
    twice, an unknown key or a value that is not a positive number is a one-line error."""
    values: dict[str, float | None] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        key = key.strip().lower()
        key = SLO_ALIASES.get(key, key)
        _require(sep == "=" and key in SLO_KEYS,
                 f"--slo: cannot read {part.strip()!r}; expected KEY=SECONDS with KEY one of {', '.join(SLO_KEYS)}")
        _require(key not in values, f"--slo: {key} is given twice")
        if raw.strip().lower() == "none":
            values[key] = None
            continue
        try:
            values[key] = float(raw)
        except ValueError:
            raise ServesimError(f"--slo: {key} value {raw.strip()!r} is not a number") from None
        _require(math.isfinite(values[key]) and values[key] > 0,
                 f"--slo {key} must be a positive number of seconds, got {raw.strip()}")
    return values


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in seconds; None means not constrained. A request
    meets them when its TTFT, TPOT, E2E latency, scheduling delay and every gap between its
    tokens (tbt) are within their limits."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    tbt: float | None = None
    delay: float | None = None

    def __post_init__(self) -> None:
        for name in SLO_KEYS:
            value = getattr(self, name)
            _require(value is None or value > 0, f"--slo {name} must be positive, got {value}")

    @property
    def is_set(self) -> bool:
        return any(getattr(self, name) is not None for name in SLO_KEYS)

    def limits(self) -> dict[str, float]:
        """The limits that are set, in SLO_KEYS order."""
        return {name: getattr(self, name) for name in SLO_KEYS if getattr(self, name) is not None}

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """Parse 'ttft=0.5,tpot=0.05' (seconds); the keys are those of SLO_KEYS."""
        if not text:
            return cls()
        return cls(**parse_slo(text))
