"""What the policy schedules from: the waiting queue, the running list and the KV blocks."""

from __future__ import annotations

from collections import deque

from sim.block_manager import BlockManager
from sim.request import Request


class EngineState:
    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go to the front
        self.running: list[Request] = []  # in admission order: the last is the most recently admitted
        self.step_index = 0  # the step being scheduled
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
