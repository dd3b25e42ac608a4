"""The one progress bar of the command line: on a terminal's stderr only, silent otherwise.

    label [#########.....................] 12/108 points  1 failed  simulated 63.0 s  0:02 elapsed  ETA 0:16

It redraws at most a few times a second; with `ticking` it also redraws every second between
updates (sweep points can take minutes).
"""

from __future__ import annotations

import sys
import threading
import time

WIDTH = 30


def clock(seconds: float) -> str:
    """0:07, 12:34 or 1:02:03."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    def __init__(self, total: int, unit: str, enabled: bool, label: str = "", done: int = 0, ticking: bool = False):
        self.total, self.unit, self.enabled, self.label = total, unit, enabled, label
        self.initial = self.num_done = done
        self.num_failed = 0
        self.detail = ""
        self.started = time.monotonic()
        self._last = 0.0
        self._shown = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if enabled:
            if total:
                self.update(done, force=True)
            if ticking:
                threading.Thread(target=self._tick, daemon=True).start()

    @classmethod
    def for_replay(cls, num_requests: int, quiet: bool) -> "Progress":
        """A replay's bar: requests finished and simulated time (the engine calls it every 4,096 steps)."""
        return cls(num_requests, "requests finished", enabled=sys.stderr.isatty() and not quiet)

    def __call__(self, now_s: float, num_finished: int) -> None:
        """The engine's progress callback."""
        self.update(num_finished, f"simulated {now_s:,.1f} s")

    def update(self, done: int, detail: str | None = None, force: bool = False) -> None:
        self.num_done = done
        if detail is not None:
            self.detail = detail
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.25 and done < self.total):
            return
        self._last = now
        self._draw(now)

    def fail(self) -> None:
        self.num_failed += 1

    def _draw(self, now: float) -> None:
        elapsed = now - self.started
        done, total = self.num_done, self.total
        new = done - self.initial
        eta = clock(elapsed / new * (total - done)) if new > 0 else "--:--"
        filled = WIDTH * min(done, total) // total if total else WIDTH
        failed = f"  {self.num_failed} failed" if self.num_failed else ""
        detail = f"  {self.detail}" if self.detail else ""
        label = f"{self.label} " if self.label else ""
        with self._lock:
            sys.stderr.write(f"\r  {label}[{'#' * filled}{'.' * (WIDTH - filled)}] {done}/{total} {self.unit}"
                             f"{failed}{detail}  {clock(elapsed)} elapsed  ETA {eta}  ")
            sys.stderr.flush()
            self._shown = True

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            if self.total:
                self._draw(time.monotonic())

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._shown:
                sys.stderr.write("\n")
                self._shown = False
