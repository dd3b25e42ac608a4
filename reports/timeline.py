"""The digest's step timeline, built from batches of steps as a replay hands them over.

Up to `exact_steps` steps (default 4,194,304: about 100 MB of the five columns) the steps are
kept and the timeline is `reports.digest.timeline` of all of them, exactly. Past that, the steps
are summed into `FINE_BINS` fine bins from the first step's start, the bin width doubling (pairs
of bins merged) whenever a step starts past the last bin, and memory stops growing. The
timeline's bins are then read from the fine bins, each fine bin going whole to the bin its left
edge falls in: a step may be counted one bin early, when it starts less than one fine bin
(at most 2 x span / FINE_BINS) after a bin edge.
"""

from __future__ import annotations

import numpy as np

EXACT_STEPS = 1 << 22
FINE_BINS = 1 << 16


class StepTimeline:
    def __init__(self, names: tuple[str, ...], exact_steps: int = EXACT_STEPS):
        self.names = names
        self.exact_steps = exact_steps
        self.num_steps = 0
        self._kept: list[dict[str, np.ndarray]] | None = []  # the exact steps; None once binned
        self._origin = 0.0  # the first step's start
        self._last_start = 0.0
        self._width = 0.0  # of a fine bin
        self._counts = np.zeros(FINE_BINS)
        self._sums = {name: np.zeros(FINE_BINS) for name in names}

    def add(self, start_s: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        """A batch of steps in start order: their starts and each of `names`' values."""
        if not len(start_s):
            return
        if not self.num_steps:
            self._origin = float(start_s[0])
        self.num_steps += len(start_s)
        self._last_start = float(start_s[-1])
        if self._kept is not None:
            self._kept.append({"start_s": np.array(start_s, dtype=np.float64),
                               **{name: np.array(columns[name]) for name in self.names}})
            if self.num_steps <= self.exact_steps:
                return
            kept, self._kept = self._kept, None  # past the limit: everything into the fine bins
            self._width = max(self._last_start - self._origin, 1e-9) / FINE_BINS * 2
            for batch in kept:
                self._bin(batch["start_s"], batch)
            return
        self._bin(np.asarray(start_s, dtype=np.float64), columns)

    def _bin(self, start_s: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        offset = start_s - self._origin
        while offset[-1] >= self._width * FINE_BINS:  # widen: merge pairs of fine bins
            self._counts = _merge_pairs(self._counts)
            self._sums = {name: _merge_pairs(values) for name, values in self._sums.items()}
            self._width *= 2
        index = np.minimum((offset / self._width).astype(np.int64), FINE_BINS - 1)
        self._counts += np.bincount(index, minlength=FINE_BINS)
        for name in self.names:
            self._sums[name] += np.bincount(index, weights=np.asarray(columns[name], dtype=np.float64),
                                            minlength=FINE_BINS)

    def timeline(self, num_bins: int) -> dict:
        """reports.digest.timeline's dict: the bins' left edges and each column's mean per step."""
        from reports.digest import timeline

        if self._kept is not None:
            kept = self._kept
            starts = np.concatenate([b["start_s"] for b in kept]) if kept else np.empty(0)
            columns = {name: np.concatenate([b[name] for b in kept]) if kept else np.empty(0) for name in self.names}
            return timeline(starts, columns, num_bins)
        span = self._last_start - self._origin
        num_bins = max(1, min(num_bins, self.num_steps))
        width = span / num_bins if span > 0 else 1.0
        edges = self._width * np.arange(FINE_BINS)
        index = np.minimum((edges / width).astype(np.int64), num_bins - 1)
        counts = np.bincount(index, weights=self._counts, minlength=num_bins)
        out = {"start_s": (self._origin + width * np.arange(num_bins)).tolist()}
        with np.errstate(invalid="ignore", divide="ignore"):
            for name in self.names:
                sums = np.bincount(index, weights=self._sums[name], minlength=num_bins)
                out[name] = (sums / counts).tolist()  # NaN where no step started in the bin
        return out


def _merge_pairs(values: np.ndarray) -> np.ndarray:
    """Fine bins 2i and 2i+1 summed into bin i; the upper half empty."""
    merged = np.zeros_like(values)
    merged[:len(values) // 2] = values.reshape(-1, 2).sum(axis=1)
    return merged
