"""Host time per step (backends/host_time.py): the committed profile, monotone in requests and tokens,
exact on worked examples, carried to another CPU by the reference loop ratio, and overlapped with the
GPU exactly as stated (sum when synchronous, the longer when asynchronous)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.host_time import DEFAULT_PROFILE, HOST_DIR, PIECES, HostTime, Piece, choose_profile, measured_profiles, overlap
from sim.errors import ServesimError

seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


def test_overlap_worked_examples():
    assert overlap(0.020, 0.003, asynchronous=False) == 0.020 + 0.003
    assert overlap(0.020, 0.003, asynchronous=True) == 0.020
    assert overlap(0.002, 0.005, asynchronous=True) == 0.005
    assert overlap(3.0, 5.0, asynchronous=False) == 8.0
    assert overlap(0.0, 0.0, asynchronous=True) == 0.0
    with pytest.raises(ValueError):
        overlap(-1.0, 0.0, asynchronous=True)


@given(seconds, seconds)
def test_overlap_rule(gpu, host):
    assert overlap(gpu, host, False) == gpu + host
    assert overlap(gpu, host, True) == max(gpu, host)
    assert overlap(gpu, host, True) <= overlap(gpu, host, False)


PROFILES = sorted(measured_profiles().values())


def test_profiles_are_committed():
    assert {"0.33.0", "0.34.0"} <= set(measured_profiles())
    assert DEFAULT_PROFILE.name == "vllm-0.34.0-amd-epyc.json"  # the newest measured


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_committed_profile_loads(path):
    host = HostTime.load(path)
    assert set(host.pieces) == set(PIECES)
    assert path.name.startswith(f"vllm-{host.vllm_version}-") and host.cpu and host.reference_loop_s > 0
    data = json.loads(path.read_text())
    assert data["rows"], "the profile keeps the measured rows it was fitted to"
    assert data["grid"]["requests"] == "1,2,4,8,16,32,48,64,96,128,192,256,384,512"
    # A 256-request decode step costs somewhere between 100 us and 100 ms on any CPU the profile describes.
    assert 1e-4 < host.step_seconds(256, 256) < 0.1


def test_version_choice():
    """The run's vLLM version picks its profile: its own, else the nearest measured (a tie to the newer),
    none: the newest; vLLM 0.12 has its own (the synchronous deployments' version), before it 0.12's."""
    assert choose_profile("0.34.0") == (HOST_DIR / "vllm-0.34.0-amd-epyc.json", "as asked")
    assert choose_profile("0.33.0") == (HOST_DIR / "vllm-0.33.0-amd-epyc.json", "as asked")
    assert choose_profile("0.12.0") == (HOST_DIR / "vllm-0.12.0-amd-epyc.json", "as asked")
    assert choose_profile(None) == (HOST_DIR / "vllm-0.34.0-amd-epyc.json", "the newest")
    path, how = choose_profile("0.14.0")
    assert path.name == "vllm-0.12.0-amd-epyc.json" and how.startswith("the nearest to 0.14.0")
    assert choose_profile("0.30.0")[0].name == "vllm-0.33.0-amd-epyc.json"
    assert choose_profile("0.33.4")[0].name == "vllm-0.33.0-amd-epyc.json"
    assert choose_profile("0.35.0")[0].name == "vllm-0.34.0-amd-epyc.json"
    host = HostTime.load(vllm_version="0.10.1.1")
    assert host.vllm_version == "0.12.0" and host.asked_version == "0.10.1.1"
    assert "vLLM 0.12.0's profile" in host.note() and "the nearest to 0.10.1.1" in host.note()
    assert HostTime.load().vllm_version == "0.34.0"


def test_version_choice_by_hand(tmp_path):
    for name in ("vllm-0.33.0-cpu-a.json", "vllm-0.36.0-cpu-a.json", "notes.json", "vllm-x-cpu.json"):
        (tmp_path / name).write_text("{}")
    assert set(measured_profiles(tmp_path)) == {"0.33.0", "0.36.0"}
    assert choose_profile("0.34.0", tmp_path)[0].name == "vllm-0.33.0-cpu-a.json"  # 1 minor release off, not 2
    assert choose_profile("0.35.0", tmp_path)[0].name == "vllm-0.36.0-cpu-a.json"
    assert choose_profile("0.34.500", tmp_path)[0].name == "vllm-0.36.0-cpu-a.json"  # 0.36.0 is 1,500 - 500 off
    assert choose_profile(None, tmp_path)[0].name == "vllm-0.36.0-cpu-a.json"


def test_missing_profile_is_refused(tmp_path):
    with pytest.raises(ServesimError, match="no host time profile .* bench/host_time.py, or run with --no-host-time"):
        choose_profile("0.34.0", tmp_path)
    with pytest.raises(ServesimError, match="no host time profile"):
        choose_profile(None, tmp_path / "absent")


def _profile():
    return HostTime({"schedule": Piece(10e-6, 2e-6, 0.1e-6), "update_from_output": Piece(5e-6, 1e-6, 0.0)},
                    reference_loop_s=0.2)


def test_step_seconds_worked_example():
    host = _profile()
    # (10 + 2*4 + 0.1*100) + (5 + 1*4) = 28 + 9 = 37 us
    assert host.step_seconds(4, 100) == pytest.approx(37e-6, rel=1e-12)
    assert host.piece_seconds(4, 100) == pytest.approx({"schedule": 28e-6, "update_from_output": 9e-6}, rel=1e-12)
    assert host.step_seconds(0, 0) == 0.0


def test_critical_seconds_worked_example():
    host = HostTime({"schedule": Piece(10e-6, 0, 0), "prepare_inputs": Piece(30e-6, 0, 0),
                     "sample_bookkeeping": Piece(5e-6, 0, 0), "update_from_output": Piece(20e-6, 0, 0)})
    # One GPU (the model runner on the engine core's thread), or synchronous: all four in series, 65 us.
    assert host.critical_seconds(1, 1, asynchronous=True, multiprocess=False) == pytest.approx(65e-6, rel=1e-12)
    assert host.critical_seconds(1, 1, asynchronous=False, multiprocess=True) == pytest.approx(65e-6, rel=1e-12)
    # Asynchronous with worker processes: the engine core's 30 us beside the workers' 35 us.
    assert host.critical_seconds(1, 1, asynchronous=True, multiprocess=True) == pytest.approx(35e-6, rel=1e-12)


def test_carried_by_reference_loop_ratio(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"reference_loop_s": 0.2, "cpu": "X", "vllm_version": "0.33.0",
                                "pieces": {"schedule": {"fixed_s": 10e-6, "per_request_s": 2e-6, "per_token_s": 0}}}))
    assert HostTime.load(path).step_seconds(5, 5) == pytest.approx(20e-6)
    faster = HostTime.load(path, host_reference_loop_s=0.1)  # a host twice as fast
    assert faster.scale == 0.5
    assert faster.step_seconds(5, 5) == pytest.approx(10e-6)


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
@given(reqs=st.integers(1, 2048), more_reqs=st.integers(0, 2048), tokens=st.integers(0, 64),
       more_tokens=st.integers(0, 65536))
def test_monotone_in_requests_and_tokens(path, reqs, more_reqs, tokens, more_tokens):
    host = HostTime.load(path)
    tokens = max(tokens, reqs)
    base = host.step_seconds(reqs, tokens)
    assert host.step_seconds(reqs + more_reqs, tokens) >= base
    assert host.step_seconds(reqs, tokens + more_tokens) >= base
    assert host.step_seconds(reqs + more_reqs, tokens + more_tokens + more_reqs) >= base
    assert base > 0


def test_bad_profiles_are_refused(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(ServesimError, match="none.json"):
        HostTime.load(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ServesimError, match="bad.json: cannot read it as JSON"):
        HostTime.load(bad)
    negative = tmp_path / "neg.json"
    negative.write_text(json.dumps({"pieces": {"schedule": {"fixed_s": 1e-6, "per_request_s": -1e-6,
                                                            "per_token_s": 0}}}))
    with pytest.raises(ServesimError, match="non-negative"):
        HostTime.load(negative)
    no_reference = tmp_path / "noref.json"
    no_reference.write_text(json.dumps({"pieces": {}}))
    with pytest.raises(ServesimError, match="reference_loop_s"):
        HostTime.load(no_reference, host_reference_loop_s=0.1)
