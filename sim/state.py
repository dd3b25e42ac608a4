"""What the policy schedules from: the waiting queue, the running list and the KV blocks."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from sim.block_manager import BlockManager
from sim.request import Request


class PriorityWaiting:
    """The waiting queue under `--scheduling-policy priority`: the lowest priority value first,
    then the earliest arrival, then trace order (vLLM's Request.__lt__: priority, arrival time,
    request id). A preempted request goes back by the same order, not to the front
    (vllm/v1/core/sched/request_queue.py, PriorityRequestQueue.prepend_request). It offers what
    policies use of the FCFS deque: append, appendleft, popleft, [0], len and iteration."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_s, request.index, request))

    def appendleft(self, request: Request) -> None:
        """A preempted request goes back by the queue's order, as any other (vLLM's prepend_request)."""
        self.append(request)

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def __getitem__(self, i: int) -> Request:
        if i != 0:
            raise IndexError("only the head of a priority queue can be looked at")
        return self._heap[0][3]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


class EngineState:
    def __init__(self, block_manager: BlockManager, priority: bool = False):
        self.block_manager = block_manager
        # FCFS: preempted requests go to the front. With `priority`, by priority (PriorityWaiting).
        self.waiting: deque[Request] | PriorityWaiting = PriorityWaiting() if priority else deque()
        self.running: list[Request] = []  # in admission order: the last is the most recently admitted
        self.step_index = 0  # the step being scheduled
        self.num_preemptions = 0
        # Requests that finished in the step in flight while the next is scheduled asynchronously:
        # vLLM's scheduler still holds them in its running list (skipped, their seats and blocks taken)
        # until that step's output is processed (sim/engine.py, docs/async-scheduling.md). Empty otherwise.
        self.finishing: list[Request] = []
        self.num_admissions = 0  # requests that joined `running` (their `admission_order`)

    def join_running(self, request: Request) -> None:
        """The request joins the running list, last (vLLM's running order, which a finishing
        request keeps: `admission_order`)."""
        request.admission_order = self.num_admissions
        self.num_admissions += 1
        self.running.append(request)

    @property
    def num_seats(self) -> int:
        """Seats of --max-num-seqs taken: the running requests and, asynchronously, those finishing
        in the step in flight. What a policy compares with the admission limit (max_num_seqs, or
        --max-num-active-seqs: `SchedulerConfig.max_num_active_reqs`) before admitting."""
        return len(self.running) + len(self.finishing)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
