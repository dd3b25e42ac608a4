"""Workload transforms: exact arrivals and lengths after each, and their errors."""

from __future__ import annotations

import numpy as np
import pytest

from sim.errors import ServesimError
from traces import transforms
from traces.trace import Trace
from traces.transforms import (
    apply,
    limit,
    mean_rate,
    parse_time_window,
    scale_rate,
    target_rate,
    time_window,
    truncate_too_long,
)


def trace(arrival=(0.0, 1.0, 2.0, 4.0), prompt=(100, 600, 1030, 20), output=(10, 10, 500, 1), hash_ids=None):
    hashes = None if hash_ids is None else [np.array(h, dtype=np.int64) for h in hash_ids]
    return Trace(np.array(arrival), np.array(prompt, dtype=np.int64), np.array(output, dtype=np.int64),
                 request_ids=["a", "b", "c", "d"], hash_ids=hashes, hash_block_tokens=512, source="t")


def test_scale_rate_divides_arrivals():
    t = trace()
    assert scale_rate(t, 2).arrival_s.tolist() == [0, 0.5, 1, 2]
    assert scale_rate(t, 0.5).arrival_s.tolist() == [0, 2, 4, 8]
    assert t.arrival_s.tolist() == [0, 1, 2, 4]  # the input is left as it was
    for bad in (0, -1, float("nan"), float("inf"), "fast"):
        with pytest.raises(ServesimError, match="--rate-scale must be a positive number"):
            scale_rate(t, bad)


def test_target_rate():
    t = trace()
    assert mean_rate(t) == 1.0  # 4 requests over 4 s
    scaled = target_rate(t, 8.0)
    assert scaled.arrival_s.tolist() == [0, 0.125, 0.25, 0.5] and mean_rate(scaled) == 8.0
    with pytest.raises(ServesimError, match="mean rate is undefined"):
        target_rate(trace(arrival=(0, 0, 0, 0)), 2.0)


def test_time_window_keeps_half_open_interval_and_rebases():
    t = trace()
    w = time_window(t, 1.0, 4.0)
    assert w.request_ids == ["b", "c"] and w.arrival_s.tolist() == [0.0, 1.0]
    assert time_window(t, None, 2.0).request_ids == ["a", "b"]
    assert time_window(t, 2.0, None).request_ids == ["c", "d"]
    assert parse_time_window("600:1200") == (600.0, 1200.0)
    assert parse_time_window(":30") == (None, 30.0) and parse_time_window("5:") == (5.0, None)
    with pytest.raises(ServesimError, match="keeps no request; the trace spans 0 to 4 s"):
        time_window(t, 10, 20)
    with pytest.raises(ServesimError, match="START must be before END"):
        time_window(t, 3, 1)
    with pytest.raises(ServesimError, match="START:END"):
        parse_time_window("10")
    with pytest.raises(ServesimError, match="'ten' is not a number"):
        parse_time_window("ten:20")


def test_limit():
    assert limit(trace(), 2).request_ids == ["a", "b"]
    assert len(limit(trace(), 99)) == 4
    with pytest.raises(ServesimError, match="--limit must be at least 1, got 0"):
        limit(trace(), 0)


def test_truncate_too_long_keeps_the_prefix_and_its_hashes():
    t = trace(hash_ids=[[1], [1, 2], [1, 2, 3], [9]])
    cut = truncate_too_long(t, 1024)
    # a fits; b fits (610); c: 1030 + 500 > 1024 -> prompt 524, output 500; d fits.
    assert cut.prompt_tokens.tolist() == [100, 600, 524, 20]
    assert cut.output_tokens.tolist() == [10, 10, 500, 1]
    assert [h.tolist() for h in cut.hash_ids] == [[1], [1, 2], [1, 2], [9]]
    assert cut.warnings == ["truncated 1 request to --max-model-len 1024"]
    tiny = truncate_too_long(t, 8)  # outputs cut to 7 (or less), prompts to what is left
    assert tiny.output_tokens.tolist() == [7, 7, 7, 1] and tiny.prompt_tokens.tolist() == [1, 1, 1, 7]
    assert (tiny.prompt_tokens + tiny.output_tokens <= 8).all()
    assert truncate_too_long(t, 5000) is t


def test_apply_order_and_errors():
    t = trace()
    out = apply(t, time_window_s=(1.0, None), num_requests=2, rate_scale=2.0)
    assert out.request_ids == ["b", "c"] and out.arrival_s.tolist() == [0.0, 0.5]
    assert out.transforms == {"time_window_s": [1.0, None], "limit": 2, "rate_scale": 2.0}  # recorded in summary.json
    out = apply(t, num_requests=3, rate=4.0)
    assert mean_rate(out) == 4.0
    with pytest.raises(ServesimError, match="not both"):
        apply(t, rate_scale=2.0, rate=3.0)
    with pytest.raises(ServesimError, match="--on-too-long truncate needs --max-model-len"):
        apply(t, on_too_long="truncate")
    with pytest.raises(ServesimError, match="--on-too-long must be one of reject, truncate"):
        apply(t, on_too_long="ignore")
    assert apply(t, on_too_long="reject", max_model_len=10) is t  # rejecting is the engine's job
    assert transforms.TOO_LONG == ("reject", "truncate")
