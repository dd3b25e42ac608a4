"""Streaming percentiles of a latency: exact while the values fit, a bounded-error sketch beyond.

`StreamingQuantiles` takes non-negative values (seconds) in chunks, as a replay produces them.

- Up to `exact_limit` values (default 4,194,304: 32 MiB of float64) it keeps every value, and
  its percentiles are numpy's (`np.percentile`, linear interpolation, as vLLM's serving benchmark
  computes them) bit for bit. An hour of production traffic stays in this regime: the Azure
  conversation hour has 19,366 requests and about 4.1 million inter-token gaps. They are read by
  `exact_percentiles`, which partitions at the ranks needed only (np.percentile partitions at
  every one, the smallest and largest too, all over the array: 2.5x the time for the summary's
  three percentiles of the hour's gaps).
- Past the limit the values move into a DDSketch (Masson, Rim and Lee, "DDSketch: a fast and
  fully-mergeable quantile sketch with relative-error guarantees", VLDB 2019), and memory stops
  growing. A value x > 0 goes to bucket i = ceil(log(x) / log(gamma)), gamma = (1 + a) / (1 - a),
  so bucket i holds (gamma^(i-1), gamma^i] and stands for 2 gamma^i / (gamma + 1), which is within
  relative error a of every value in it. Zeros are counted apart, exactly. A percentile reads the
  two order statistics that linear interpolation needs from their buckets and interpolates them,
  so it is within relative error `relative_accuracy` (default a = 0.005, 0.5%) of the exact
  percentile, for values in [MIN_VALUE, MAX_VALUE] (1 ns to about 31,700 years; values outside are
  counted in the end buckets). The 0th and 100th percentiles stay exact (min and max are kept),
  and so do the count and, to float64 rounding, the mean.

The buckets are one dense array of counts (about 6,000 int64 at 0.5%): adding a chunk is one
`np.bincount`.
"""

from __future__ import annotations

import math

import numpy as np

EXACT_LIMIT = 1 << 22  # values kept exactly before switching to the sketch
RELATIVE_ACCURACY = 0.005
MIN_VALUE = 1e-9  # seconds; the sketch's smallest positive bucket
MAX_VALUE = 1e12
SKETCH_CHUNK = 1 << 20  # values sketched at a time


class StreamingQuantiles:
    def __init__(self, exact_limit: int = EXACT_LIMIT, relative_accuracy: float = RELATIVE_ACCURACY):
        if exact_limit < 0:
            raise ValueError(f"exact_limit must not be negative, got {exact_limit}")
        if not 0 < relative_accuracy < 1:
            raise ValueError(f"relative_accuracy must be in (0, 1), got {relative_accuracy}")
        self.exact_limit = exact_limit
        self.relative_accuracy = relative_accuracy
        self.count = 0
        self._chunks: list[np.ndarray] | None = []  # the exact values; None once sketched
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf
        gamma = (1 + relative_accuracy) / (1 - relative_accuracy)
        self._log_gamma = math.log(gamma)
        self._min_key = math.ceil(math.log(MIN_VALUE) / self._log_gamma)
        num_keys = math.ceil(math.log(MAX_VALUE) / self._log_gamma) - self._min_key + 1
        # Bucket k of the array stands for key self._min_key + k.
        self._representative = 2 * np.exp((self._min_key + np.arange(num_keys)) * self._log_gamma) / (gamma + 1)
        self._counts: np.ndarray | None = None
        self._num_zeros = 0

    @property
    def is_exact(self) -> bool:
        return self._chunks is not None

    def add(self, values, copy: bool = True) -> None:
        """Take a chunk of values; NaN (an undefined latency) is left out. `copy=False`: `values`,
        an array of float64, is the caller's to give away (it will not change it), and is kept as
        it is."""
        values = np.asarray(values, dtype=np.float64).ravel()
        if not len(values):
            return
        low, high = float(values.min()), float(values.max())  # NaN if any value is NaN
        if math.isnan(low) or math.isnan(high):
            values = values[~np.isnan(values)]  # a copy
            copy = False
            if not len(values):
                return
            low, high = float(values.min()), float(values.max())
        if low < 0:
            raise ValueError(f"latencies are never negative, got {low}")
        self.count += len(values)
        self._min, self._max = min(self._min, low), max(self._max, high)
        if self._chunks is not None:
            self._chunks.append(values.copy() if copy else values)
            if self.count <= self.exact_limit:
                return
            chunks, self._chunks = self._chunks, None  # past the limit: everything moves into the sketch
            self._counts = np.zeros(len(self._representative), dtype=np.int64)
            for chunk in chunks:
                self._sketch(chunk)
            return
        self._sketch(values)

    def _sketch(self, values: np.ndarray) -> None:
        for start in range(0, len(values), SKETCH_CHUNK):  # bounded temporaries
            part = values[start:start + SKETCH_CHUNK]
            self._sum += float(part.sum())
            zero = part == 0
            self._num_zeros += int(zero.sum())
            keys = np.log(np.clip(part[~zero], MIN_VALUE, MAX_VALUE))
            keys = np.ceil(keys / self._log_gamma, out=keys).astype(np.int64)
            np.clip(keys - self._min_key, 0, len(self._counts) - 1, out=keys)
            self._counts += np.bincount(keys, minlength=len(self._counts))

    def values(self) -> np.ndarray:
        """Every value, in the order added (exact regime only)."""
        if self._chunks is None:
            raise ValueError("the values were sketched; only percentiles are kept")
        if len(self._chunks) != 1:
            self._chunks = [np.concatenate(self._chunks)] if self._chunks else [np.empty(0)]
        return self._chunks[0]

    def mean(self) -> float | None:
        if not self.count:
            return None
        if self._chunks is not None:
            return float(self.values().mean())
        return self._sum / self.count

    def percentiles(self, percents) -> np.ndarray:
        """Percentiles (0..100) of the values: np.percentile's while exact, within the relative
        accuracy after. NaN for each when there are no values."""
        percents = np.asarray(percents, dtype=np.float64)
        if not self.count:
            return np.full(percents.shape, np.nan)
        if self._chunks is not None:
            return exact_percentiles(self.values(), percents)
        rank = percents / 100.0 * (self.count - 1)
        below = np.floor(rank).astype(np.int64)
        above = np.minimum(below + 1, self.count - 1)
        low, high = self._order_statistic(below), self._order_statistic(above)
        out = low + (high - low) * (rank - below)
        return np.clip(out, self._min, self._max)

    def _order_statistic(self, k: np.ndarray) -> np.ndarray:
        """The k-th smallest value (from 0): the smallest and the largest exactly, 0 for the zeros,
        any other its bucket's representative."""
        cumulative = np.cumsum(self._counts) + self._num_zeros
        bucket = np.minimum(np.searchsorted(cumulative, k, side="right"), len(cumulative) - 1)
        out = np.where(k < self._num_zeros, 0.0, self._representative[bucket])
        out[k == 0] = self._min
        out[k == self.count - 1] = self._max
        return out

    def stats(self) -> dict[str, float | None]:
        """mean, p50, p90 and p99, as the run summary reports them (None when there are no values)."""
        if not self.count:
            return {"mean": None, "p50": None, "p90": None, "p99": None}
        p50, p90, p99 = self.percentiles([50, 90, 99]).tolist()
        return {"mean": self.mean(), "p50": p50, "p90": p90, "p99": p99}


def exact_percentiles(values: np.ndarray, percents, overwrite: bool = False) -> np.ndarray:
    """np.percentile(values, percents) (linear interpolation) of a 1-D array of float64, bit for
    bit, for non-negative percents and values without NaN: the same ranks, the same order
    statistics, the same interpolation (numpy's _lerp). Where np.percentile partitions the whole
    array at every rank it reads (and at the first and last), this partitions at the ranks
    needed, in rising order, each in the part above the one before; `overwrite`: partition
    `values` itself (its order is lost) instead of a copy."""
    percents = np.asanyarray(percents)
    shape = percents.shape  # a single percent gives a 0-d array, as np.percentile's
    n = len(values)
    virtual = (n - 1) * np.true_divide(percents.ravel(), 100)
    # numpy's _get_indexes: below and above the virtual index, -1 (the largest) past the last one.
    below = np.floor(virtual)
    above = below + 1
    past = virtual >= n - 1
    below[past] = -1
    above[past] = -1
    below, above = below.astype(np.intp), above.astype(np.intp)
    gamma = virtual - below
    work = values if overwrite else values.copy()
    start = 0  # work[start:] holds the values not below the last rank partitioned at
    for rank in sorted(set((np.concatenate((below, above)) % n).tolist())):
        work[start:].partition(rank - start)
        start = rank + 1
    low, high = work[below], work[above]
    # numpy's _lerp: from the lower value, or back from the upper one past the middle.
    diff = high - low
    out = np.add(low, diff * gamma)
    np.subtract(high, diff * (1 - gamma), out=out, where=gamma >= 0.5)
    return out.reshape(shape)
