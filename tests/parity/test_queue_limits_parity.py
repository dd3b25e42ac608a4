"""servesim's admission limits (sim/admission.py: --max-num-queued-reqs, --max-num-queued-tokens) against
vLLM 0.33's and 0.34's own AsyncLLM.check_admission (vllm/v1/engine/async_llm.py), called on a stand-in
AsyncLLM that holds only what it reads: the scheduler config's two limits, a real OutputProcessor
(vllm/v1/engine/output_processor.py) whose request states are the requests the API server has added and
not seen finish, each with its prompt_len and is_prefilling, and, for a DP group's several API servers,
a real SharedAdmissionStats (vllm/v1/engine/admission_control.py) whose per-server counts add up.

At each arrival of a servesim replay (a lone engine; a DP group of two ranks with one API server per rank),
the stand-in is given the state at that instant, from the run's own times: the requests admitted before
it that finish at or after it, in prefill while their first token comes at or after it. vLLM's method
must then admit exactly the requests servesim admitted, and raise QueueOverflowError or
MaxQueuedTokensError for exactly those servesim rejected for that limit.

Skipped where vLLM is not installed (the `parity` extra: see the README).
"""

from __future__ import annotations

import os
import random
from types import MethodType, SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is first imported
async_llm = pytest.importorskip("vllm.v1.engine.async_llm", reason="vLLM is not installed (pip install '.[parity]')")

from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError  # noqa: E402
from vllm.v1.engine.admission_control import SharedAdmissionStats  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor  # noqa: E402

from backends.costmodel.roofline import RooflineCostModel  # noqa: E402
from backends.hardware import HARDWARE  # noqa: E402
from backends.model_config import ModelConfig  # noqa: E402
from sim.app.options import ReplayOptions  # noqa: E402
from sim.app.plan import resolve  # noqa: E402
from sim.app.replay import replay  # noqa: E402
from sim.config import CacheConfig, SchedulerConfig  # noqa: E402
from tests.helpers import make_trace  # noqa: E402

MODEL = "Qwen3-0.6B"
AsyncLLM = async_llm.AsyncLLM


def stand_in(reqs: int | None, tokens: int | None, num_servers: int) -> SimpleNamespace:
    """An AsyncLLM with what check_admission reads (0.34 also asks whether fault tolerance is on)."""
    llm = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_queued_reqs=reqs, max_num_queued_tokens=tokens),
        output_processor=OutputProcessor(None, log_stats=False),
        logger_manager=None,
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(enable_fault_tolerance=False)),
        admission_stats=None, counters=None)
    if num_servers > 1:  # vLLM's API servers share their counts (one slot per server)
        llm.counters = [0] * SharedAdmissionStats.num_counters(num_servers)
        llm.admission_stats = SharedAdmissionStats({"mp_admission_counters": llm.counters}, num_servers, 0)
    for name in ("get_num_unfinished_requests", "get_num_queued_tokens", "_record_admission_rejection"):
        setattr(llm, name, MethodType(getattr(AsyncLLM, name), llm))
    return llm


def vllms_answer(llm: SimpleNamespace, admitted: list, at: float, num_servers: int, server_of) -> str | None:
    """check_admission's answer with the state at `at`: None, or the limit it raised for."""
    states = {r.request_id: SimpleNamespace(prompt_len=r.num_prompt_tokens, is_prefilling=r.first_token_s >= at)
              for r in admitted if r.finish_s >= at}
    llm.output_processor.request_states = states
    if num_servers > 1:  # each server's own count in its slot (this server's OutputProcessor is server 0's)
        for server in range(num_servers):
            llm.counters[server * SharedAdmissionStats.COUNTERS_PER_SLOT] = sum(
                1 for r in admitted if r.finish_s >= at and server_of(r) == server)
    try:
        AsyncLLM.check_admission(llm)
    except QueueOverflowError:
        return "max_num_queued_reqs"
    except MaxQueuedTokensError:
        return "max_num_queued_tokens"
    return None


@pytest.mark.parametrize("seed", range(24))
def test_check_admission_as_vllm(seed):
    rng = random.Random(seed)
    dp = 1 if seed % 3 else 2
    reqs = rng.choice([None, 1, 2, 3, 5, 8])
    tokens = None if dp > 1 else rng.choice([None, 1, 64, 300, 900])
    if reqs is None and tokens is None:
        reqs = 4
    rows = sorted((rng.uniform(0, 0.2), rng.randint(1, 300), rng.randint(1, 40)) for _ in range(40))
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", max_num_batched_tokens=256, max_num_seqs=4,
                                                      async_scheduling=bool(seed % 2), host_time=False,
                                                      max_num_queued_reqs=reqs, max_num_queued_tokens=tokens),
                            cache=CacheConfig(block_size=4, num_blocks=400), model=MODEL, dp=dp)
    backend = RooflineCostModel(ModelConfig.from_preset(MODEL), HARDWARE["H100-SXM"])
    result = replay(make_trace(rows), resolve(options, backend=backend))
    rank = {r.index: int(result.rank_of[i]) for i, r in enumerate(result.requests)} if dp > 1 else {}
    llm = stand_in(reqs, tokens, dp)
    admitted: list = []
    num_rejected = 0
    for r in result.requests:  # in arrival order
        ours = None
        if r.reject_reason is not None:
            assert r.reject_reason.startswith("HTTP 503 (")
            ours = r.reject_reason.removeprefix("HTTP 503 (").split(")")[0]
            num_rejected += 1
        assert vllms_answer(llm, admitted, r.arrival_s, dp, lambda q: rank[q.index]) == ours, r.request_id
        if ours is None:
            admitted.append(r)
    assert 0 < num_rejected < len(rows) or reqs in (None, 0) or tokens == 0
