"""Other clocks for the real backend's measured steps."""

from __future__ import annotations

import time

from sim.backend import StepResult
from sim.batch import Batch
from sim.errors import ServesimError

CLOCKS = ("wall", "thread")


class ThreadClock:
    """A CPU backend's steps timed by the calling thread's CPU time (`time.thread_time`) instead of
    the wall clock: on a shared machine, time the thread spends descheduled for other processes
    then does not count. Valid for the real backend's CPU path, which runs single-threaded in the
    calling thread. The backend's own breakdown is scaled to add up to the new total."""

    supports_fast_forward = False

    def __init__(self, backend):
        if str(backend.device) != "cpu":
            raise ServesimError("--clock thread times the CPU path; use --clock wall on a GPU")
        self.backend = backend
        self.name, self.device, self.dtype = backend.name, backend.device, backend.dtype
        self.device_name = backend.device_name
        self.block_size, self.num_blocks = backend.block_size, backend.num_blocks

    def execute(self, batch: Batch) -> StepResult:
        start = time.thread_time()
        result = self.backend.execute(batch)
        seconds = time.thread_time() - start
        scale = seconds / result.seconds if result.seconds > 0 else 0.0
        return StepResult(seconds, {k: v * scale for k, v in result.breakdown.items()}, result.sampled_token_ids)


def with_clock(backend, clock: str):
    if clock not in CLOCKS:
        raise ServesimError(f"unknown --clock {clock!r}; choose one of {', '.join(CLOCKS)}")
    return ThreadClock(backend) if clock == "thread" else backend
