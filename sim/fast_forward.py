"""Fast-forward over runs of decode-only steps.

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
and admit no one. A policy makes it by setting `supports_fast_forward = True` (see
policies/base.py); for any other policy the engine steps one by one. The backend makes its own
promise: `decode_run` costs each step of the run exactly as `execute` would. So the engine costs
the whole run in one call and advances the clock once; the answers are exactly those of
step-by-step simulation (tests/test_fast_forward.py checks it).

A run may also begin one step earlier, with the step that admitted a request (a mixed step, or a
prefill step), when after it every running request is decoding and none waits (a folded run): that
step is costed by the backend's `execute`, the steps after it as above, and one plan, one move of
the clock, one update of the requests and one write to the step log take both. This rests on the
policy's second promise (`decodes_all_when_none_waits`): with none waiting and every running
request decoding, its next step decodes them all. It saves, per arrival, a call of the policy, a
SimPy event and a single step's bookkeeping. The step must schedule every running request, in
running order, without preempting; an engine whose class overrides `advance` or `_log_step` (a
prefill replica hands its requests off after their first token) never folds
(`Engine.folds_admitting_steps`).
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from sim.batch import Batch
from sim.request import Status

if TYPE_CHECKING:
    from sim.backend import StepResult
    from sim.engine import Engine

MAX_RUN_STEPS = 4096  # bounds the arrays of one run


class DecodeRun(NamedTuple):
    """A planned run of steps: step 0 as the policy scheduled it, then decode-only steps."""

    ends: list[float]  # [steps] end time of each step
    first: "StepResult | None"  # step 0's cost when it is a mixed or prefill step (a folded run); None: it decodes
    seconds: np.ndarray  # the decode-only steps' seconds: [steps], or [steps - 1] after a folded step 0
    parts: dict  # their breakdown (the backend's): per key a float (every step) or an array like `seconds`
    opens: list[int]  # step * len(batch) + batch index of each block opened, in the order taken
    active_steps: list[int]  # per request, the steps it takes part in (it finishes in the last, or runs on)


class ChunkRun(NamedTuple):
    """A planned chunk run: step 0 as the policy scheduled it (each request but the last computing
    all its tokens, the last a prefill chunk), then the same requests again, all but the last
    decoding and the prefill carried forward by `chunk` tokens a step (the rest of the budget)."""

    ends: list[float]  # [steps] end time of each step
    first: "StepResult"  # step 0's cost (the backend's `execute`)
    seconds: list[float]  # steps 1..'s seconds
    parts: dict  # their breakdown: per key a list like `seconds`
    chunk: int  # the prefill's tokens in every step
    opens: list[int]  # step * decodes + decode index of each block the decodes open in steps 1.., in order


class FastForward:
    """Plans, executes and logs the runs of one engine."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._last_decode_step_s = 0.0  # sizes the next decode run

    def execute(self, env, batch: Batch, run: DecodeRun | ChunkRun):
        """The run's part of the engine's SimPy process: move the clock to its end, then apply it."""
        start, num_waiting = env.now, len(self.engine.state.waiting)
        end = run.ends[-1]
        if env.now + (end - env.now) == end:
            yield env.timeout(end - env.now)
        else:  # the clock cannot land exactly on `end` in one move: add the steps one by one
            if run.first is not None:
                yield env.timeout(run.first.seconds)
            for seconds in (run.seconds if isinstance(run, ChunkRun) else run.seconds.tolist()):
                yield env.timeout(seconds)
        if isinstance(run, ChunkRun):
            self._apply_chunks(batch, start, num_waiting, run)
        else:
            self._log(batch, start, num_waiting, run, self._advance(batch, run))

    def plan(self, batch: Batch, now: float, first: "StepResult | None" = None) -> DecodeRun | None:
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
        through_finishes = not (engine.policy.finish_may_admit(engine.state) or workload.reacts_to_finishes)
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
                # Cost only about as many steps as fit before the next arrival, judging by the last
                # decode step's length (a guess: a short one merely ends this run early), and none
                # when clearly fewer than two fit (a guess too: a missed run is stepped one by one).
                if next_arrival - now < 0.9 * last_s or next_observation - now < 1.8 * last_s:
                    return None
                max_steps = min(max_steps, int(1.25 * (next_event - now) / last_s) + 2)
                if max_steps < 2:
                    return None
            seconds, parts = engine.backend.decode_run(computed, max_steps, remaining)  # contexts after step 0
        else:
            start = now + first.seconds  # step 0's end, as the clock adds it
            computed = [c + q for c, q in zip(batch.num_computed_tokens, batch.num_scheduled_tokens)]
            # Step 1 starts when step 0 ends: it is scheduled normally if a request has arrived.
            if next_arrival <= start or next_observation <= start:
                return None
            if next_event < np.inf and last_s:
                if next_observation - start < 0.9 * last_s:
                    return None
                max_steps = min(max_steps, int(1.25 * (next_event - start) / last_s) + 3)
            # The decode steps 1.. of the requests that do not finish in step 0: their contexts after step 1.
            contexts = [c + 1 for c, rem in zip(computed, remaining) if rem > 1]
            seconds, parts = engine.backend.decode_run(contexts, max_steps - 1, [rem - 1 for rem in remaining if rem > 1])
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
        # Every block opened, as step * n + batch index: sorted, the order they are taken in.
        opens: list[int] = []
        for i, (c, rem) in enumerate(zip(computed, remaining)):
            # Its first opening step is 1..bs; it opens one every bs steps while it still decodes.
            first_open, stop = 1 + -c % bs, num_steps if num_steps < rem else rem
            if first_open < stop:
                opens += range(first_open * n + i, stop * n, bs * n)
        opens.sort()
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
        return DecodeRun(ends, first, seconds, parts, opens, [rem if rem < num_steps else num_steps for rem in remaining])

    def _log(self, batch: Batch, now: float, num_waiting: int, run: DecodeRun,
             num_used_blocks: list[int]) -> None:
        ends = run.ends
        k = len(ends)
        n = len(batch)
        num_running = n
        if min(run.active_steps) < k:  # some finish before the last step
            num_running = n - np.searchsorted(sorted(run.active_steps), np.arange(k), side="right")
        steps = self.engine.steps
        first = run.first
        if first is None:
            starts = [now]
            starts += ends[:-1]
        else:  # step 0 as a single step logs it, then the decode steps
            steps.append_step(batch, now, first, num_used_blocks[0], num_waiting, 0)
            starts = ends[:-1]
            if not isinstance(num_running, int):
                num_running = num_running[1:]
            num_used_blocks = num_used_blocks[1:]
            k -= 1
        steps.extend(k, {
            "start_s": starts, "seconds": run.seconds, "num_decode_tokens": num_running,
            "num_requests": num_running, "num_kv_blocks_used": num_used_blocks, "num_waiting": num_waiting,
        }, run.parts)  # no prefill tokens, no preemptions

    def _advance(self, batch: Batch, run: DecodeRun) -> list[int]:
        """Apply the run's tokens, blocks and finishes; returns the blocks in use at each step."""
        ends_list = run.ends
        k = len(ends_list)
        reqs = batch.requests
        engine = self.engine
        finishing = []
        if run.first is None:
            for i, (r, num) in enumerate(zip(reqs, run.active_steps)):
                r.token_times.extend(ends_list if num == k else ends_list[:num])
                r.num_computed_tokens += num
                r.num_output_tokens += num
                if r.num_output_tokens == r.max_tokens:
                    finishing.append((num - 1, i))
        else:  # step 0 computes each request's scheduled tokens (all it has), each emits a token
            for i, (r, num, c, q) in enumerate(zip(reqs, run.active_steps, batch.num_computed_tokens,
                                                  batch.num_scheduled_tokens)):
                r.num_computed_tokens = c + q + num - 1
                num_output = r.num_output_tokens
                if num_output:
                    r.token_times.extend(ends_list if num == k else ends_list[:num])
                else:
                    r.first_token_s = ends_list[0]
                    r.token_times = ends_list[:num]
                num_output += num
                r.num_output_tokens = num_output
                if num_output == r.max_tokens:
                    finishing.append((num - 1, i))
        # Hand out new blocks and free finished requests' blocks in the order step-by-step
        # simulation would: each step's new blocks in batch order, then at its end the requests
        # that finished in it, in batch order (freed blocks are the next ones taken).
        bm = engine.block_manager
        used_before = bm.num_used_blocks  # step 0's blocks were reserved by the policy
        change = [0] * (k + 1)  # change[j]: blocks in use at step j less at step j - 1
        opens, taken, n = run.opens, 0, len(reqs)
        for o in opens:
            change[o // n] += 1
        for last_step, i in sorted(finishing) + [(k - 1, None)]:  # the last: the run's remaining blocks
            taken = _hand_out(bm, reqs, n, opens, taken, last_step)  # the blocks opened up to last_step
            if i is not None:
                before = bm.num_used_blocks
                engine.finish(reqs[i], ends_list[last_step])
                change[last_step + 1] -= before - bm.num_used_blocks  # freed at the end of its last step
        if finishing:
            engine.state.running = [r for r in engine.state.running if r.status is Status.RUNNING]
        engine.state.step_index += k
        used = list(accumulate(change[:k], initial=used_before))
        del used[0]
        return used

    # Chunk runs.

    def plan_chunks(self, batch: Batch, now: float, first: "StepResult", budget: int) -> ChunkRun | None:
        """The chunk run starting with `batch`, or None when it would be a single step. `batch`
        (already scheduled, costed `first` by the backend's `execute`) schedules every running
        request in running order without preempting, each but the last computing all its tokens
        (so each emits a token: a decode, or a prompt's last chunk) and the last a prefill chunk
        that does not end its prompt. After it the others all decode: with the policy's
        `repeats_full_chunk_steps` promise, the steps after it are the same requests again, the
        decodes one token each and the last request the rest of the policy's `budget` (a chunk
        of the same size every step), for as long as:

        - the prefill has more than a chunk left (its last chunk ends the prompt: that step
          admits requests with the budget left, and is scheduled normally),
        - no request finishes (the run ends with the step in which the first ones do),
        - the free blocks cover each step's new blocks (taken in step-by-step order: each step's
          decodes' opening blocks in batch order, then the chunk's),
        - every step ends before the workload's next observation (a cluster's router).

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
        chunk = budget - n
        if chunk < 2:  # (a one-token chunk would be costed as a decode)
            return None
        prefill = reqs[-1]
        before = batch.num_computed_tokens[-1] + batch.num_scheduled_tokens[-1]  # the prefill's, before step 1
        num_steps = 1 + (prefill.num_tokens - before - 1) // chunk  # step 0, and steps with more than a chunk left
        if n:
            num_steps = min(num_steps, min([r.max_tokens - r.num_output_tokens for r in reqs[:n]]))
        num_steps = min(num_steps, MAX_RUN_STEPS)
        if num_steps < 2:
            return None
        engine = self.engine
        start = now + first.seconds  # step 0's end, as the clock adds it
        next_observation = engine.workload.next_observation_s
        if next_observation <= start:
            return None
        decode_computed = [c + q for c, q in zip(batch.num_computed_tokens[:n], batch.num_scheduled_tokens[:n])]  # before step 1
        bm = engine.block_manager
        bs = bm.block_size
        # Blocks of steps 1.. : decode i computes position decode_computed[i] + j - 1 in step j and
        # opens a block where that is a multiple of the block size; the chunk of step j needs its
        # table to cover before + j * chunk tokens. Cut where the free blocks run out.
        opens: list[int] = []
        for i, c in enumerate(decode_computed):
            first_open = 1 + -c % bs
            if first_open < num_steps:
                opens += range(first_open * n + i, num_steps * n, bs * n)
        opens.sort()
        free = bm.num_free_blocks
        table = len(prefill.block_table)
        taken = 0
        for j in range(1, num_steps):
            taken = bisect_left(opens, (j + 1) * n, taken)  # the decodes' blocks of steps 1..j
            if taken + max(0, -(-(before + j * chunk) // bs) - table) > free:
                num_steps = j
                break
        if num_steps < 2:
            return None
        seconds, parts = engine.backend.chunk_steps(decode_computed, chunk, before, num_steps - 1)
        ends = list(accumulate(seconds, initial=start))
        if next_observation < np.inf:  # every step ends before it
            num_steps = min(num_steps, bisect_left(ends, next_observation))
        if not getattr(engine.workload, "delivers_by_time", False):
            # Its `deliver` hands over whatever reached it by then, not what arrived by a given
            # time: a step starting at or after the next arrival is scheduled normally.
            num_steps = min(num_steps, 1 + bisect_left(ends, engine.workload.next_arrival_s, 0, num_steps - 1))
        if num_steps < len(ends):
            if num_steps < 2:
                return None
            del ends[num_steps:], seconds[num_steps - 1:]
            parts = {k: v[:num_steps - 1] for k, v in parts.items()}
        if n:
            del opens[bisect_left(opens, num_steps * n):]
        return ChunkRun(ends, first, seconds, parts, chunk, opens)

    def _apply_chunks(self, batch: Batch, start: float, num_waiting: int, run: ChunkRun) -> None:
        """Apply and log a chunk run, doing what step-by-step simulation does in its order: before
        each step after the first, the arrivals up to its start join the queue, the decodes take
        the blocks they open, in batch order, then the prefill its chunk's (indexed as the policy
        indexes them); after the last step, the decodes emit their tokens and those that finished
        leave."""
        engine = self.engine
        state, bm, workload = engine.state, engine.block_manager, engine.workload
        waiting = state.waiting
        reqs = batch.requests
        n = len(reqs) - 1
        prefill = reqs[-1]
        ends, chunk, opens = run.ends, run.chunk, run.opens
        k = len(ends)
        # Step 0's row: the policy reserved its blocks.
        engine.steps.append_step(batch, start, run.first, bm.num_used_blocks, num_waiting, 0)
        # The blocks of steps 1..: each step's decodes' opening blocks in batch order, then the
        # prefill's new ones, all taken from the free queue in that order in one go (nothing is
        # freed meanwhile, so taking them step by step takes the same blocks), then the prefill's
        # full blocks indexed in one go (nobody looks the index up meanwhile, and its blocks are
        # held, so no eviction meets them: the index ends as step by step).
        bs = bm.block_size
        table = prefill.block_table
        num_table = len(table)
        computed = batch.num_computed_tokens[-1] + batch.num_scheduled_tokens[-1]  # the prefill's, before step 1
        counts = []  # per step 1..: (the decodes' new blocks, the prefill's)
        taken = total = 0
        for j in range(1, k):
            upto = bisect_left(opens, (j + 1) * n, taken) if n else 0
            computed += chunk
            new = -(-computed // bs) - num_table
            if new > 0:
                num_table += new
            else:
                new = 0
            counts.append((upto - taken, new))
            total += upto - taken + new
            taken = upto
        blocks = bm.pop_free_blocks(total) if total else []
        # Where the workload cannot deliver by time, nothing arrived before the last step's start
        # (plan_chunks), and what arrived since is for the step after the run.
        by_time = getattr(workload, "delivers_by_time", False)
        used_now = bm.num_used_blocks - total  # before step 1
        used, num_waiting_at = [], []  # steps 1..'s
        at = taken = 0
        for j, (num_decode_blocks, new) in enumerate(counts, 1):
            if by_time:
                workload.deliver(ends[j - 1])  # step j starts when step j - 1 ends
            if num_decode_blocks:
                for o, block in zip(opens[taken:taken + num_decode_blocks], blocks[at:at + num_decode_blocks]):
                    reqs[o % n].block_table.append(block)
                taken += num_decode_blocks
                at += num_decode_blocks
            if new:
                table += blocks[at:at + new]
                at += new
            used_now += num_decode_blocks + new
            used.append(used_now)
            num_waiting_at.append(len(waiting))
        prefill.num_computed_tokens = computed
        bm.index_full_blocks(prefill)
        last_step = state.step_index + k - 1
        prefill.last_scheduled_step = last_step
        finished = []
        for r, q in zip(reqs[:n], batch.num_scheduled_tokens):
            num_output = r.num_output_tokens
            if num_output:
                r.token_times.extend(ends)
            else:  # its prompt ended in step 0
                r.first_token_s = ends[0]
                r.token_times = ends[:]
            r.num_computed_tokens += q + k - 1
            num_output += k
            r.num_output_tokens = num_output
            r.last_scheduled_step = last_step
            if num_output == r.max_tokens:
                finished.append(r)
        engine.steps.extend(k - 1, {
            "start_s": ends[:-1], "seconds": run.seconds, "num_prefill_tokens": chunk, "num_decode_tokens": n,
            "num_requests": n + 1, "num_kv_blocks_used": used, "num_waiting": num_waiting_at,
        }, run.parts)  # no preemptions
        engine._finish_all(finished, ends[-1])
        state.step_index += k


def _hand_out(bm, reqs: list, n: int, opens: list[int], taken: int, last_step: int) -> int:
    """Give the requests the blocks they open up to `last_step` (`opens[taken:]`: step * n + batch
    index, sorted), taken from the free queue in that order; returns how many of `opens` are given."""
    upto = bisect_left(opens, (last_step + 1) * n, taken)
    if upto > taken:
        for o, block in zip(opens[taken:upto], bm.pop_free_blocks(upto - taken)):
            reqs[o % n].block_table.append(block)
    return upto
