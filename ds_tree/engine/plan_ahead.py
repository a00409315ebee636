"""A step's host work (its plan, normalisers, advantages) one step ahead of training (docs/DESIGN.md section 9).

The host work of a step on offline data depends on the data and the config only, not on the weights: while
step ``s`` computes, a background thread builds step ``s + 1``'s (:meth:`PlanAhead.run` takes step ``s``'s,
waiting for it if it is not done, then :meth:`PlanAhead.ahead` starts the next). The work includes collectives
(the per-rank planner's all-gather of summaries, the normalisers' all-reduce), so it runs on a gloo process
group of its own, made by every rank at set-up (:func:`planning_group`): its collectives never meet the
training step's, which run on the main thread on the default group, and every rank's thread makes the same
collectives in the same order because every rank asks for the same steps.

Why a thread and not a ``torch.utils.data.DataLoader`` with workers: a worker is another process, outside the
run's process group, so it cannot take part in the exchange of summaries (a collective); a worker could only
summarise, leaving the exchange, the balance and the building of the rank's own items (half the host work)
on the training loop, and every tree and row would cross a process boundary pickled. The thread shares the
process's memory and group machinery; its pure-Python parts hold the GIL, but the training step's time is in
kernels that release it (GPU launches and synchronisations, CPU ATen ops).

The cost: a rank holds two steps' host work at once (the step computing and the next one's items), which is
its own share of two steps' trees, not the data set.

A step whose settings changed since its work began ahead (a check script edits ``packing`` between steps) is
planned again: the work is keyed by the step and a snapshot of the config. Online RL has nothing to plan ahead
(its data is sampled in the step): its work runs on the main thread (:class:`Planning` without a thread), on
the default group. Each step reports ``time/plan_s`` (the host work's own time) and ``time/plan_wait_s`` (what
the step waited for it). ``DS_TREE_PLAN_DELAY_S`` adds that many seconds to every step's host work (a test hook:
slow planning without a large step).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Generic, TypeVar

from ds_tree.packing.exchange import Collectives

logger = logging.getLogger(__name__)

DELAY_VARIABLE = "DS_TREE_PLAN_DELAY_S"
"""Seconds added to every step's host work (tests: planning made slow, module docstring)."""

T = TypeVar("T")

Work = Callable[[Collectives], T]
"""A step's host work, given the collectives it may use."""


@dataclass
class Timed(Generic[T]):
    """A step's host work's result and its timing."""

    result: T
    plan_s: float
    """The host work's own time (wall clock, on whichever thread ran it)."""
    wait_s: float = 0.0
    """What the step waited for it."""

    def scalars(self) -> dict[str, float]:
        return {"time/plan_s": self.plan_s, "time/plan_wait_s": self.wait_s}


def timed(work: Work, comm: Collectives) -> Timed:
    """``work(comm)`` with its time (and the injected delay, :data:`DELAY_VARIABLE`)."""
    started = time.perf_counter()
    delay = float(os.environ.get(DELAY_VARIABLE, "0") or 0)
    if delay:
        time.sleep(delay)
    result = work(comm)
    return Timed(result, time.perf_counter() - started)


@dataclass
class _Job:
    key: object
    """What the work depends on (compared with ``==``)."""
    work: Work
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Timed | None = None
    error: BaseException | None = None


class Planning:
    """Runs each step's host work (module docstring): with a ``thread_comm`` (offline data) on a background
    thread, one step ahead; without one on the calling thread, on the default group."""

    def __init__(self, thread_comm: Collectives | None = None, close_timeout_s: float = 60.0) -> None:
        self.thread_comm = thread_comm
        self.close_timeout_s = close_timeout_s
        self.pending: _Job | None = None
        """The job begun ahead (or running now), if any."""
        self._queue: list[_Job] = []
        self._condition = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if thread_comm is not None:
            self._thread = threading.Thread(target=self._serve, name="plan-ahead", daemon=True)
            self._thread.start()

    @property
    def ahead_of_time(self) -> bool:
        return self._thread is not None

    def run(self, key: object, work: Work) -> Timed:
        """The host work of ``key``: the one begun ahead when its key matches, else done now; with the time
        the caller waited for it."""
        started = time.perf_counter()
        if self._thread is None:
            outcome = timed(work, Collectives())
        else:
            job, self.pending = self.pending, None
            if job is not None and job.key != key:
                self._wait(job)  # its collectives must finish on every rank before the next job's start
                job = None
            if job is None:
                job = self._submit(key, work)
            outcome = self._wait(job, raise_error=True)
        outcome.wait_s = time.perf_counter() - started
        return outcome

    def ahead(self, key: object, work: Work) -> None:
        """Begin the host work of ``key`` (the next step) in the background (nothing without a thread)."""
        if self._thread is not None and self.pending is None:
            self.pending = self._submit(key, work)

    def _submit(self, key: object, work: Work) -> _Job:
        job = _Job(key, work)
        with self._condition:
            self._queue.append(job)
            self._condition.notify_all()
        return job

    def _wait(self, job: _Job, raise_error: bool = False) -> Timed | None:
        job.done.wait()
        if job.error is not None and raise_error:
            raise job.error
        return job.outcome

    def _serve(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                job = self._queue.pop(0)
            try:
                job.outcome = timed(job.work, self.thread_comm)
            except BaseException as error:  # noqa: BLE001 - handed to the step that takes it
                job.error = error
            job.done.set()

    def close(self) -> None:
        """Stop the thread once the jobs submitted are done: every rank submitted the same ones, and a job's
        collectives need every rank's thread, so none is dropped on one rank alone."""
        if self._thread is None:
            return
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(timeout=self.close_timeout_s)
        if self._thread.is_alive():
            logger.warning("the plan-ahead thread did not stop within %.0f s", self.close_timeout_s)


def planning_group(timeout_s: float):
    """A gloo process group of every rank for the plan-ahead thread (a collective: every rank makes it)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
