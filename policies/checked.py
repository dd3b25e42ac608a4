"""User code checked, never trusted: a policy or router loaded from the user's own file or module
is wrapped so that

- every batch its `schedule` returns is checked against the engine's rules (`batch_violation`):
  the token budget, `max_num_seqs` (and the requests running: the admission limit,
  `--max-num-active-seqs`), positive whole token counts, each request once, only requests that
  are running once scheduled (admitted from the waiting queue or already running), token
  counts that the request has, KV blocks that exist and cover the tokens; a violation stops the
  run (a `ServesimError`, exit 2) naming the policy, the step and the rule;
- an exception raised in the user's code stops the run as the user's error, not servesim's:
  "error in your policy FILE:LINE", with the traceback of their code;
- a call that does not return within the policy timeout (`--policy-timeout`, default 10 s)
  stops the run (an interval timer, SIGALRM, in the main thread; elsewhere the call runs
  unbounded, as signals reach only the main thread);
- a router's answer must be an index of the replicas it was shown (`int`, 0 <= i < n: never a
  Python negative index).

The wrapper is a subclass of the user's class that keeps its fast-forward promises as the user
declared them (policies/base.py), so answers are those of the unwrapped class. Built-in policies
are not wrapped in a run (they are servesim's own code, checked by the tests with the same
`batch_violation` on every step of the property tests)."""

from __future__ import annotations

import inspect
import math
import os
import signal
import threading
import time
import traceback
from numbers import Integral
from pathlib import Path
from typing import Any

from policies.base import NO_PROMISES
from sim.batch import Batch
from sim.config import POLICY_TIMEOUT_S
from sim.errors import ServesimError
from sim.request import Status

TIMEOUT_ENV = "SERVESIM_POLICY_TIMEOUT"  # set by the CLI's --policy-timeout; spawned workers inherit it
DEFAULT_TIMEOUT_S = 10.0
_SERVESIM_ROOT = Path(__file__).resolve().parent.parent


def policy_timeout_s() -> float:
    """The bound on one call of a user's policy or router, in seconds (0: none)."""
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ServesimError(f"--policy-timeout must be a number of seconds, got {text!r}") from None
    POLICY_TIMEOUT_S.check("--policy-timeout", value)  # the flag's own range (sim/config.py)
    return value


def batch_violation(batch: Any, state: Any, config: Any, preempted: bool = False) -> str | None:
    """The first of the engine's rules that `batch`, just returned by a policy's `schedule(state,
    now)`, breaks, in words; None when it keeps them all. `config`: the policy's SchedulerConfig;
    `preempted`: that schedule preempted a request."""
    if not isinstance(batch, Batch):
        return f"schedule must return a sim.batch.Batch, it returned {type(batch).__name__}"
    requests = batch.requests
    n = len(requests)
    columns = (batch.num_computed_tokens, batch.num_scheduled_tokens, batch.needs_logits, batch.is_decode)
    if any(len(c) != n for c in columns):
        return "the batch's columns have different lengths (add requests with Batch.add_request)"
    if not n:
        # Beside a step in flight whose finishing requests hold the running list (asynchronous scheduling),
        # vLLM may schedule nothing and schedule again once that step's output is processed (a prefill held by
        # --prefill-schedule-interval while only finishing requests are past theirs): the engine waits so.
        # Nor when the schedule preempted the only requests past their prefill while the cadence held the
        # prefills (vLLM runs that empty step, no model, and schedules again at once: sim/engine.py).
        if state.running and not preempted and not (state.finishing and state.block_manager.pipelined):
            return f"an empty batch while {len(state.running)} requests are running (it may be empty only with none)"
        return None
    if n > config.max_num_seqs:
        return f"{n} requests in one step, more than --max-num-seqs {config.max_num_seqs}"
    if len(state.running) > config.max_num_active_reqs:
        flag = "--max-num-active-seqs" if config.max_num_active_seqs else "--max-num-seqs"
        return f"{len(state.running)} requests running, more than {flag} {config.max_num_active_reqs}"
    running = {id(r) for r in state.running}
    seen: set[int] = set()
    bm = state.block_manager
    block_size, num_blocks = bm.block_size, bm.num_blocks
    total = 0
    for i in range(n):
        r = requests[i]
        num_tokens, num_computed = batch.num_scheduled_tokens[i], batch.num_computed_tokens[i]
        rid = r.request_id if hasattr(r, "request_id") else "?"
        if id(r) in seen:
            return f"request {rid} is in the batch twice"
        seen.add(id(r))
        if not (type(num_tokens) is int or (isinstance(num_tokens, Integral) and not isinstance(num_tokens, bool))) \
                or num_tokens < 1:
            return f"request {rid} is scheduled {num_tokens!r} tokens; each request must get a whole number >= 1"
        total += num_tokens
        status = getattr(r, "status", None)
        if status is not Status.RUNNING or id(r) not in running:
            where = ("not in the running list" if status is Status.RUNNING else
                     f"{status.name.lower()}" if isinstance(status, Status) else "not a request of the engine's queues")
            return (f"request {rid} is scheduled but is {where}: a batch may hold only running requests "
                    "(admit a waiting one with Policy._try_admit)")
        if num_computed != r.num_computed_tokens:
            return (f"request {rid}: the batch says {num_computed!r} tokens computed, the request has "
                    f"{r.num_computed_tokens}")
        if num_computed + num_tokens > r.num_tokens:
            return (f"request {rid} is scheduled {num_tokens} tokens from {num_computed}, past its "
                    f"{r.num_tokens} known tokens (prompt and outputs so far)")
        if batch.needs_logits[i] != (num_computed + num_tokens == r.num_tokens):
            return f"request {rid}: needs_logits must be True exactly when its step reaches its last known token"
        if batch.is_decode[i] and not (num_tokens == 1 and r.is_decoding):
            return f"request {rid} is marked a decode but is not one token of a decoding request"
        table = r.block_table
        if len(table) * block_size < num_computed + num_tokens:
            return (f"request {rid} holds {len(table)} KV blocks of {block_size} tokens, too few for its "
                    f"{num_computed + num_tokens} tokens (reserve them with the Policy helpers)")
        # The blocks this step writes (those of earlier steps were checked at their steps).
        for block in table[num_computed // block_size:(num_computed + num_tokens - 1) // block_size + 1]:
            if type(block) is not int or not 0 <= block < num_blocks:
                return f"request {rid} holds KV block {block!r}, which does not exist (the cache has {num_blocks})"
    k = batch.num_leading_decodes
    if not (0 <= k <= n and all(batch.is_decode[:k])):
        return "num_leading_decodes does not count decodes at the head of the batch"
    budget = config.max_num_batched_tokens
    if total > budget and n > 1:
        return (f"{total} tokens in one step, more than the token budget --max-num-batched-tokens {budget} "
                "(only a batch of one request may exceed it)")
    if bm.num_free_blocks < 0 or not 0 <= bm.num_used_blocks <= num_blocks:
        return (f"{bm.num_used_blocks} KV blocks in use of the {num_blocks} that exist "
                "(reserve blocks only where BlockManager.can_allocate/can_append allow)")
    return None


# What the trace gave a request, which no policy or router may change (sim.request.Request)
GIVEN_FIELDS = ("arrival_s", "num_prompt_tokens", "max_tokens", "priority")


def _given(r) -> tuple:
    return tuple(getattr(r, name, None) for name in GIVEN_FIELDS)


def _changed(before: tuple, after: tuple) -> str:
    return ", ".join(f"{name} from {a!r} to {b!r}" for name, a, b in zip(GIVEN_FIELDS, before, after) if a != b)


SNAPSHOT_EVERY = 16  # calls of schedule between two checks of every request a user's policy holds (`state_violation`)
LEFT = "left the waiting queue and the running list without finishing; only the engine finishes a request (a " \
       "policy may admit or preempt it)"
JOINED = "joined the queues during schedule; requests come from the trace alone"


def cache_shape(state: Any) -> tuple[int, int]:
    bm = state.block_manager
    return bm.block_size, bm.num_blocks


def queue_violation(size: int, shape: tuple[int, int], state: Any) -> str | None:
    """`state_violation`'s rules that take no pass over the queues: as many requests waiting or running
    after `schedule` as before it, and the KV cache's shape unchanged."""
    now = len(state.waiting) + len(state.running)
    if now != size:
        return (f"{abs(size - now)} request{'s' * (abs(size - now) != 1)} {LEFT if now < size else JOINED} "
                f"({size} waiting or running before, {now} after)")
    if cache_shape(state) != shape:
        return (f"the KV cache changed from {shape[1]} blocks of {shape[0]} tokens to {state.block_manager.num_blocks} "
                f"of {state.block_manager.block_size}; the cache is the engine's")
    return None


def unfinished_snapshot(state: Any) -> dict:
    """The requests waiting or running (the engine alone finishes one) and what the trace gave each, which
    a policy's `schedule` must leave as they are (`state_violation`)."""
    return {id(r): (r, _given(r)) for queue in (state.waiting, state.running) for r in queue}


def state_violation(before: dict, state: Any) -> str | None:
    """The first change `schedule` made to the requests that only the engine or the trace may make, naming
    the request; None. A request may move between waiting and running (admitted, preempted), nothing more:
    one that left both was lost (its figures would be missing from the run's), one that came from elsewhere
    was made up; what the trace gave a request (its arrival, prompt, output length, priority) is not the
    policy's to change. (The cache's shape: `queue_violation`.)"""
    after = {id(r): r for queue in (state.waiting, state.running) for r in queue}
    for key, (r, given) in before.items():
        if key not in after:
            return f"request {getattr(r, 'request_id', '?')} {LEFT}"
        if _given(r) != given:
            return (f"request {getattr(r, 'request_id', '?')}'s {_changed(given, _given(r))}: what the trace gave a "
                    "request is not the policy's to change")
    for key, r in after.items():
        if key not in before:
            return f"request {getattr(r, 'request_id', '?')} {JOINED}"
    return None


class _Timeout(BaseException):
    """The policy timeout's alarm (a BaseException, so that a user's `except Exception` does not swallow it)."""


def _on_alarm(signum, frame):
    raise _Timeout()


class _Alarm:
    """`_Timeout` raised in the main thread after `seconds` (an interval timer, SIGALRM), for the block;
    an alarm already set by someone else (pytest-timeout's) is put back with the time it has left. Off
    the main thread, or with 0 seconds, nothing (`on` says which)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.on = seconds > 0 and threading.current_thread() is threading.main_thread()

    def __enter__(self) -> _Alarm:
        if self.on:
            self.previous_handler = signal.signal(signal.SIGALRM, _on_alarm)
            self.previous_timer = signal.setitimer(signal.ITIMER_REAL, self.seconds)
            self.started = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        if self.on:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous_handler)
            if self.previous_timer[0] > 0:
                left = self.previous_timer[0] - (time.monotonic() - self.started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), self.previous_timer[1])


def load_bounded(load, spec: str, what: str):
    """`load()` (sim.plugins.load_class of the user's `spec`), which runs the top level of their module,
    bounded by --policy-timeout as each later call into their code is (in the main thread): a module that
    loops as it loads stops with exit 2, and one that calls sys.exit ends nothing but its loading."""
    seconds = policy_timeout_s()
    with _Alarm(seconds):
        try:
            return load()
        except _Timeout:
            raise ServesimError(f"--{what} {spec}: loading it did not finish within --policy-timeout {seconds:g} "
                                "s (its module's top level runs as it is imported); stopped") from None
        except SystemExit as e:
            raise ServesimError(f"--{what} {spec}: its module called sys.exit({e.code!r}) as it loaded") from None


class _Watchdog:
    """The last resort past the timeout: a call that catches the timeout's exception (a bare `except:`)
    and goes on would run for ever, SIGTERM's exception too. One daemon thread watches the deadline a
    guarded call sets (twice its timeout, at least one second more); past it, it says so and ends the
    process, exit 2 (os._exit: the call holds the main thread). A run folder being written is left as a
    killed command leaves it: the old run whole, the staged one removed by the next --overwrite."""

    def __init__(self):
        self.deadline: float | None = None
        self.call: tuple = ()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def arm(self, seconds: float, call: tuple) -> None:
        """Watch a call (guard, method, step) that may run `seconds`."""
        self.call, self.deadline = call, time.monotonic() + max(2 * seconds, seconds + 1.0)
        if self.thread is None:
            with self.lock:
                if self.thread is None:
                    self.thread = threading.Thread(target=self._watch, name="servesim-policy-watchdog", daemon=True)
                    self.thread.start()

    def disarm(self) -> None:
        self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                guard, method, step = self.call
                at = "" if step is None else f" at step {step}"
                os.write(2, (f"sim: error: your {guard.what} {guard.label} ({guard.spec}): {method}{at} did not "
                             f"return within --policy-timeout {guard.timeout_s:g} s and went on after it was told to "
                             "stop (does it catch every exception, a bare except:?); ended\n").encode())
                os._exit(2)


_WATCHDOG = _Watchdog()


class _Guard:
    """Runs calls into user code: their exceptions become the user's errors, and in the main thread
    a call that outlives the timeout is stopped (SIGALRM from an interval timer; an alarm already
    set by someone else, pytest-timeout's say, is put back afterwards with the time it has left)."""

    def __init__(self, cls: type, what: str, spec: str):
        self.cls, self.what, self.spec = cls, what, spec
        self.label = cls.__qualname__
        self.timeout_s = policy_timeout_s()

    def call(self, method: str, fn, *args, step: int | None = None):
        with _Alarm(self.timeout_s) as alarm:
            if alarm.on:
                _WATCHDOG.arm(self.timeout_s, (self, method, step))  # (its words are made only if it fires)
            try:
                return fn(*args)
            except _Timeout:
                at = "" if step is None else f" at step {step}"
                raise ServesimError(f"your {self.what} {self.label} ({self.spec}): {method} did not return within "
                                    f"--policy-timeout {self.timeout_s:g} s{at}; stopped") from None
            except ServesimError:
                raise
            except SystemExit as e:  # sys.exit() in the user's code would end the command, exit 0, silently
                at = "" if step is None else f" at step {step}"
                raise ServesimError(f"your {self.what} {self.label} ({self.spec}) called sys.exit({e.code!r}) in "
                                    f"{method}{at}: it must return, not end the process") from None
            except Exception as e:
                if getattr(e, "from_outside", False):  # SIGTERM's exception (sim.app.workers.Terminated)
                    raise
                raise ServesimError(self.describe(e, method, step)) from None
            finally:
                if alarm.on:
                    _WATCHDOG.disarm()

    def describe(self, e: BaseException, method: str, step: int | None) -> str:
        """'error in your policy FILE:LINE ...' and the traceback from the user's call on."""
        frames = traceback.extract_tb(e.__traceback__)
        frames = [f for f in frames if Path(f.filename).resolve() != Path(__file__).resolve()]
        try:
            own_file = str(Path(inspect.getfile(self.cls)).resolve())
        except (TypeError, OSError):
            own_file = ""
        place = None
        for f in reversed(frames):
            if str(Path(f.filename).resolve()) == own_file:
                place = f
                break
        if place is None:
            outside = [f for f in frames if not Path(f.filename).resolve().is_relative_to(_SERVESIM_ROOT)]
            place = outside[-1] if outside else (frames[-1] if frames else None)
        where = f"{place.filename}:{place.lineno}" if place is not None else own_file or self.spec
        at = "" if step is None else f" at step {step}"
        lines = "".join(traceback.format_list(frames)).rstrip()
        return (f"error in your {self.what} {where} ({self.label}.{method}{at}): {type(e).__name__}: {e}\n"
                f"Traceback of your {self.what} (most recent call last):\n{lines}")


def checked_policy_class(cls: type, spec: str) -> type:
    """A subclass of the user's policy class whose every call from the engine is guarded and whose
    every batch is checked (`batch_violation`); its fast-forward promises are the user's."""

    def __init__(self, config, *args, **kwargs):
        self._guard = _Guard(cls, "policy", spec)
        self._guard.call("__init__", lambda: cls.__init__(self, config, *args, **kwargs))

    def schedule(self, state, now):
        step, num_preemptions = state.step_index, state.num_preemptions
        # What the policy must leave as it is: the queues' size and the cache's shape at every call (O(1)),
        # each request and what the trace gave it at every SNAPSHOT_EVERY-th (it costs a pass over the queues)
        self._calls = getattr(self, "_calls", 0) + 1  # (calls, not steps: fast-forward leaves steps out)
        before = unfinished_snapshot(state) if self._calls % SNAPSHOT_EVERY == 1 else None
        size, shape = len(state.waiting) + len(state.running), cache_shape(state)
        batch = self._guard.call("schedule", lambda: cls.schedule(self, state, now), step=step)
        problem = (before is not None and state_violation(before, state)) or queue_violation(size, shape, state) \
            or batch_violation(batch, state, self.config, state.num_preemptions > num_preemptions)
        if problem is not None:
            raise ServesimError(f"your policy {self._guard.label} ({spec}) broke a rule of the engine at step "
                                f"{step} (t={now:.6f} s): {problem}")
        return batch

    def guarded(name):
        def method(self, *args):
            return self._guard.call(name, lambda: getattr(cls, name)(self, *args))
        method.__name__ = name
        return method

    def retry_s(self, state, now):
        when = self._guard.call("retry_s", lambda: cls.retry_s(self, state, now), step=state.step_index)
        if when is not None and not (isinstance(when, (int, float)) and not isinstance(when, bool) and when > now
                                     and math.isfinite(when)):
            raise ServesimError(f"your policy {self._guard.label} ({spec}) broke a rule of the engine at step "
                                f"{state.step_index} (t={now:.6f} s): after an empty batch, retry_s answered {when!r}; "
                                f"it must be None (wait for the next arrival) or a time later than now ({now!r}), "
                                "or the engine would try again for ever")
        return when

    # The user's promises, restated (policies.base.Policy.__init_subclass__ asks a subclass that
    # overrides `schedule` to state them): the checked class promises exactly what the user's does.
    namespace: dict[str, Any] = {"promises": getattr(cls, "promises", NO_PROMISES)}
    namespace.update(__init__=__init__, schedule=schedule, retry_s=retry_s, __doc__=cls.__doc__, checked_class=cls)
    if "name" not in vars(cls):  # the engine's messages name it by its own name, else as given, not its base's
        namespace["name"] = f"{cls.__qualname__} ({spec})"
    for name in ("finish_may_admit", "chunk_run_budget"):
        namespace[name] = guarded(name)
    checked = type(cls.__name__, (cls,), namespace)
    checked.__qualname__ = f"checked({cls.__qualname__})"
    return checked


class _Blind:
    """The replicas shown to a router that promised `reads_state = False` (policies/routers.py): how many
    there are, and nothing of their state, which it is asked before the run starts (sim/cluster.py,
    `_route_ahead`): a router that read it anyway would route every request on the empty replicas."""

    def __init__(self, replicas, who: str):
        self._replicas, self._who = replicas, who

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i):
        self._replicas[i]  # (an index out of range fails as it would)
        return _BlindView(self._who)


class _BlindView:
    def __init__(self, who: str):
        self._who = who

    def __getattr__(self, name: str):
        raise ServesimError(f"{self._who} declares reads_state = False, so it is asked where each request goes before "
                            f"the run starts, but it read a replica's {name}; declare reads_state = True (or leave "
                            "it out) to be asked as each request arrives")


def checked_router_class(cls: type, spec: str) -> type:
    """A subclass of the user's router class whose `route` is guarded and must answer an index of
    the replicas it was shown."""

    def __init__(self, *args, **kwargs):
        self._guard = _Guard(cls, "router", spec)
        self._guard.call("__init__", lambda: cls.__init__(self, *args, **kwargs))

    def route(self, request, replicas):
        given = _given(request)
        shown = replicas if self.reads_state else _Blind(replicas, f"your router {self._guard.label} ({spec})")
        choice = self._guard.call("route", lambda: cls.route(self, request, shown))
        if _given(request) != given:
            raise ServesimError(f"your router {self._guard.label} ({spec}) changed request "
                                f"{getattr(request, 'request_id', '?')}'s {_changed(given, _given(request))}; a "
                                "router picks a replica and must leave the request as the trace gave it")
        n = len(replicas)
        if isinstance(choice, bool) or not isinstance(choice, Integral) or not 0 <= choice < n:
            raise ServesimError(f"your router {self._guard.label} ({spec}) answered {choice!r} for request "
                                f"{getattr(request, 'request_id', '?')}; route must return the index of a replica "
                                f"it was shown, a whole number from 0 to {n - 1}")
        return int(choice)

    namespace: dict[str, Any] = {"reads_state": getattr(cls, "reads_state", True), "__init__": __init__,
                                 "route": route, "__doc__": cls.__doc__, "checked_class": cls}
    checked = type(cls.__name__, (cls,), namespace)
    checked.__qualname__ = f"checked({cls.__qualname__})"
    return checked
