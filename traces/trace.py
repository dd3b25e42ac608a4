"""A trace: requests' arrival times and token counts, as numpy columns."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Trace:
    arrival_s: np.ndarray  # [n] float64, seconds from the first arrival, ascending
    prompt_tokens: np.ndarray  # [n] int64
    output_tokens: np.ndarray  # [n] int64
    request_ids: list[str] | None = None
    hash_ids: list[np.ndarray] | None = None  # prefix-block hash ids per request
    hash_block_tokens: int = 512  # tokens covered by one hash id
    source: str = ""  # the file it was read from
    format: str = ""
    warnings: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) else 0.0

    def ids(self) -> list[str]:
        return self.request_ids if self.request_ids is not None else [str(i) for i in range(len(self))]
