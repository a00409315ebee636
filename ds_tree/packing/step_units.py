"""A step's units as a training rank plans them (docs/DESIGN.md, "Exactness across ranks and micro-batches").

The trainer plans each step with the per-rank planner (:mod:`ds_tree.packing.distributed`) over a
:class:`StepData`: the step's units (its groups, in step order) and where they lie.

- **Offline data** (``owners`` None): every rank reads any unit itself (a converted dataset lazily,
  :class:`~ds_tree.data.dataset_reader.DatasetGroups`; tokens JSONL from memory). A rank summarises a ``1/W``
  share of the units by flat tokens and reads its items' units; nothing but the summaries crosses ranks.
- **Online rollouts** (``owners`` given): each rank holds the groups it sampled (:class:`HeldUnits`). A rank
  summarises the units it holds; after the balance, every rank knows which units every other rank's items
  need, and each unit goes point to point from its holder to the ranks that need it (one ``all_to_all``,
  :meth:`~ds_tree.packing.exchange.Collectives.all_to_all`). With ``data.merge: global`` the step is one trie,
  so every rank receives every unit (what the old all-gather sent).

:func:`plan_units` is the trainer's entry point: this rank's :class:`~ds_tree.packing.plan.RankPlan`, the
same items as :func:`~ds_tree.packing.plan.plan_step` of the step's trajectories in unit order gives it.
:func:`gather_units` gives every rank the same few units (the self-check's sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ds_tree.errors import DataError
from ds_tree.packing.distributed import RankPlanner, StepUnits
from ds_tree.packing.exchange import Collectives
from ds_tree.packing.plan import PlanSettings, RankPlan
from ds_tree.trees.trajectory import Trajectory


@dataclass
class HeldUnits:
    """Online rollouts' units: the flat tokens of every unit of the step (exchanged), the trajectories of those
    this rank holds (sampled here, or received for its items)."""

    unit_sizes: np.ndarray
    held: dict[int, list[Trajectory]] = field(default_factory=dict)

    def sizes(self) -> np.ndarray:
        return self.unit_sizes

    def read(self, units: Sequence[int]) -> list[list[Trajectory]]:
        missing = [unit for unit in units if unit not in self.held]
        if missing:  # a planner bug, not the data's: every unit a rank reads was sent to it
            raise DataError(f"unit {missing[0]} of the step is not on this rank")
        return [list(self.held[unit]) for unit in units]

    def nbytes(self, units: Sequence[int]) -> int:
        arrays = ("input_ids", "loss_mask", "logprobs", "advantages")
        return sum(
            getattr(t, name).nbytes
            for unit in units
            for t in self.held.get(unit, ())
            for name in arrays
            if getattr(t, name) is not None
        )


@dataclass
class UnitRange:
    """Some of a step's units (a mini-batch: whole groups, in step order) as units of their own."""

    units: StepUnits
    indices: np.ndarray
    """The step's unit of each of these units."""

    def sizes(self) -> np.ndarray:
        return self.units.sizes()[self.indices]

    def read(self, units: Sequence[int]) -> list[list[Trajectory]]:
        return self.units.read([int(self.indices[unit]) for unit in units])

    def nbytes(self, units: Sequence[int]) -> int:
        return self.units.nbytes([int(self.indices[unit]) for unit in units])


@dataclass
class StepData:
    """A step's units as this rank reaches them (module docstring)."""

    units: StepUnits
    owners: np.ndarray | None = None
    """Per unit, the rank that holds it (online rollouts); None: every rank reads any unit."""

    def __len__(self) -> int:
        return len(self.units.sizes())

    def subset(self, indices: Sequence[int]) -> StepData:
        """The units ``indices`` (in this order) as a step of their own: a mini-batch."""
        indices = np.asarray(indices, dtype=np.int64)
        owners = None if self.owners is None else self.owners[indices]
        return StepData(UnitRange(self.units, indices), owners)

    def held_by(self, rank: int) -> list[int] | None:
        """The units ``rank`` holds; None when every rank reads any unit."""
        return None if self.owners is None else np.flatnonzero(self.owners == rank).tolist()

    def fetch(self, needs: Sequence[Sequence[int]], comm: Collectives) -> None:
        """Give each rank ``r`` the units ``needs[r]`` that it does not hold (a collective; nothing to do for
        offline data). What arrives is kept with the units this rank holds."""
        if self.owners is None:
            return
        me = comm.rank
        outgoing = []
        for rank, wanted in enumerate(needs):
            mine = [unit for unit in wanted if self.owners[unit] == me and rank != me]
            outgoing.append({unit: group for unit, group in zip(mine, self.units.read(mine), strict=True)})
        for received in comm.all_to_all(outgoing):
            self.keep(received)

    def keep(self, received: dict[int, list[Trajectory]]) -> None:
        """Units sent to this rank, kept with those it holds (where :meth:`HeldUnits.read` finds them)."""
        for unit, group in received.items():
            units, index = self.units, int(unit)
            while isinstance(units, UnitRange):  # a mini-batch's unit is its step's unit ``indices[unit]``
                units, index = units.units, int(units.indices[index])
            units.held[index] = group


def plan_units(data: StepData, settings: PlanSettings, comm: Collectives) -> tuple[RankPlan, RankPlanner]:
    """This rank's items of the step of ``data`` (module docstring), and the planner that built them (its
    ``built`` units hold the trajectories of every tree this rank made). Collectives: one all-gather of the
    summaries, and for rollouts one all-to-all of the units."""
    world, rank = comm.world_size, comm.rank
    if data.owners is not None and settings.merge == "global":  # one trie of the whole step: every rank needs all
        data.fetch([range(len(data))] * world, comm)
    planner = RankPlanner(data.units, settings, world, rank, share=data.held_by(rank))
    summaries = comm.all_gather(planner.summarise())
    assignment = planner.balance(summaries)
    if settings.merge != "global":
        data.fetch([assignment.units_of(r) for r in range(world)], comm)
    return planner.materialise(assignment), planner


def gather_units(data: StepData, units: Sequence[int], comm: Collectives) -> list[list[Trajectory]]:
    """The trajectories of ``units`` on every rank alike (rollouts: sent by their holders, a collective)."""
    data.fetch([list(units)] * comm.world_size, comm)
    return data.units.read(list(units))
