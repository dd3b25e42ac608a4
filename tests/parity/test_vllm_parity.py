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

from tests.parity.cases import all_cases, async_cases, dp_cadence_cases, option_cases
from tests.parity.run import assert_schedules_as_vllm

CASES = all_cases()
ASYNC_CASES = async_cases()
ALL = CASES + ASYNC_CASES


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "no-ff"])
@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_servesim_schedules_as_vllm(case, fast_forward):
    assert_schedules_as_vllm(case, fast_forward)


# vLLM's scheduler options, each family of cases named by its prefix (cache-aware-, watermark-, adaptive-,
# cadence-, active-seqs-: tests/parity/cases.py), synchronous and asynchronous. The cache-aware ones skip on a vLLM without it.
OPTIONS = option_cases()


@pytest.mark.parametrize("fast_forward", [True, False], ids=["ff", "no-ff"])
@pytest.mark.parametrize("case", OPTIONS, ids=[c.name for c in OPTIONS])
def test_scheduler_options_as_vllm(case, fast_forward):
    """--cache-aware-admission-window (vLLM 0.34), --watermark, --long-prefill-token-threshold-adaptive,
    --prefill-schedule-interval and --max-num-active-seqs (0.33 and 0.34)."""
    assert_schedules_as_vllm(case, fast_forward)


DP_CADENCE = dp_cadence_cases()


@pytest.mark.parametrize("case", DP_CADENCE, ids=[c.name for c in DP_CADENCE])
def test_dp_prefill_cadence_as_vllm(case):
    """--prefill-schedule-interval on a mixture of experts' DP rank (0.33 and 0.34): vLLM's scheduler told
    `throttle_prefills` by DPEngineCoreProc's shared step counter. A lockstep DP group steps one step at a
    time (no fast-forward), so each case runs once."""
    assert_schedules_as_vllm(case, fast_forward=False)
