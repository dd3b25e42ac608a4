"""Run every parity case and print how many runs and requests agree with vLLM's V1 scheduler:

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD python -m tests.parity.run [NAME_SUBSTRING]
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD python -m tests.parity.run --async [NAME_SUBSTRING]

`--async` runs vLLM's AsyncScheduler on every case (vLLM's side only, for now) and prints, per case, its
steps and how many requests' first-token and finish times differ from vLLM's synchronous scheduling.
"""

from __future__ import annotations

import sys

from tests.parity.cases import Agreement, Case, all_cases, async_variant, compare, step_time
from tests.parity.servesim_driver import run_servesim, vllm_requests
from tests.parity.vllm_driver import Timeline, run_vllm, run_vllm_async

_vllm_timelines: dict[str, Timeline] = {}


def vllm_timeline(case: Case) -> Timeline:
    """vLLM's answer for a case, computed once (both fast-forward settings compare against it)."""
    if case.name not in _vllm_timelines:
        run = run_vllm_async if case.setup.async_scheduling else run_vllm
        _vllm_timelines[case.name] = run(vllm_requests(case.trace, case.setup, case.priority), case.setup, step_time)
    return _vllm_timelines[case.name]


def check(case: Case, fast_forward: bool) -> tuple[Agreement, Timeline, Timeline]:
    vllm = vllm_timeline(case)
    servesim = run_servesim(case.trace, case.setup, step_time, fast_forward, case.priority)
    return compare(vllm, servesim), vllm, servesim


def assert_schedules_as_vllm(case: Case, fast_forward: bool) -> None:
    """The parity tests' assertion: the same steps (naming the first that differs), every request's
    first-token and finish time, and the prefix-cache queries and hits."""
    agreement, vllm, servesim = check(case, fast_forward)
    k = agreement.first_step_differing
    assert k is None, (f"step {k}: vLLM (prefill, decode, preemptions) "
                       f"{vllm.steps[k] if k < len(vllm.steps) else 'none'}, servesim "
                       f"{servesim.steps[k] if k < len(servesim.steps) else 'none'}")
    assert servesim.first_token_s == vllm.first_token_s
    assert servesim.finish_s == vllm.finish_s
    assert (servesim.prefix_queries, servesim.prefix_hits) == (vllm.prefix_queries, vllm.prefix_hits)
    assert agreement.agrees


def main_async(pattern: str) -> int:
    """vLLM's asynchronous scheduling beside its synchronous scheduling, case by case."""
    for case in all_cases():
        if pattern not in case.name:
            continue
        sync, asynchronous = vllm_timeline(case), vllm_timeline(async_variant(case))
        a = compare(sync, asynchronous)
        print(f"{case.name:28s} steps sync {len(sync.steps)} async {len(asynchronous.steps)};"
              f" requests with the same times {a.num_requests_agreeing}/{a.num_requests};"
              f" last finish sync {max(f for f in sync.finish_s if f is not None):.0f}"
              f" async {max(f for f in asynchronous.finish_s if f is not None):.0f}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--async":
        return main_async(argv[1] if len(argv) > 1 else "")
    pattern = argv[0] if argv else ""
    runs = agreeing_runs = requests = agreeing_requests = 0
    for case in all_cases():
        if pattern not in case.name:
            continue
        for ff in (True, False):
            a, vllm, servesim = check(case, ff)
            runs += 1
            agreeing_runs += a.agrees
            requests += a.num_requests
            agreeing_requests += a.num_requests_agreeing
            detail = ""
            if a.first_step_differing is not None:
                k = a.first_step_differing
                detail = (f" first differing step {k}: vllm {vllm.steps[k] if k < len(vllm.steps) else None}"
                          f" servesim {servesim.steps[k] if k < len(servesim.steps) else None}")
            print(f"{case.name:28s} ff={'on ' if ff else 'off'} {'agree' if a.agrees else 'DIFFER'}"
                  f" requests {a.num_requests_agreeing}/{a.num_requests}"
                  f" prefix vllm {vllm.prefix_hits}/{vllm.prefix_queries}"
                  f" servesim {servesim.prefix_hits}/{servesim.prefix_queries}{detail}", flush=True)
    print(f"runs agreeing: {agreeing_runs} of {runs}; requests agreeing: {agreeing_requests} of {requests}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
