"""Hostile user policies and routers (tests/test_hostile.py): each breaks one rule of the engine,
raises, loops or returns garbage. servesim must stop the run with exit 2 naming the rule."""

from policies.base import Policy, Promises
from policies.chunked import ChunkedPolicy
from policies.routers import Router
from sim.batch import Batch


class OverBudget(ChunkedPolicy):
    """Schedules every waiting prompt whole, whatever the budget."""
    promises = Promises()  # it overrides schedule: it states what it promises (none)

    def schedule(self, state, now):
        batch = Batch()
        self._schedule_all_decodes(state, batch)
        while state.waiting and len(state.running) < self.config.max_num_seqs:
            if not self._try_admit(state, batch, now, max_chunk=None):
                break
        return batch


class ZeroTokens(ChunkedPolicy):
    promises = Promises()  # it overrides schedule: it states what it promises (none)

    def schedule(self, state, now):
        batch = super().schedule(state, now)
        batch.num_scheduled_tokens[0] = 0
        return batch


class Twice(ChunkedPolicy):
    promises = Promises()  # it overrides schedule: it states what it promises (none)

    def schedule(self, state, now):
        batch = super().schedule(state, now)
        r = batch.requests[0]
        batch.add_request(r, r.num_computed_tokens, 1, False, False)
        return batch


class TooManySeqs(ChunkedPolicy):
    """Admits past --max-num-seqs."""
    promises = Promises()  # it overrides schedule: it states what it promises (none)

    def schedule(self, state, now):
        batch = super().schedule(state, now)
        while state.waiting:
            if not self._try_admit(state, batch, now, max_chunk=1):
                break
        return batch


class StealsBlocks(ChunkedPolicy):
    """Takes KV blocks that are not free (the block manager asked no question)."""
    promises = Promises()  # it overrides schedule: it states what it promises (none)

    def schedule(self, state, now):
        batch = super().schedule(state, now)
        if batch.requests:
            r = batch.requests[0]
            state.block_manager.append(r, state.block_manager.block_size * (state.block_manager.num_blocks + 5))
        return batch


class Raises(ChunkedPolicy):
    promises = Promises()  # it overrides schedule: it states what it promises (none)

    def schedule(self, state, now):
        if state.step_index == 3:
            return 1 / 0
        return super().schedule(state, now)


class ReturnsNone(ChunkedPolicy):
    promises = Promises()  # it overrides schedule: it states what it promises (none)

    def schedule(self, state, now):
        super().schedule(state, now)


class Loops(Policy):
    def schedule(self, state, now):
        while True:
            try:
                pass
            except Exception:
                pass


class NegativeRouter(Router):
    def route(self, request, replicas):
        return -1


class RaisingRouter(Router):
    def route(self, request, replicas):
        raise KeyError("no such replica")


class RetriesNow(ChunkedPolicy):
    """Holds every request back and asks to be tried again at once, for ever."""
    promises = Promises()  # it overrides schedule: it states what it promises (none)

    def schedule(self, state, now):
        return Batch()

    def retry_s(self, state, now):
        return now


# Found by a new-user run (2026-12-07): each of these ran to the end with exit 0 and wrong figures (or
# none), or ended in an internal error.

class ShortensOutputs(ChunkedPolicy):
    """Makes every waiting request's output 2 tokens long."""
    promises = Promises()

    def schedule(self, state, now):
        for r in state.waiting:
            r.max_tokens = 2
        return super().schedule(state, now)


class MovesArrivals(ChunkedPolicy):
    """Pretends every waiting request just arrived (hides its queueing)."""
    promises = Promises()

    def schedule(self, state, now):
        for r in state.waiting:
            r.arrival_s = now
        return super().schedule(state, now)


class DropsWaiting(ChunkedPolicy):
    """Loses a waiting request now and then."""
    promises = Promises()

    def schedule(self, state, now):
        if state.step_index % 5 == 4 and state.waiting:
            state.waiting.pop()
        return super().schedule(state, now)


class ResizesBlocks(ChunkedPolicy):
    """Makes the KV cache's blocks one token each."""
    promises = Promises()

    def schedule(self, state, now):
        state.block_manager.block_size = 1
        return super().schedule(state, now)


class Exits(ChunkedPolicy):
    """Ends the process."""
    promises = Promises()

    def schedule(self, state, now):
        if state.step_index > 3:
            import sys
            sys.exit(0)
        return super().schedule(state, now)


class ShorteningRouter(Router):
    def route(self, request, replicas):
        request.max_tokens = 1
        return 0


class SwallowsTheStop(ChunkedPolicy):
    """Polls for ever, catching every exception the timeout raises (a bare except)."""
    promises = Promises()

    def schedule(self, state, now):
        import time
        while state.step_index > 3:
            try:
                time.sleep(0.2)
            except:  # noqa: E722 (the point: it catches the timeout's exception too)
                pass
        return super().schedule(state, now)


class ReadsStateAfterAll(Router):
    """Promises to read nothing of the replicas, then routes by their load."""
    reads_state = False

    def route(self, request, replicas):
        return min(range(len(replicas)), key=lambda i: replicas[i].num_in_flight)
