"""A user's own policy loads from a file without editing servesim, and fast-forward never
changes its answers: a policy that does not declare the fast-forward promise is stepped one by
one, so the request and step tables are identical with fast-forward on and off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from policies import POLICIES, load_policy
from policies.base import Policy, Promises
from policies.chunked import ChunkedPolicy
from reports.run_tables import read_run_table
from sim.app.cli import main
from sim.errors import ServesimError

PATIENT = Path(__file__).parent / "data" / "policies" / "patient.py"
SPEC = f"{PATIENT}:PatientPolicy"


def test_a_user_policy_loads_from_a_file_and_makes_no_fast_forward_promise():
    cls = load_policy(SPEC)
    assert issubclass(cls, Policy) and cls.name == "patient"
    assert cls.promises == Promises() == Policy.promises
    assert all(POLICIES[name].promises.fast_forward and POLICIES[name].promises.decodes_all_when_none_waits
               for name in POLICIES)
    assert [name for name in POLICIES if POLICIES[name].promises.repeats_full_chunk_steps] == ["chunked"]


def test_a_subclass_inherits_its_promises_or_states_them_never_loses_them_silently():
    class Renamed(ChunkedPolicy):
        name = "renamed"  # changes nothing the promises are about: inherited

    class Keeps(ChunkedPolicy):
        promises = ChunkedPolicy.promises  # restated: it checked they still hold

        def schedule(self, state, now):
            return super().schedule(state, now)

    class Makes(ChunkedPolicy):
        promises = Promises()

        def schedule(self, state, now):
            return super().schedule(state, now)

    class FromScratch(Policy):  # nothing to inherit: no promise
        def schedule(self, state, now):
            raise NotImplementedError

    assert Renamed.promises == Keeps.promises == ChunkedPolicy.promises
    assert Makes.promises == FromScratch.promises == Promises()
    with pytest.raises(TypeError, match=r"Waits overrides schedule and would inherit the promises .*"
                                        r"promises = Promises\(\)"):
        class Waits(ChunkedPolicy):
            def schedule(self, state, now):
                return super().schedule(state, now)
    with pytest.raises(TypeError, match="must be a policies.base.Promises"):
        class Flag(ChunkedPolicy):
            promises = True  # type: ignore[assignment]


def test_a_policy_declaring_the_old_flags_keeps_working():
    """Before `Promises`, the promises were three booleans in the class body; a policy written
    that way gets the same promises as before (undeclared ones inherited, or none where it
    overrides scheduling, the old rule), and may not mix both ways."""
    class Declares(ChunkedPolicy):
        supports_fast_forward = True

        def schedule(self, state, now):
            return super().schedule(state, now)

    class Steps(ChunkedPolicy):
        supports_fast_forward = False

    class Renamed(Declares):
        decodes_all_when_none_waits = True

    assert Declares.promises == Promises(fast_forward=True)
    assert Steps.promises == Promises(False, True, True)
    assert Renamed.promises == Promises(True, True, False)
    with pytest.raises(TypeError, match="sets both"):
        class Both(ChunkedPolicy):
            promises = Promises()
            supports_fast_forward = False


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
        promises = Promises()  # it overrides scheduling: it states its promises (none)

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
        assert main(["replay", str(trace), "--policy", SPEC, "--out", str(out), "--quiet", "--no-async-scheduling", "--no-host-time",
                     *flag]) == 0  # (the step count below is synchronous scheduling's)
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


def test_a_user_subclass_that_would_inherit_promises_silently_is_a_one_line_error(tmp_path, capsys):
    source = tmp_path / "waits.py"
    source.write_text("from policies.chunked import ChunkedPolicy\n\n\nclass Waits(ChunkedPolicy):\n"
                      "    def schedule(self, state, now):\n        return super().schedule(state, now)\n")
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,4\n")
    assert main(["replay", str(trace), "--policy", f"{source}:Waits", "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Waits overrides schedule" in err and "promises = Promises()" in err


def test_a_policy_that_wakes_the_engine_at_an_arrivals_instant_replays(tmp_path):
    """The engine wakes itself at the policy's retry time while the workload waits for the next
    arrival: at 0.05 s the patient policy admits the first request, and the second arrives at
    0.06 s while the engine is busy (the workload must not wake an engine that is awake)."""
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,400\n0.06,100,400\n")
    assert main(["replay", str(trace), "--policy", SPEC, "--out", str(tmp_path / "r"), "--quiet"]) == 0
    requests = pd.read_csv(tmp_path / "r" / "requests.csv")
    assert requests["status"].tolist() == ["finished", "finished"]


def test_a_policy_that_holds_requests_back_for_ever_is_the_policys_error(tmp_path, capsys):
    """Nothing scheduled, nothing more to arrive and no retry time: the run stops with exit 2
    naming the policy's contract (Policy.retry_s), not as an internal error of servesim."""
    policy = tmp_path / "never.py"
    policy.write_text("from policies.base import Policy\nfrom sim.batch import Batch\n\n\n"
                      "class Never(Policy):\n    name = 'never'\n\n"
                      "    def schedule(self, state, now):\n        return Batch()\n")
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,4\n")
    assert main(["replay", str(trace), "--policy", f"{policy}:Never", "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "policy never scheduled nothing" in err and "Policy.retry_s" in err and "internal error" not in err
