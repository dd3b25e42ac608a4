"""A user's own policy loads from a file without editing servesim, and fast-forward never
changes its answers: a policy that does not declare the fast-forward promise is stepped one by
one, so the request and step tables are identical with fast-forward on and off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from policies import POLICIES, load_policy
from policies.base import Policy
from policies.chunked import ChunkedPolicy
from reports.run_tables import read_run_table
from sim.app.cli import main
from sim.errors import ServesimError

PATIENT = Path(__file__).parent / "data" / "policies" / "patient.py"
SPEC = f"{PATIENT}:PatientPolicy"


def test_a_user_policy_loads_from_a_file_and_makes_no_fast_forward_promise():
    cls = load_policy(SPEC)
    assert issubclass(cls, Policy) and cls.name == "patient"
    assert cls.supports_fast_forward is False
    assert cls.decodes_all_when_none_waits is False
    assert all(POLICIES[name].supports_fast_forward for name in POLICIES)


def test_a_subclass_that_changes_scheduling_loses_an_inherited_promise():
    class Waits(ChunkedPolicy):
        def schedule(self, state, now):
            return super().schedule(state, now)

    class Declares(ChunkedPolicy):
        supports_fast_forward = True

        def schedule(self, state, now):
            return super().schedule(state, now)

    class Renamed(ChunkedPolicy):
        name = "renamed"  # changes nothing the promise is about

    assert Waits.supports_fast_forward is False
    assert Declares.supports_fast_forward is True
    assert Renamed.supports_fast_forward is True
    # The second promise (a run may begin with the step that admitted a request) goes the same way.
    assert all(POLICIES[name].decodes_all_when_none_waits for name in POLICIES)
    assert Policy.decodes_all_when_none_waits is False
    assert Waits.decodes_all_when_none_waits is False
    assert Declares.decodes_all_when_none_waits is False  # it declared the first promise only
    assert Renamed.decodes_all_when_none_waits is True


def test_a_subclass_overriding_schedule_decodes_is_called_as_before():
    # A subclass of ChunkedPolicy that overrides _schedule_decodes (three arguments) is called on
    # every step's leading decodes, and schedules as ChunkedPolicy does when it defers to it.
    from dataclasses import replace

    from sim.app.plan import resolve
    from sim.app.replay import ReplayOptions, replay
    from sim.config import CacheConfig, SchedulerConfig
    from traces import AZURE_CONV_SAMPLE, read_trace
    from traces.transforms import apply

    calls = []

    class Counting(ChunkedPolicy):
        def _schedule_decodes(self, state, batch, decoders):
            calls.append(len(decoders))
            return super()._schedule_decodes(state, batch, decoders)

    trace = apply(read_trace(AZURE_CONV_SAMPLE), num_requests=60)
    options = ReplayOptions(scheduler=SchedulerConfig("chunked"), cache=CacheConfig(num_blocks=3000))
    plain = replay(trace, resolve(options))
    counted = replay(trace, replace(resolve(options), policy=Counting))
    assert len(calls) > 100 and max(calls) > 1
    assert np.array_equal(counted.token_times, plain.token_times, equal_nan=True)


@pytest.mark.parametrize("spec,message", [
    ("nope", "unknown policy 'nope'"),
    ("missing.py:X", "no such file: missing.py"),
    (f"{PATIENT}:Nope", "has no class 'Nope'"),
    ("pathlib:Path", "is not a subclass of policies.base.Policy"),
    ("no_such_module_xyz:X", "cannot import module 'no_such_module_xyz'"),
])
def test_bad_policy_specs_are_one_line_errors(spec, message):
    with pytest.raises(ServesimError, match=message.replace(".", r"\.")):
        load_policy(spec)


def test_fast_forward_cannot_change_a_user_policys_answers(tmp_path):
    # Two requests: request 1 arrives while request 0 decodes, and is admitted only 0.05 s later.
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,400\n0.02,100,400\n")
    tables = []
    for flag in ([], ["--no-fast-forward"]):
        out = tmp_path / f"run{len(tables)}"
        assert main(["replay", str(trace), "--policy", SPEC, "--out", str(out), "--quiet", *flag]) == 0
        tables.append((pd.read_csv(out / "requests.csv"), read_run_table(out, "steps")))
    (fast_requests, fast_steps), (slow_requests, slow_steps) = tables
    pd.testing.assert_frame_equal(fast_requests, slow_requests)
    pd.testing.assert_frame_equal(fast_steps, slow_steps)
    scheduled = fast_requests["first_scheduled_s"].tolist()
    assert scheduled[0] == 0.05  # the engine slept until the policy's retry time
    # Request 1 waited 0.05 s too: admitted at the first step start from 0.07 s on, mid-decode of request 0,
    # not at the end of a fast-forwarded run of request 0's 400 decodes.
    step_starts = fast_steps["start_s"].to_numpy()
    assert scheduled[1] == step_starts[step_starts >= 0.07][0] < 0.08
    assert len(fast_steps) == 404  # r0's prefill; 399 steps with r0's decodes (r1's prefill rides in the 4th); r1's last 4
