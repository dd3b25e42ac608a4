"""Local worker processes that die with the command that started them.

A sweep's `--jobs N` pool runs points in spawned processes. Were the command killed (SIGKILL,
the OOM killer), its workers would otherwise live on, replaying points nobody will read. Each
worker therefore asks Linux to kill it when its parent dies (prctl PR_SET_PDEATHSIG), and, where
that is not available, watches its parent id: once the parent is gone the worker is re-parented
and exits. SIGTERM of the command itself is turned into an exception (`terminate_on_sigterm`), so
its `finally` blocks stop the workers and release the folder lock.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

PR_SET_PDEATHSIG = 1  # linux/prctl.h
WATCH_S = 0.5


class Terminated(BaseException):
    """SIGTERM reached the command (exit 143, as a shell reports a process ended by SIGTERM). A
    BaseException, as KeyboardInterrupt is: no `except Exception` (a user's policy's, a library's)
    swallows it, so every command ends promptly on SIGTERM."""

    from_outside = True  # not the user's code's error, where it interrupts it (policies/checked.py)


def terminate_on_sigterm():
    """In the command's main thread: SIGTERM raises Terminated instead of ending it at once.
    Returns the handler it replaced (for `signal.signal` to restore), None off the main thread."""
    def handler(signum, frame):
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def pool(num_workers: int) -> ProcessPoolExecutor:
    """A spawn pool whose workers die with this process."""
    import multiprocessing  # (here: every command imports this module, few start a pool)
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(os.getpid(),))


def stop(executor: ProcessPoolExecutor) -> None:
    """Stop the pool at once, killing points still running (after an interrupt or an error)."""
    processes = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()


def _init_worker(parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the request above
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_S)
    os._exit(1)
