"""A user's policy for tests that must catch a sweep mid-point: chunked, but each step's scheduling
takes 20 ms of wall time, so a point of a few hundred steps runs for seconds (loaded with
--policy tests/data/policies/slow.py:SlowChunked). With SLOW_POLICY_MARKS set to a folder, the
process running a point leaves a file named by its pid there at its first step."""

import os
import time
from pathlib import Path

from policies.chunked import ChunkedPolicy


class SlowChunked(ChunkedPolicy):
    name = "slow-chunked"
    supports_fast_forward = False  # step one by one: every step pays the delay

    def schedule(self, state, now: float):
        marks = os.environ.get("SLOW_POLICY_MARKS")
        if marks:
            (Path(marks) / str(os.getpid())).touch()
        time.sleep(0.02)
        return super().schedule(state, now)
