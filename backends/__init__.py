"""Backends: given one `Batch`, say how long the engine step takes.

`costmodel` predicts the time from the batch's shape; `real` (torch + Triton, an optional
extra) runs the batch's seven arrays through a real model and measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

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
    name: str

    def execute(self, batch: "Batch") -> StepResult: ...
