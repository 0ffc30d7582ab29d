"""Which request goes first: first come first served, or by priority (vLLM's `--scheduling-policy`).

The scheduler keeps its waiting queue and running list in the order the policy gives, and asks it
where a request goes; everything else (one token budget, preemption of the running list's tail,
prefix matching at admission) stays the scheduler's.

- `fcfs`: arrival order. A preempted request goes back to the front of the queue; nothing waiting
  ever displaces a running request.
- `priority`: `SamplingParams.priority`, lower first, then arrival. Both lists stay sorted by
  (priority, arrival), so the running list's tail, the request preempted first under memory
  pressure, is the lowest-priority, newest one; a preempted request re-enters the queue among its
  own priority, ahead of later arrivals. A waiting request that outranks the running tail displaces
  it when it could not be admitted otherwise (no sequence slot or not enough pages): a priority-0
  request arriving behind a queue of priority-1 ones is served in the next step.
"""

from __future__ import annotations

import bisect
from collections import deque

from tokenmill.config import SCHEDULING_POLICIES
from tokenmill.engine.request import Request


class SchedulingPolicy:
    """First come first served; the base of the priority policy."""

    name = "fcfs"
    # Whether a waiting request may preempt a running one to be admitted.
    displaces = False

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        """A preempted request: it has waited longest, so it goes first."""
        waiting.appendleft(request)

    def admit(self, running: list[Request], request: Request) -> None:
        running.append(request)

    def outranks(self, waiting: Request, running: Request) -> bool:
        return False


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    displaces = True

    @staticmethod
    def key(request: Request) -> tuple[int, float]:
        return request.params.priority, request.arrival_time

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.insert(bisect.bisect_right(waiting, self.key(request), key=self.key), request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        self.enqueue(waiting, request)  # its arrival time puts it ahead of later arrivals of its priority

    def admit(self, running: list[Request], request: Request) -> None:
        running.insert(bisect.bisect_right(running, self.key(request), key=self.key), request)

    def outranks(self, waiting: Request, running: Request) -> bool:
        # Priority alone: an older request of the same priority never preempts a newer one (that
        # would only trade one recompute for another).
        return waiting.params.priority < running.params.priority


def make_policy(name: str) -> SchedulingPolicy:
    if name == "priority":
        return PriorityPolicy()
    if name == "fcfs":
        return SchedulingPolicy()
    raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {name!r}")
