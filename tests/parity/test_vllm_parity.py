"""servesim's `chunked` policy against vLLM's own V1 scheduler, run by vLLM's code: its synchronous
`Scheduler` and, with `-async` cases, its `AsyncScheduler` driven as the engine core's batch queue drives it.

Every case (tests/parity/cases.py) is one trace with one set of options and one step-time
function; vLLM's `Scheduler` (tests/parity/vllm_driver.py) and servesim, with fast-forward on
and off, must give the same first-token and finish time for every request, the same prefill
tokens, decode tokens and preemptions at every step, and the same prefix-cache queries and hits.

Skipped where vLLM is not installed (the `parity` extra: see the README).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is first imported
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed (pip install '.[parity]')")

from tests.parity.cases import (
    adaptive_threshold_cases,
    all_cases,
    async_cases,
    async_variant,
    cache_aware_cases,
    cadence_cases,
    watermark_cases,
)
from tests.parity.run import assert_schedules_as_vllm

CASES = all_cases()
ASYNC_CASES = async_cases()
ALL = CASES + ASYNC_CASES


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "no-ff"])
@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_servesim_schedules_as_vllm(case, fast_forward):
    assert_schedules_as_vllm(case, fast_forward)



CACHE_AWARE = [case for base in cache_aware_cases() for case in (base, async_variant(base))]


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "no-ff"])
@pytest.mark.parametrize("case", CACHE_AWARE, ids=[c.name for c in CACHE_AWARE])
def test_cache_aware_admission_as_vllm(case, fast_forward):
    """vLLM 0.34's cache-aware admission (skipped on a vLLM without it)."""
    assert_schedules_as_vllm(case, fast_forward)


WATERMARK = [case for base in watermark_cases() for case in (base, async_variant(base))]


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "no-ff"])
@pytest.mark.parametrize("case", WATERMARK, ids=[c.name for c in WATERMARK])
def test_watermark_as_vllm(case, fast_forward):
    """vLLM's --watermark (0.33 and 0.34)."""
    assert_schedules_as_vllm(case, fast_forward)


ADAPTIVE = [case for base in adaptive_threshold_cases() for case in (base, async_variant(base))]


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "no-ff"])
@pytest.mark.parametrize("case", ADAPTIVE, ids=[c.name for c in ADAPTIVE])
def test_adaptive_long_prefill_threshold_as_vllm(case, fast_forward):
    """vLLM's --long-prefill-token-threshold-adaptive (0.33 and 0.34)."""
    assert_schedules_as_vllm(case, fast_forward)


CADENCE = [case for base in cadence_cases() for case in (base, async_variant(base))]


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "no-ff"])
@pytest.mark.parametrize("case", CADENCE, ids=[c.name for c in CADENCE])
def test_prefill_cadence_as_vllm(case, fast_forward):
    """vLLM's --prefill-schedule-interval, one engine's cadence (0.33 and 0.34)."""
    assert_schedules_as_vllm(case, fast_forward)
