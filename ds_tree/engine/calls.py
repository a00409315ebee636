"""The calls one accumulation makes (forwards, backwards), and one order of them for every rank.

A row's work is a *task*: a generator that makes one model call per step (a packed row: one
forward-and-backward; a tree walked in dfs mode, :mod:`ds_tree.engine.dfs`: a call per chunk
entered and left), with the kinds of its calls known in advance. Under ZeRO-3 every rank must make
calls of the same kinds in the same order (:func:`lockstep`); :func:`run_tasks` makes them so, with
zero-loss calls where a rank has none of a slot's kind.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# The calls a rank makes, in order, each one event for the lockstep schedule (:func:`lockstep`):
FORWARD, BACKWARD = "forward", "backward"
"""A forward with grad whose backward comes later, after the chunk's descendants' (dfs without recompute)."""
NO_GRAD = "no_grad"
"""A forward without grad (recompute's first forward of a chunk, log-probs)."""
UPDATE = "forward_backward"
"""A forward with grad and its backward at once (a packed row; recompute's second forward of a chunk)."""


def run_to_end(generator: Generator[None, None, T]) -> T:
    """Every step of ``generator``; its return value."""
    while True:
        try:
            next(generator)
        except StopIteration as stop:
            return stop.value


@dataclass
class Task:
    """One row's calls: their kinds (:func:`walk_events`) and the generator making them, one per step."""

    events: list[str]
    run: Generator
    result: object = None

    def step(self) -> None:
        next(self.run)

    def finish(self) -> None:
        self.result = run_to_end(self.run)


KINDS = (NO_GRAD, UPDATE, FORWARD, BACKWARD)
"""The call kinds by their code in :func:`merge_schedules`."""


def lockstep(events: list[str], group=None) -> list[str]:
    """One schedule of call kinds that every rank of ``group`` follows (ZeRO-3).

    ZeRO-3 gathers parameters collectively in every forward and backward and checks at each
    forward that the ranks traced the same modules, so the ranks must make calls of the same kind in
    the same order. Every rank all-gathers the kinds of its calls (``events``, in order), and all
    compute the same schedule (:func:`merge_schedules`): each rank's calls are a subsequence of it,
    and where a rank has no call of a slot's kind it makes a dummy one (:func:`run_tasks`).
    """
    world = dist.get_world_size(group)
    length = torch.tensor([len(events)])
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n) for n in lengths)
    mine = torch.full((longest,), -1, dtype=torch.int64)
    mine[: len(events)] = torch.tensor([KINDS.index(kind) for kind in events], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    sequences = [e[: int(n)].tolist() for e, n in zip(every, lengths, strict=True)]
    return [KINDS[kind] for kind in merge_schedules(sequences)]


def merge_schedules(sequences: list[list[int]]) -> list[int]:
    """A sequence of call kinds (codes of :data:`KINDS`) holding each of ``sequences`` as a subsequence,
    whose other slots each rank can fill with dummy calls.

    A dummy no-grad forward or forward-and-backward can go anywhere; a dummy forward holds its graph
    for a later dummy backward, so a slot is a backward only where every rank either has a backward
    next or holds a dummy forward. Each slot takes, among the kinds allowed, the one that the ranks
    with the most calls left have next (each rank votes with its number of calls left; ties: the
    lower code, no-grad first), so every slot advances at least one rank and the busiest rarely wait
    (on tot-game24 trees, chunks of 64-512 tokens, 2-8 ranks: 1.19-1.29x the busiest rank's calls;
    tau2-telecom, 4 ranks: 1.0-1.31x; docs/BENCHMARKS.md). A backward is always allowed when no rank has
    anything else next; at the end every rank holds as many dummy forwards (the forward slots minus
    the backward slots), and as many backward slots close them.
    """
    backward = KINDS.index(BACKWARD)
    forward = KINDS.index(FORWARD)
    position = [0] * len(sequences)
    held = [0] * len(sequences)
    """Dummy forwards each rank holds."""
    schedule = []
    while True:
        votes: dict[int, int] = {}
        for sequence, p in zip(sequences, position, strict=True):
            if p < len(sequence):
                votes[sequence[p]] = votes.get(sequence[p], 0) + len(sequence) - p
        if not votes:
            return schedule + [backward] * (held[0] if held else 0)
        if backward in votes and not all(
            h > 0 or (p < len(s) and s[p] == backward) for s, p, h in zip(sequences, position, held, strict=True)
        ):
            del votes[backward]
        kind = max(votes, key=lambda k: (votes[k], -k))
        schedule.append(kind)
        for r, (sequence, p) in enumerate(zip(sequences, position, strict=True)):
            if p < len(sequence) and sequence[p] == kind:
                position[r] += 1
            elif kind == forward:
                held[r] += 1
            elif kind == backward:
                held[r] -= 1


def run_tasks(tasks: Sequence[Task], schedule: list[str] | None, dummy: Callable[[str], None]) -> None:
    """Every task's calls, in order: as they come, or following ``schedule`` (:func:`lockstep`), with
    ``dummy(kind)`` wherever this rank has no call of the slot's kind. A task finishes (its generator
    returns, its memory is freed) right after its last call."""
    queue = [(task, kind, i == len(task.events) - 1) for task in tasks for i, kind in enumerate(task.events)]
    for task in tasks:
        if not task.events:
            task.finish()

    def make(position: int) -> None:
        task, _, last = queue[position]
        task.step()
        if last:
            task.finish()

    if schedule is None:
        for position in range(len(queue)):
            make(position)
        return
    position = 0
    for kind in schedule:
        if position < len(queue) and queue[position][1] == kind:
            make(position)
            position += 1
        else:
            dummy(kind)
    if position != len(queue):
        raise RuntimeError(f"the lockstep schedule left {len(queue) - position} of this rank's calls unmade")


def in_process_group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class DeferredBackward:
    """The ``backward`` of tasks built before their number of calls is known (:func:`run_calls` sets it)."""

    function: Callable[[torch.Tensor], None] | None = None

    def __call__(self, loss: torch.Tensor) -> None:
        self.function(loss)


def packed_task(run: Callable[[], T], kind: str = UPDATE) -> Task:
    """A task of one call (a packed row's forward and backward, or its no-grad forward)."""

    def generator():
        result = run()
        yield
        return result

    return Task([kind], generator())
