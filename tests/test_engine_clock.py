"""The engine's clock as vLLM runs it (docs/async-scheduling.md): host time per step, added to the GPU's
seconds when scheduling is synchronous and overlapped (the longer of the two) when asynchronous; the
asynchronous engine's schedule (a request arriving during step n first runs in step n + 2); TTFT in parts
from real replays. Exact parity with vLLM's AsyncScheduler is tests/parity (vLLM's own code)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.costmodel.roofline import RooflineCostModel
from backends.hardware import HARDWARE
from backends.host_time import HostTime, HostTimedBackend, Piece, overlap, with_host_time
from backends.model_config import ModelConfig
from reports.metrics import requests_table
from sim.app.options import ReplayOptions
from sim.app.plan import resolve
from sim.app.replay import replay
from sim.backend import StepResult
from sim.config import SchedulerConfig
from sim.errors import ServesimError
from tests.helpers import make_trace

HOST = HostTime.load()


class FixedBackend:
    """Every step takes `gpu_s` seconds (a decode run's too)."""

    name = device = device_name = dtype = "fixed"
    num_blocks = None
    supports_fast_forward = True

    def __init__(self, gpu_s: float):
        self.gpu_s = gpu_s

    def execute(self, batch) -> StepResult:
        return StepResult(self.gpu_s, {})

    def decode_run(self, context_lens, num_steps, active_steps=None):
        return np.full(num_steps, self.gpu_s), {}


def one_piece(fixed, per_request, per_token, name="schedule") -> HostTime:
    return HostTime({name: Piece(fixed, per_request, per_token)})


@settings(max_examples=200, deadline=None)
@given(reqs=st.integers(1, 2048), tokens=st.integers(1, 1 << 16), more_reqs=st.integers(0, 64),
       more_tokens=st.integers(0, 4096), asynchronous=st.booleans(), multiprocess=st.booleans())
def test_host_time_is_monotone_in_requests_and_tokens(reqs, tokens, more_reqs, more_tokens, asynchronous,
                                                      multiprocess):
    b = HostTimedBackend(FixedBackend(0.0), HOST, asynchronous, multiprocess)
    base = b.host_seconds(reqs, tokens)
    assert base > 0
    assert b.host_seconds(reqs + more_reqs, tokens) >= base
    assert b.host_seconds(reqs, tokens + more_tokens) >= base
    # and the array form (decode runs) gives the very same floats
    arr = b.host_seconds_array(np.array([reqs, reqs + more_reqs]), np.array([tokens, tokens + more_tokens]))
    assert arr.tolist() == [base, b.host_seconds(reqs + more_reqs, tokens + more_tokens)]


def test_overlap_worked_examples():
    assert overlap(0.010, 0.004, asynchronous=False) == 0.014
    assert overlap(0.010, 0.004, asynchronous=True) == 0.010
    assert overlap(0.002, 0.004, asynchronous=True) == 0.004
    with pytest.raises(ValueError):
        overlap(-1.0, 0.0, True)


@pytest.mark.parametrize("asynchronous,gpu_s,expected", [
    (False, 0.010, 0.010 + 0.003), (True, 0.010, 0.010), (True, 0.001, 0.003), (False, 0.001, 0.001 + 0.003)])
def test_a_step_meets_its_host_seconds_as_stated(asynchronous, gpu_s, expected):
    # host seconds of a step of 2 requests and 100 tokens: 1 ms + 2 x 0.5 ms + 100 x 10 us = 3 ms
    host = one_piece(1e-3, 0.5e-3, 1e-5)
    b = HostTimedBackend(FixedBackend(gpu_s), host, asynchronous, multiprocess=False)
    assert b.host_seconds(2, 100) == pytest.approx(0.003, abs=1e-15)
    batch = type("B", (), {"requests": [0, 1], "num_tokens": 100})()
    result = b.execute(batch)
    assert result.seconds == pytest.approx(expected, abs=1e-15)
    assert result.breakdown["gpu"] == gpu_s
    assert result.breakdown["host"] == b.host_seconds(2, 100)


def test_workers_pieces_overlap_the_engine_cores_only_asynchronously_with_tensor_parallelism():
    host = HostTime({"schedule": Piece(3e-3, 0, 0), "prepare_inputs": Piece(2e-3, 0, 0)})
    assert HostTimedBackend(FixedBackend(0), host, True, True).host_seconds(1, 1) == 3e-3
    assert HostTimedBackend(FixedBackend(0), host, False, True).host_seconds(1, 1) == 5e-3
    assert HostTimedBackend(FixedBackend(0), host, True, False).host_seconds(1, 1) == 5e-3


def test_decode_run_gives_each_steps_execute_seconds():
    b = HostTimedBackend(FixedBackend(0.004), HOST, True, False)
    seconds, parts = b.decode_run([10, 20, 30], 5, [5, 2, 3])
    running = [3, 3, 2, 1, 1]
    assert seconds.tolist() == [max(0.004, b.host_seconds(n, n)) for n in running]
    assert parts["host"].tolist() == [b.host_seconds(n, n) for n in running]


def test_host_time_scaled_to_the_hosts_reference_loop():
    mine = HostTime.load(host_reference_loop_s=2 * HOST.reference_loop_s)
    assert mine.scale == pytest.approx(2.0)
    assert mine.step_seconds(8, 8) == pytest.approx(2 * HOST.step_seconds(8, 8))


def test_reference_loop_flag_is_checked():
    with pytest.raises(ServesimError, match="--host-reference-loop-s"):
        SchedulerConfig(host_reference_loop_s=-1.0)


@pytest.mark.parametrize("model, extra", [("Llama-3.1-8B", {}), ("Llama-3.1-8B", {"hardware": "A100-80GB"}),
                                          ("DeepSeek-V3", {"hardware": "H200", "tp": 8}), ("gpt-oss-120b", {"tp": 2}),
                                          ("Qwen3-30B-A3B", {})])
def test_the_host_timed_wrapper_reaches_every_public_attribute_of_its_cost_model(model, extra):
    # The wrapper forwards what the tools read by name (backends.host_time.FORWARDED), not by a
    # __getattr__ (which would keep CPython from specialising lookups on it): each public attribute
    # of the operator-table, roofline and MoE cost models is reached, and is the inner one's.
    options = {"hardware": "H100-SXM", **extra}
    plan = resolve(ReplayOptions(scheduler=SchedulerConfig("chunked"), model=model, **options))
    wrapped = plan.backend
    assert isinstance(wrapped, HostTimedBackend) and not hasattr(HostTimedBackend, "__getattr__")
    inner = wrapped.inner
    for name in (n for n in dir(inner) if not n.startswith("_")):
        assert hasattr(wrapped, name), f"{type(inner).__name__}.{name} is not reachable through HostTimedBackend"
        if name not in ("execute", "decode_run", "chunk_steps", "execute_in_lockstep"):  # the wrapper's own
            value = getattr(wrapped, name)
            assert value is getattr(inner, name) or value == getattr(inner, name), name


def test_with_host_time_off_is_the_backend_itself():
    b = FixedBackend(0.001)
    assert with_host_time(b, True, False, None, 1) is b
    wrapped = with_host_time(b, True, True, None, 1)
    assert isinstance(wrapped, HostTimedBackend) and with_host_time(wrapped, True, True, None, 1) is wrapped


TRACE_ROWS = [(0.0, 300, 20), (0.0, 40, 8), (0.004, 500, 12), (0.02, 64, 30), (0.021, 700, 5), (0.3, 90, 40)]


def _replay(async_scheduling: bool, host_time: bool, backend=None, fast_forward=True):
    options = ReplayOptions(scheduler=SchedulerConfig("chunked", 512, 8, async_scheduling=async_scheduling,
                                                      host_time=host_time), model="Llama-3.1-8B")
    if backend is None:
        backend = RooflineCostModel(ModelConfig.from_preset("Llama-3.1-8B"), HARDWARE["H100-SXM"])
    return replay(make_trace(TRACE_ROWS), resolve(options, backend=backend), fast_forward=fast_forward)


def _answers(result):
    return ([(r.first_scheduled_s, r.first_step_start_s, r.first_token_s, r.finish_s) for r in result.requests],
            result.steps.num_prefill_tokens.tolist(), result.steps.num_decode_tokens.tolist(),
            result.steps.seconds.tolist(), result.token_times.tolist())


@pytest.mark.parametrize("asynchronous", [False, True])
def test_zero_host_time_gives_the_answers_without_host_time(monkeypatch, asynchronous):
    zero = HostTime({name: Piece(0.0, 0.0, 0.0) for name in HOST.pieces})
    monkeypatch.setattr(HostTime, "load", classmethod(lambda cls, path=None, host_reference_loop_s=None, vllm_version=None: zero))
    with_zero = _replay(asynchronous, True)
    without = _replay(asynchronous, False)
    assert _answers(with_zero) == _answers(without)
    assert set(with_zero.steps.columns()) - set(without.steps.columns()) == {"gpu", "host"}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_host_time_runs_are_exact_with_fast_forward(asynchronous):
    fast, slow = (_replay(asynchronous, True, fast_forward=ff) for ff in (True, False))
    assert _answers(fast) == _answers(slow)
    cols = fast.steps.columns()
    expected = np.maximum(cols["gpu"], cols["host"]) if asynchronous else cols["gpu"] + cols["host"]
    assert np.array_equal(cols["seconds"], expected)


def test_a_request_arriving_during_a_step_runs_two_steps_later_asynchronously():
    # every step takes 10 ms: request 1 arrives at 5 ms, during step 0 (request 0's prefill)
    rows = [(0.0, 100, 4), (0.005, 50, 2)]
    out = {}
    for asynchronous in (False, True):
        options = ReplayOptions(scheduler=SchedulerConfig("chunked", 512, 8, async_scheduling=asynchronous,
                                                          host_time=False), model="Llama-3.1-8B")
        result = replay(make_trace(rows), resolve(options, backend=FixedBackend(0.010)), fast_forward=False)
        out[asynchronous] = result.requests[1]
    assert out[False].first_step_start_s == pytest.approx(0.010)  # step 1
    assert out[True].first_step_start_s == pytest.approx(0.020)  # step 2: step 1 was scheduled at 0
    assert out[True].first_scheduled_s == pytest.approx(0.010)  # when vLLM scheduled step 2 (step 1's start)
    assert out[True].first_token_s == pytest.approx(0.030)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_ttft_parts_of_a_real_replay_add_up_exactly(asynchronous):
    frame = requests_table(_replay(asynchronous, True))
    parts = frame[["ttft_queue_s", "ttft_async_wait_s", "ttft_prefill_s"]].to_numpy()
    assert not np.isnan(parts).any() and (parts >= 0).all()
    total = (frame["ttft_queue_s"] + frame["ttft_async_wait_s"]) + frame["ttft_prefill_s"]
    assert total.tolist() == frame["ttft_s"].tolist()
    assert frame["client_ttft_s"].isna().all() and frame["ttft_api_server_s"].isna().all()


def test_ttft_parts_through_the_api_server_add_up_to_client_ttft():
    from backends.costmodel.optables.profile import ClientOverhead
    from sim.app.validate import ThroughApiServer
    from sim.arrivals import simulate
    from sim.engine import Engine, TokenTimes
    from sim.request import Request

    options = ReplayOptions(scheduler=SchedulerConfig("chunked", 512, 4, 4096), model="Llama-3.1-8B")
    plan = resolve(options, backend=RooflineCostModel(ModelConfig.from_preset("Llama-3.1-8B"), HARDWARE["H100-SXM"]))
    requests = [Request(i, f"r{i}", 0.0, 200 + 37 * i, 6 + i) for i in range(12)]
    engine = Engine(plan.make_policy(), plan.backend, plan.make_block_manager(), TokenTimes(requests), 4096)
    workload = ThroughApiServer(requests, [0.0] * 12, 4, engine, ClientOverhead(), False)
    result = simulate(engine, workload)
    frame = requests_table(result)
    assert frame["client_ttft_s"].notna().all()
    assert [r.client_sent_s for r in result.requests] == [workload.sent_s[r.index] for r in result.requests]
    total = ((frame["ttft_api_server_s"] + frame["ttft_queue_s"]) + frame["ttft_async_wait_s"]) + frame["ttft_prefill_s"]
    assert total.tolist() == frame["client_ttft_s"].tolist()
    assert (frame["ttft_async_wait_s"] > 0).any()  # asynchronous: some wait for the step already queued
