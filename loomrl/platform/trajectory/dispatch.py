"""Prompt dispatch to rollout workers, and what happens when one dies.

The trainer role hands prompts to rollout workers and remembers which prompts
each worker holds. A finished group clears its prompt; a dead worker's prompts
go back to the front of the queue (re-queued, counted) and are generated again
by another worker, so no prompt is lost with a worker:

    dispatched = completed + in flight + waiting to be re-sent
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    key: str  # the group key its trajectories will carry (unique per dispatch of a prompt)
    prompt: Any  # what the worker needs to generate it (a PromptSample in the trainer)
    attempts: int = 0


@dataclass
class Dispatcher:
    in_flight: dict[int, dict[str, Job]] = field(default_factory=dict)  # worker -> key -> job
    requeued: deque = field(default_factory=deque)
    dead: dict[int, str] = field(default_factory=dict)  # worker -> why
    dispatched: int = 0
    completed: int = 0
    requeue_count: int = 0

    def assign(self, worker: int, jobs: list[Job]) -> None:
        if worker in self.dead:
            raise ValueError(f"dispatch: worker {worker} is dead ({self.dead[worker]})")
        slot = self.in_flight.setdefault(worker, {})
        for j in jobs:
            j.attempts += 1
            slot[j.key] = j
        self.dispatched += len(jobs)

    def next_jobs(self, k: int, fresh) -> list[Job]:
        """Up to k jobs: re-queued ones first, then `fresh(k_left)` new ones."""
        out = [self.requeued.popleft() for _ in range(min(k, len(self.requeued)))]
        if len(out) < k:
            out += fresh(k - len(out))
        return out

    def complete(self, worker: int, key: str) -> Job:
        job = self.in_flight.get(worker, {}).pop(key, None)
        if job is None:
            raise ValueError(f"dispatch: worker {worker} returned group {key!r} it was not given")
        self.completed += 1
        return job

    def worker_died(self, worker: int, why: str) -> list[Job]:
        """Mark a worker dead; its in-flight jobs are re-queued (returned too)."""
        self.dead[worker] = why
        jobs = list(self.in_flight.pop(worker, {}).values())
        self.requeued.extend(jobs)
        self.dispatched -= len(jobs)  # they will be dispatched (and counted) again
        self.requeue_count += len(jobs)
        return jobs

    def busy(self, worker: int) -> int:
        return len(self.in_flight.get(worker, {}))

    @property
    def outstanding(self) -> int:
        return sum(len(v) for v in self.in_flight.values())

    def check(self) -> None:
        if self.dispatched != self.completed + self.outstanding:
            raise AssertionError(
                f"dispatch accounting does not balance: dispatched {self.dispatched} != "
                f"completed {self.completed} + in flight {self.outstanding}"
            )
