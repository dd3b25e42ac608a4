"""Frozen configuration, one dataclass per concern, checked when it is built."""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ServesimError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ServesimError(message)


def check_block_size(block_size: int) -> None:
    """KV blocks hold a power of two of tokens (the kernels' tiles and vLLM's sizes are)."""
    _require(isinstance(block_size, int) and block_size >= 1 and block_size & (block_size - 1) == 0,
             f"--block-size must be a power of two, got {block_size}")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "chunked"  # a name of policies.POLICIES, or a user's FILE.py:Class (checked by load_policy)
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256  # requests running at once
    max_model_len: int | None = None  # prompt + output limit; None means the model's own limit

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


@dataclass(frozen=True)
class SLO:
    """Service-level objectives for goodput, in seconds; None means not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot", "e2e"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"--slo {name} must be positive, got {value}")

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft, self.tpot, self.e2e))

    @classmethod
    def parse(cls, text: str | None) -> "SLO":
        """Parse 'ttft=0.5,tpot=0.05' (seconds)."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for part in text.split(","):
            key, sep, raw = part.partition("=")
            key = key.strip().lower()
            if key == "e2el":
                key = "e2e"
            _require(sep == "=" and key in ("ttft", "tpot", "e2e"),
                     f"--slo: cannot read {part!r}; expected ttft=SECONDS,tpot=SECONDS,e2e=SECONDS")
            try:
                values[key] = float(raw)
            except ValueError:
                raise ServesimError(f"--slo: {key} value {raw!r} is not a number") from None
        return cls(**values)
