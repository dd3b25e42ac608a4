"""A trace: requests' arrival times and token counts, as numpy columns.

`hash_ids`, when given, are a trace's prefix-block hash ids: request i's prompt is cut into
blocks of `hash_block_tokens` tokens and `hash_ids[i][j]` names the content of block j, so two
requests whose leading ids agree share that prompt prefix token for token (see `sim.tokens`).
Every request then has at least ceil(prompt_tokens / hash_block_tokens) ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
    dropped: dict[str, int] = field(default_factory=dict)  # rows left out while reading, by reason
    transforms: dict = field(default_factory=dict)  # the workload transforms applied (traces.transforms.apply)
    priority: np.ndarray | None = None  # [n] int64, for --scheduling-policy priority (lower first); None: all 0
    # The trace's own measurements, per request ([n] float64 each: ttft_s, tpot_s; NaN where not
    # measured), where it is a measured run (a vLLM bench result); None: none.
    measured: dict[str, np.ndarray] | None = None
    # When each request's client sent it ([n] float64), where arrival_s is when it reached the engine
    # through an API server (sim/app/replay.py, with_api_server); None: arrival_s is the engine's and the send
    client_sent_s: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) else 0.0

    def ids(self) -> list[str]:
        return self.request_ids if self.request_ids is not None else [str(i) for i in range(len(self))]

    def take(self, index: np.ndarray) -> Trace:
        """The requests at `index` (positions or a boolean mask), arrivals kept as they are."""
        index = np.flatnonzero(index) if np.asarray(index).dtype == bool else np.asarray(index, dtype=np.int64)
        positions = index.tolist()
        return replace(
            self, arrival_s=self.arrival_s[index], prompt_tokens=self.prompt_tokens[index],
            output_tokens=self.output_tokens[index],
            request_ids=None if self.request_ids is None else [self.request_ids[i] for i in positions],
            hash_ids=None if self.hash_ids is None else [self.hash_ids[i] for i in positions],
            priority=None if self.priority is None else self.priority[index],
            measured=None if self.measured is None else {k: v[index] for k, v in self.measured.items()},
            client_sent_s=None if self.client_sent_s is None else self.client_sent_s[index],
            warnings=list(self.warnings), dropped=dict(self.dropped))
