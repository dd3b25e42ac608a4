"""Fast-forward: planning runs of steps (`Run`) that the engine applies in one go.

Fast-forward only plans: `FastForward.plan` and `plan_chunks` read the engine's state, the
workload's next events and the backend's costs, and return a `Run` or None, changing nothing.
`Engine.apply` (sim/engine.py) makes a run's effects, as it makes a single step's.

Most steps of a long replay are decode-only steps of the same requests. Once the policy has
scheduled such a step (every running request decodes, nothing was preempted), the steps that
follow are the same batch with every context one token longer, for as long as:

- no request arrives (a step starting at or after the workload's next arrival is scheduled
  normally),
- nothing outside reads the engine's state meanwhile: a run's steps end before the workload's
  `next_observation_s` (a cluster's router reads every replica at each arrival), so what it reads
  is what step-by-step simulation would show,
- the free blocks cover the blocks the contexts grow into (taken in the order step-by-step
  scheduling would take them; blocks that finishing requests free are not counted on),
- no request finishes, unless its freed slot and blocks could not let a waiting request in
  (`Policy.finish_may_admit`) and the workload sends nothing when a request finishes (a closed
  loop does): then the others decode on without it.

This is a promise about the policy: that, meanwhile, it would schedule exactly the same decodes
and admit no one. A policy makes it in its `promises` (`Promises.fast_forward`, see
policies/base.py); for any other policy the engine steps one by one. The backend makes its own
promise: `decode_run` costs each step of the run exactly as `execute` would. So the engine costs
the whole run in one call and advances the clock once; the answers are exactly those of
step-by-step simulation (tests/test_fast_forward.py checks it).

A run may also begin one step earlier, with the step that admitted a request (a mixed step, or a
prefill step), when after it every running request is decoding and none waits (a folded run): that
step is costed by the backend's `execute`, the steps after it as above, and one plan, one move of
the clock, one update of the requests and one write to the step log take both. This rests on the
policy's second promise (`Promises.decodes_all_when_none_waits`): with none waiting and every
running request decoding, its next step decodes them all. It saves, per arrival, a call of the
policy and a single step's bookkeeping. The step must schedule every running request, in running
order, without preempting. An engine that applies its steps one by one (`Engine.plans_runs =
False`: a prefill replica hands its requests off after their first token) plans no runs.

Under a queue of long prompts most steps are the running requests' decodes and one prompt's
prefill chunk, which together fill the budget: a chunk run (`plan_chunks`; Engine._apply_chunk_run) takes
them in one go, from the step before them (which may end one prompt and begin the next) until the
prompt's last chunk, decodes leaving as they finish. It rests on the policy's third promise
(`Promises.repeats_full_chunk_steps`) and on the backend's `chunk_steps` (exactly `execute`'s seconds).
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from sim.batch import Batch

if TYPE_CHECKING:
    from sim.backend import ChunkStepsBackend, DecodeRunBackend, StepResult
    from sim.engine import Engine

MAX_RUN_STEPS = 4096  # bounds the arrays of one run
# Sizing a decode run before the next arrival or observation, from the last decode step's length
# L (the steps of a run grow slowly, one token of context each, so the next ones are about L).
# These only size what is costed: the run is then cut exactly where the event falls (`plan`), so
# they change how much work planning does, never an answer.
# - A step is taken to last at least STEP_SLACK * L: a run is not tried when the event falls
#   before the steps it needs could end (two from step 0's start, one from a folded step 0's end).
# - As many steps are costed as COST_MARGIN * (time to the event) / L, plus the step that crosses
#   the event and one spare (and, for a folded run, its step 0, which is before that time).
STEP_SLACK = 0.9
COST_MARGIN = 1.25
SPARE_STEPS = 2  # the step that crosses the event, and one more
# A chunk run shorter than this is stepped one by one instead: planning and applying a run costs
# about what stepping two or three steps does (the same answers either way).
MIN_CHUNK_RUN_STEPS = 3


class Run(NamedTuple):
    """k >= 1 steps of the same running requests, from the batch the policy scheduled (step 0):
    what `Engine.apply` applies. A single step is a run of one (`single_step`). Fast-forward plans
    longer ones, of two kinds:

    - decode runs (`chunks` None): step 0 as scheduled, then decode-only steps of the requests
      still running, one token each;
    - chunk runs: step 0 as scheduled (each request but the last computing all its tokens, the
      last a prefill chunk), then the same requests while they last, all but the last decoding
      and the last carried forward by `chunks[j - 1]` tokens in step j.

    Step 0 is priced already (`first`, the backend's `execute`) unless a decode run costs it with
    the others (`first` None: step 0 is a decode-only step)."""

    ends: list[float]  # [k] each step's end, as the clock adds the steps' seconds one by one
    first: "StepResult | None"  # step 0's cost, from execute; None: costed in `seconds` (a decode run)
    seconds: "np.ndarray | list[float]"  # the steps costed by the run: [k], or [k - 1] after a priced step 0
    parts: dict  # their breakdown (the backend's): per key a float (every step) or an array like `seconds`
    opens: list[int]  # step * n + index of each block the decodes open in steps 1.., in the order taken (n: decodes)
    active_steps: list[int]  # per decode, the steps it takes part in (it finishes in the last, or runs on)
    chunks: list[int] | None = None  # a chunk run's prefill tokens in steps 1..; None: a decode run
    num_decodes: list[int] | None = None  # a chunk run's decodes in steps 1..
    num_preempted: int = 0  # requests step 0 preempted (a run of more than one step preempts none)
    # Step 0's start, as its step-log row records it (the policy has reserved its blocks). Read
    # when the run is planned: in a cluster the clock then moves through the run before it is
    # applied, and meanwhile a KV transfer that ends may free blocks of this replica's.
    num_used_blocks: int = 0
    num_waiting: int = 0


_new_tuple = tuple.__new__  # makes a Run (every field given) without the NamedTuple's own __new__, a Python call per run
_NONE: list = []  # a single step's empty fields, shared: never changed
_NO_PARTS: dict = {}


def single_step(start: float, result: "StepResult", num_preempted: int, num_used_blocks: int, num_waiting: int) -> Run:
    """The run of one step: `result` (the backend's `execute`) from `start`."""
    return _new_tuple(Run, ([start + result.seconds], result, _NONE, _NO_PARTS, _NONE, _NONE, None, None,  # type: ignore[return-value]
                            num_preempted, num_used_blocks, num_waiting))


class FastForward:
    """Plans the runs of one engine: reads the engine's state, the workload and the backend's
    costs, and changes nothing (Engine.apply applies what it plans)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.backend = cast("DecodeRunBackend", engine.backend)  # the engine makes a FastForward for such a backend only
        self._last_decode_step_s = 0.0  # sizes the next decode run (planning's own memory, not the engine's state)

    def plan(self, batch: Batch, now: float, first: "StepResult | None" = None) -> Run | None:
        """The run of steps starting with `batch` (already scheduled), or None when it would be a
        single step. Without `first`, `batch` is a decode-only step of every running request and
        the run's steps are all costed as decode steps. With `first` (its cost, from the backend's
        `execute`), `batch` is a step of every running request after which every one of them has
        computed all its tokens (each emits one) and none waits: with the policy's
        `decodes_all_when_none_waits` promise, the steps after it are decode-only steps of the
        requests that did not finish in it (a folded run)."""
        reqs = batch.requests
        remaining = [r.max_tokens - r.num_output_tokens for r in reqs]
        # Past a finish the same requests keep decoding unless the freed slot or blocks could let
        # a waiting request in.
        engine = self.engine
        workload = engine.workload
        # Asynchronously a finish frees its blocks only after the next step is scheduled: runs end at one.
        through_finishes = not (engine.asynchronous or engine.policy.finish_may_admit(engine.state)
                                or workload.reacts_to_finishes)
        max_steps = min(max(remaining) if through_finishes else min(remaining), MAX_RUN_STEPS)
        if max_steps < 2:
            return None
        next_arrival, next_observation = workload.next_arrival_s, workload.next_observation_s
        next_event = min(next_arrival, next_observation)
        last_s = self._last_decode_step_s
        if first is None:
            start = now  # of the first step costed as a decode step
            computed = [c + 1 for c in batch.num_computed_tokens]  # after step 0
            if next_event < np.inf and last_s:
                # Cost only about as many steps as fit before the next event (STEP_SLACK and
                # COST_MARGIN above): step 1 must start before the next arrival, steps 0 and 1
                # end before the next observation.
                if next_arrival - now < STEP_SLACK * last_s or next_observation - now < 2 * STEP_SLACK * last_s:
                    return None
                max_steps = min(max_steps, int(COST_MARGIN * (next_event - now) / last_s) + SPARE_STEPS)
                if max_steps < 2:
                    return None
            seconds, parts = self.backend.decode_run(computed, max_steps, remaining)  # contexts after step 0
        else:
            start = now + first.seconds  # step 0's end, as the clock adds it
            computed = [c + q for c, q in zip(batch.num_computed_tokens, batch.num_scheduled_tokens)]
            # Step 1 starts when step 0 ends: it is scheduled normally if a request has arrived.
            if next_arrival <= start or next_observation <= start:
                return None
            if next_event < np.inf and last_s:
                # As above, from step 0's end: step 1 must end before the next observation, and
                # step 0 is one more step than those that fit after it.
                if next_observation - start < STEP_SLACK * last_s:
                    return None
                max_steps = min(max_steps, 1 + int(COST_MARGIN * (next_event - start) / last_s) + SPARE_STEPS)
            # The decode steps 1.. of the requests that do not finish in step 0: their contexts after step 1.
            if min(remaining) > 1:  # (most runs: none finishes in step 0)
                contexts, active = [c + 1 for c in computed], [rem - 1 for rem in remaining]
            else:
                contexts = [c + 1 for c, rem in zip(computed, remaining) if rem > 1]
                active = [rem - 1 for rem in remaining if rem > 1]
            seconds, parts = self.backend.decode_run(contexts, max_steps - 1, active)
        # The clock adds the steps one after another, as step-by-step simulation does (float
        # additions in order, as numpy's cumsum makes them too).
        step_seconds = seconds.tolist()
        ends = list(accumulate(step_seconds, initial=start))
        if first is None:
            del ends[0]
        self._last_decode_step_s = step_seconds[-1]
        # A step starting at or after the next arrival is scheduled normally.
        num_steps = min(max_steps, 1 + bisect_left(ends, next_arrival, 0, max_steps - 1))
        if next_observation < np.inf:  # every step ends before it
            num_steps = min(num_steps, bisect_left(ends, next_observation))
        if num_steps < 2:
            return None

        # Blocks: step j >= 1 computes position computed + j - 1 (computed: after step 0), which
        # opens a block when it is a multiple of the block size; step 0's blocks were reserved by
        # the policy. Blocks that finishing requests free are not counted on, so the run never
        # preempts.
        bs = engine.block_manager.block_size
        n = len(reqs)
        opens = _opening_blocks(computed, remaining, num_steps, bs)
        free = engine.block_manager.num_free_blocks
        if len(opens) > free:
            num_steps = opens[free] // n  # the step that would need one block too many
            if num_steps < 2:
                return None
            del opens[bisect_left(opens, num_steps * n, 0, free):]
        if num_steps < max_steps:
            del ends[num_steps:]
            num_costed = num_steps if first is None else num_steps - 1
            seconds = seconds[:num_costed]
            parts = {k: v[:num_costed] if isinstance(v, np.ndarray) else v for k, v in parts.items()}
        return _new_tuple(Run, (ends, first, seconds, parts, opens,  # type: ignore[return-value]
                                [rem if rem < num_steps else num_steps for rem in remaining],
                                None, None, 0, engine.block_manager.num_used_blocks, len(engine.state.waiting)))

    # Chunk runs.

    def plan_chunks(self, batch: Batch, now: float, first: "StepResult", budget: int) -> Run | None:
        """The chunk run starting with `batch`, or None when it would be a single step. `batch`
        (already scheduled, costed `first` by the backend's `execute`) schedules every running
        request in running order without preempting, each but the last computing all its tokens
        (so each emits a token: a decode, or a prompt's last chunk) and the last a prefill chunk
        that does not end its prompt. After it the others all decode: with the policy's
        `repeats_full_chunk_steps` promise, the steps after it are the same requests again, the
        decodes one token each and the last request the rest of the policy's `budget` (a chunk
        of the same size every step), for as long as:

        - the prefill has more left than the step's chunk (its last chunk ends the prompt: that
          step admits requests with the budget left, and is scheduled normally),
        - the free blocks cover each step's new blocks (taken in step-by-step order: each step's
          decodes' opening blocks in batch order, then the chunk's; blocks that finishing decodes
          free are not counted on),
        - every step ends before the workload's next observation (a cluster's router).

        A decode that emits its last token leaves at the end of that step, and the steps after it
        are the others and a chunk one token longer (still a full step: it admits no one), unless
        the workload answers a finish with a new request (a closed loop): then the run ends with
        the step in which the first decodes finish.

        Step 0 may fill the budget too (then it is such a step itself), or be the step that ends
        one prompt and begins the next one's prefill (a folded chunk run: its prompt's request
        emits its first token and decodes from step 1 on).

        Arrivals do not end it where the workload can hand over the arrivals up to a given time
        after the fact (`delivers_by_time`: a trace's open loop, a closed loop): a step that the
        running requests fill admits no one, so the requests that arrive meanwhile only wait
        (each step's log counts them). Elsewhere (a cluster's replica) the run ends before the
        first step that starts at or after the next arrival."""
        reqs = batch.requests
        n = len(reqs) - 1
        prefill = reqs[-1]
        before = batch.num_computed_tokens[-1] + batch.num_scheduled_tokens[-1]  # the prefill's, before step 1
        if prefill.num_tokens - before <= budget - n:  # step 1 ends the prompt (its chunk is at least this)
            return None
        engine = self.engine
        workload = engine.workload
        remaining = [r.max_tokens - r.num_output_tokens for r in reqs[:n]]  # steps each decode takes part in
        # Past a finish the others go on (a full step admits no one), unless the workload answers a
        # finish with a new request (a closed loop): then the run ends with the first finish.
        last = MAX_RUN_STEPS
        if n and workload.reacts_to_finishes:
            last = min(last, min(remaining))
        # Steps 1..: the decodes still running and the rest of the budget for the prefill, for as
        # long as the prefill has more than that left (its last chunk is scheduled normally).
        ordered = sorted(remaining)
        chunks: list[int] = []
        num_decodes: list[int] = []
        left = prefill.num_tokens - before
        gone = 0  # decodes that finished before step j
        j = 1
        while j < last:
            while gone < n and ordered[gone] <= j:
                gone += 1
            chunk = budget - n + gone
            if chunk < 2 or left <= chunk:  # (a one-token chunk would be costed as a decode)
                break
            chunks.append(chunk)
            num_decodes.append(n - gone)
            left -= chunk
            j += 1
        num_steps = j
        if num_steps < MIN_CHUNK_RUN_STEPS:
            return None
        start = now + first.seconds  # step 0's end, as the clock adds it
        next_observation = workload.next_observation_s
        if next_observation <= start:
            return None
        decode_computed = [c + q for c, q in zip(batch.num_computed_tokens[:n], batch.num_scheduled_tokens[:n])]  # before step 1
        bm = engine.block_manager
        bs = bm.block_size
        # Blocks of steps 1.. : decode i computes position decode_computed[i] + j - 1 in step j (while
        # it runs) and opens a block where that is a multiple of the block size; the chunk of step j
        # needs the prefill's table to cover its tokens after it. Cut where the free blocks run out
        # (blocks that finishing decodes free are not counted on).
        opens = _opening_blocks(decode_computed, remaining, num_steps, bs)
        free = bm.num_free_blocks
        table = len(prefill.block_table)
        taken = 0
        computed = before
        for j in range(1, num_steps):
            taken = bisect_left(opens, (j + 1) * n, taken)  # the decodes' blocks of steps 1..j
            computed += chunks[j - 1]
            if taken + max(0, -(-computed // bs) - table) > free:
                num_steps = j
                break
        if num_steps < MIN_CHUNK_RUN_STEPS:
            return None
        # Cost steps 1.. a stretch of the same decodes at a time.
        backend = cast("ChunkStepsBackend", self.backend)  # the engine takes chunk runs with such a backend only
        seconds: list[float] = []
        parts: dict[str, list[float]] = {}
        step, computed = 1, before
        while step < num_steps:
            end = step + 1
            while end < num_steps and num_decodes[end - 1] == num_decodes[step - 1]:
                end += 1
            contexts = [c + step - 1 for c, rem in zip(decode_computed, remaining) if rem > step]  # before `step`
            chunk = chunks[step - 1]
            piece, piece_parts = backend.chunk_steps(contexts, chunk, computed, end - step)
            if not seconds:
                seconds, parts = piece, piece_parts
            else:
                seconds += piece
                for key, values in piece_parts.items():
                    parts[key] += values
            computed += chunk * (end - step)
            step = end
        ends = list(accumulate(seconds, initial=start))
        if next_observation < np.inf:  # every step ends before it
            num_steps = min(num_steps, bisect_left(ends, next_observation))
        if not workload.delivers_by_time:
            # Its `deliver` hands over whatever reached it by then, not what arrived by a given
            # time: a step starting at or after the next arrival is scheduled normally.
            num_steps = min(num_steps, 1 + bisect_left(ends, workload.next_arrival_s, 0, num_steps - 1))
        if num_steps < len(ends):
            if num_steps < MIN_CHUNK_RUN_STEPS:
                return None
            del ends[num_steps:], seconds[num_steps - 1:]
            parts = {k: v[:num_steps - 1] for k, v in parts.items()}
        del chunks[num_steps - 1:], num_decodes[num_steps - 1:]
        if n:
            del opens[bisect_left(opens, num_steps * n):]
        return _new_tuple(Run, (ends, first, seconds, parts, opens,  # type: ignore[return-value]
                                [rem if rem < num_steps else num_steps for rem in remaining],
                                chunks, num_decodes, 0, bm.num_used_blocks, len(engine.state.waiting)))

def _opening_blocks(computed: list[int], remaining: list[int], num_steps: int, bs: int) -> list[int]:
    """The blocks that decodes open in steps 1..num_steps - 1 of a run, as step * n + batch index,
    sorted (the order they are taken in): decode i computes position computed[i] + j - 1 in step j
    while j < remaining[i], and opens a block where that is a multiple of the block size `bs`:
    first in one of steps 1..bs, then every bs steps."""
    n = len(computed)
    opens: list[int] = []
    for i, (c, rem) in enumerate(zip(computed, remaining)):
        first_open, stop = 1 + -c % bs, num_steps if num_steps < rem else rem
        if first_open < stop:
            opens += range(first_open * n + i, stop * n, bs * n)
    opens.sort()
    return opens


