"""Streaming percentiles: numpy's exactly while the values fit, within the stated error beyond."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reports.quantiles import RELATIVE_ACCURACY, StreamingQuantiles, exact_percentiles

PERCENTS = [0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100]
chunks = st.lists(st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1e4)), max_size=40), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(chunks)
def test_exact_while_the_values_fit(parts):
    sketch = StreamingQuantiles()
    for part in parts:
        sketch.add(part)
    values = np.array([v for part in parts for v in part])
    assert sketch.is_exact and sketch.count == len(values)
    if len(values):
        assert sketch.percentiles(PERCENTS).tolist() == np.percentile(values, PERCENTS).tolist()
        assert sketch.mean() == float(values.mean())
        assert sketch.stats()["p99"] == float(np.percentile(values, 99))
    else:
        assert sketch.stats() == {"mean": None, "p50": None, "p90": None, "p99": None}


@settings(max_examples=60, deadline=None)
@given(chunks, st.integers(0, 20))
def test_within_the_relative_accuracy_once_sketched(parts, exact_limit):
    sketch = StreamingQuantiles(exact_limit=exact_limit)
    for part in parts:
        sketch.add(part)
    values = np.array([v for part in parts for v in part])
    if not len(values):
        return
    exact = np.percentile(values, PERCENTS)
    got = sketch.percentiles(PERCENTS)
    assert np.all(np.abs(got - exact) <= RELATIVE_ACCURACY * (1 + 1e-9) * exact)
    assert got[0] == values.min() and got[-1] == values.max()
    assert sketch.mean() == pytest.approx(values.mean(), rel=1e-12)
    assert sketch.is_exact == (len(values) <= exact_limit)


def test_a_worked_example_with_wide_buckets():
    # relative accuracy 0.5: gamma = 3, bucket i holds (3^(i-1), 3^i] and stands for 2 * 3^i / 4.
    # 1 -> bucket 0 (0.5); 2 -> bucket 1 (1.5); 0 is counted apart; 3 is the maximum, kept exactly.
    sketch = StreamingQuantiles(exact_limit=0, relative_accuracy=0.5)
    sketch.add([2.0, 0.0])
    sketch.add([3.0, np.nan, 1.0])  # NaN (an undefined latency) is left out
    assert not sketch.is_exact and sketch.count == 4
    # Ranks (n - 1 = 3): p0 -> 0 (min), p25 -> 0.75 between 0 and 0.5, p50 -> 1.5 between 0.5 and
    # 1.5, p100 -> 3 (max). Exact: 0, 0.75, 1.5, 3.
    assert sketch.percentiles([0, 25, 50, 100]).tolist() == [0.0, 0.375, 1.0, 3.0]
    assert sketch.mean() == 1.5
    with pytest.raises(ValueError, match="sketched"):
        sketch.values()


def test_memory_stops_growing_past_the_limit():
    rng = np.random.default_rng(0)
    sketch = StreamingQuantiles(exact_limit=1000)
    for _ in range(20):
        sketch.add(rng.exponential(0.02, size=500))
    assert not sketch.is_exact and sketch.count == 10_000
    assert sketch._chunks is None and sketch._counts.nbytes < 64 * 1024


def test_negative_latencies_are_refused():
    with pytest.raises(ValueError, match="negative"):
        StreamingQuantiles().add([0.1, -0.2])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0.0, 1.0, 2.5, 1e-3, 1e300]), st.floats(0, 1e4)), min_size=1, max_size=80),
       st.lists(st.one_of(st.sampled_from([0, 50, 90, 99, 99.9, 100]), st.floats(0, 100)), min_size=1, max_size=6),
       st.booleans())
def test_exact_percentiles_are_numpys_bit_for_bit(values, percents, overwrite):
    values = np.array(values)
    kept = values.copy()
    expected = np.percentile(values, percents)
    got = exact_percentiles(values, percents, overwrite=overwrite)
    assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()
    assert sorted(values.tolist()) == sorted(kept.tolist())  # the same values, reordered at most
    if not overwrite:
        assert values.tobytes() == kept.tobytes()
    one = exact_percentiles(values, percents[0])
    assert one.shape == () and float(one) == float(np.percentile(values, percents[0]))


def test_exact_percentiles_of_many_repeated_values():
    rng = np.random.default_rng(3)
    values = rng.choice(rng.exponential(size=300), 200_000)  # as inter-token gaps: few distinct step times
    percents = [50, 90, 99, 0, 100, 99.99]
    assert exact_percentiles(values, percents).tobytes() == np.percentile(values, percents).tobytes()


def test_add_copies_unless_told_not_to():
    given_away, kept = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    sketch = StreamingQuantiles()
    sketch.add(kept)
    sketch.add(given_away, copy=False)
    kept[0] = given_away[0] = 9.0  # only the array given away is seen changed
    assert sketch.values().tolist() == [3.0, 4.0, 9.0, 2.0]
    sketch = StreamingQuantiles()
    with_nan = np.array([np.nan, 1.0, np.nan])
    sketch.add(with_nan, copy=False)
    sketch.add(np.array([np.nan]))
    sketch.add([])
    with_nan[1] = 5.0  # the NaN were left out of a copy
    assert sketch.count == 1 and sketch.values().tolist() == [1.0]
