"""The one interface between the simulator and whatever says how long a step takes.

The engine hands a backend one `Batch` per step and gets a `StepResult` back. The cost model
predicts the seconds from the batch's shape; the real backend runs the batch's seven arrays
through a model and measures them. Everything the engine and the tools ask of a backend is
declared here, so no caller has to discover a capability with `getattr`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from sim.batch import Batch


@dataclass
class StepResult:
    seconds: float
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per part of the step
    # One sampled token per request that needed logits, in batch order; None when the backend
    # does not sample (the cost model), and the simulator then synthesises the token ids.
    sampled_token_ids: "np.ndarray | None" = None


class Backend(Protocol):
    """What every backend provides."""

    name: str  # "costmodel", "real", ...
    device: str  # where steps run or are imagined to run: "cpu", "cuda", or the hardware's name
    dtype: str  # of weights and KV cache, e.g. "bfloat16"
    # KV blocks the backend itself allocated (the real backend's cache); None when the backend holds
    # no cache and the run's KV plan decides. The block manager must then hand out exactly these ids.
    num_blocks: int | None
    # Whether `decode_run` may stand in for a run of decode-only steps (see sim/fast_forward.py):
    # True only for a `DecodeRunBackend` whose decode_run gives exactly execute's seconds.
    supports_fast_forward: bool

    def execute(self, batch: "Batch") -> StepResult: ...


@runtime_checkable
class DecodeRunBackend(Protocol):
    """A backend that can cost a run of decode-only steps in one call (the cost model)."""

    supports_fast_forward: bool

    def decode_run(self, context_lens: list[int], num_steps: int,
                   active_steps: list[int] | None = None) -> "tuple[np.ndarray, dict]":
        """Seconds [num_steps] and breakdown of `num_steps` decode-only steps of the same requests,
        whose contexts (after the first step) are `context_lens` and grow by one token per step;
        request i takes part in the first `active_steps[i]` steps only. Each step's figures must
        be exactly those `execute` gives for that step's batch."""
        ...


@runtime_checkable
class ChunkStepsBackend(Protocol):
    """A backend that can cost a run of steps that each decode the same requests and carry one
    request's prefill forward by the same chunk (the cost model): the engine's chunk runs
    (sim/fast_forward.py)."""

    def chunk_steps(self, decode_computed: list[int], chunk: int, before: int,
                    num_steps: int) -> "tuple[list[float], dict[str, list[float]]]":
        """Seconds and breakdown (a list per part) of `num_steps` steps, step j of which schedules
        one token for each decode, whose request had `decode_computed[i] + j` tokens computed before
        it, and then `chunk` (> 1) tokens of a prefill that had `before + chunk * j` computed and
        does not end in the step (it needs no logits). Each step's figures must be exactly those
        `execute` gives for that step's batch."""
        ...
