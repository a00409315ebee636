"""Each rank plans its own share of a step: host work that shrinks with the world size (docs/DESIGN.md section 9).

:func:`~ds_tree.packing.plan.plan_step` builds every tree of a step and every rank's items, on every rank.
Here a rank does three things, each from what it holds:

1. **summarise** (:meth:`RankPlanner.summarise`): it builds the trees of its share of the step's *units*
   (a unit is the trajectories one trie is built from: a group, or with ``data.merge: global`` the whole
   step; shares by flat tokens, :func:`summary_shares`) and describes each tree in a few numbers, a
   :class:`StepSummary`: per part its tokens, visible attention pairs and kind, per unit its flat and tree
   tokens;
2. **exchange and balance**: the ranks' summaries are gathered on every rank (``exchange``: one
   ``all_gather_object`` of small arrays in a run, :func:`all_gather_exchange`; a list in the simulator and
   the tests), and every rank runs the same deterministic balance on them (:func:`balance_summaries`):
   every rank's item specs. It is the assignment :func:`~ds_tree.packing.plan.plan_step` makes from the trees
   themselves (the same greedy LPT on the same costs in the same order, the same first-fit rows, the same
   empty rows that keep ZeRO-3's forwards in lockstep, the same sequence-parallel groups), so the balance,
   the items, the losses and the gradients are today's exactly;
3. **materialise** (:meth:`RankPlanner.materialise`): it builds the trees of its own items only (reusing
   those it summarised) and assembles its items, equal to what ``plan_step`` gives the rank.

A rank's host work is then its ``1/W`` share of the trees twice (summarised, then its items' trees) plus
the balance over the summaries (``P log W`` for ``P`` parts); what it receives is the summaries (about 50
bytes a part) and its own units' data. The step's trajectories are its units' in order: a unit per group id,
in order of first appearance (:meth:`GroupUnits.of_step`), as ``plan_step`` groups them, so ``plan_step`` on
the units' trajectories is the reference (in tree mode the same plan as on the step's list in any order; in
flat mode the trajectories' own trees follow the units' order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from ds_tree.errors import DataError
from ds_tree.packing.balance import lpt_shares
from ds_tree.packing.bins import first_fit_decreasing
from ds_tree.packing.dfs_rows import dfs_row, split_over_budget
from ds_tree.packing.dfs_shards import shard_walked_row
from ds_tree.packing.parts import TreePart, whole_tree
from ds_tree.packing.plan import PlanSettings, RankPlan, tree_parts
from ds_tree.packing.rows import PackedRow, assemble_row
from ds_tree.packing.sequence_parallel import shard_row, split_for_sequence_parallel
from ds_tree.trees.stats import token_counts
from ds_tree.trees.trajectory import Trajectory, group_trajectories
from ds_tree.trees.trie import TokenTree, build_forest

PACKED, WALKED, SHARDED = 0, 1, 2
"""A part's kind in a summary: packed into rows a rank computes alone; a whole tree walked (by one rank,
or with ``S > 1`` by a sequence-parallel group); a part of the rows a sequence-parallel group computes."""
UNIT, TREE, PART, KIND, TOKENS, PAIRS = range(6)
"""The columns of :attr:`StepSummary.parts`."""
SHARED_KINDS = ("shard", "walked_shard")
"""Item kinds whose row a sequence-parallel group computes together (each rank ``1/S`` of it)."""


class StepUnits(Protocol):
    """A step's units (groups, in step order) as one rank reaches them: their sizes from an index, the
    trajectories of the ones it asks for (:class:`GroupUnits`; a converted dataset read lazily,
    :class:`ds_tree.data.dataset_reader.DatasetGroups`)."""

    def sizes(self) -> np.ndarray:
        """Flat tokens of every unit (the summary shares follow them)."""

    def read(self, units: Sequence[int]) -> list[list[Trajectory]]:
        """The trajectories of ``units``, each unit's in step order."""

    def nbytes(self, units: Sequence[int]) -> int:
        """What reading ``units`` moves (the simulator's ``dataset_bytes_per_rank``)."""


@dataclass
class GroupUnits:
    """Units held in memory: the step's groups (online rollouts, a tokens JSONL loaded whole)."""

    groups: Sequence[Sequence[Trajectory]]

    @classmethod
    def of_step(cls, trajectories: Sequence[Trajectory]) -> GroupUnits:
        """The units of a step's trajectories: one per group id, in order of first appearance, as
        :func:`~ds_tree.packing.plan.plan_step` groups them (a group drawn twice in a step is one unit,
        its trajectories twice)."""
        return cls(group_trajectories(trajectories))

    def sizes(self) -> np.ndarray:
        return self._sizes

    @cached_property
    def _sizes(self) -> np.ndarray:
        return np.array([sum(len(t) for t in group) for group in self.groups], dtype=np.int64)

    def read(self, units: Sequence[int]) -> list[list[Trajectory]]:
        return [list(self.groups[unit]) for unit in units]

    def nbytes(self, units: Sequence[int]) -> int:
        arrays = ("input_ids", "loss_mask", "logprobs", "advantages")
        return sum(
            getattr(t, name).nbytes
            for unit in units
            for t in self.groups[unit]
            for name in arrays
            if getattr(t, name) is not None
        )


@dataclass
class WholeStep:
    """``data.merge: global``: one trie over the step, so the step is one unit (this planner then saves
    nothing: whichever rank needs a part of that trie builds all of it)."""

    units: StepUnits

    def sizes(self) -> np.ndarray:
        return np.array([int(self.units.sizes().sum())], dtype=np.int64)

    def read(self, units: Sequence[int]) -> list[list[Trajectory]]:
        everything = range(len(self.units.sizes()))
        return [[t for group in self.units.read(everything) for t in group] for _ in units]

    def nbytes(self, units: Sequence[int]) -> int:
        return self.units.nbytes(range(len(self.units.sizes()))) * len(units)


@dataclass
class UnitTrees:
    """One unit's trees and, per layout tree, its kind and parts (what :func:`plan_step` makes of them)."""

    flat_tokens: int
    tree_tokens: int
    items: list[tuple[int, list[TreePart]]]
    """Per layout tree (the unit's trees; ``packing.mode: flat``, its trajectories): kind and parts."""
    trajectories: list[Trajectory] = field(default_factory=list)
    """The unit's trajectories as read, in step order (the objects its trees hold)."""


def unit_trees(trajectories: Sequence[Trajectory], settings: PlanSettings) -> UnitTrees:
    """Build one unit's trees and cut each into its parts as :func:`~ds_tree.packing.plan.plan_step` does."""
    trees = build_forest(trajectories, merge=settings.merge)
    counts = token_counts(trees)
    layout = trees if settings.mode != "flat" else build_forest(trajectories, merge="none")
    items = [tree_items(tree, settings) for tree in layout]
    return UnitTrees(counts.flat_tokens, counts.tree_tokens, items, list(trajectories))


def tree_items(tree: TokenTree, settings: PlanSettings) -> tuple[int, list[TreePart]]:
    """A tree's kind and parts: the per-tree decisions of :func:`~ds_tree.packing.plan.plan_step`, made by
    the functions it calls, on this tree alone."""
    size = settings.sequence_parallel_size
    if size > 1 and settings.mode == "dfs":
        return WALKED, [whole_tree(tree)]
    if size > 1 and not (settings.mode == "tree" and settings.over_budget == "dfs"):
        own, sharded = split_for_sequence_parallel([tree], settings.budget, size)
        return (SHARDED, sharded) if sharded else (PACKED, own)
    packed, walked = split_over_budget([tree], settings.mode, settings.over_budget, settings.budget)
    return (WALKED, [whole_tree(tree)]) if walked else (PACKED, tree_parts(packed, settings))


@dataclass
class StepSummary:
    """What one rank sends: its units' summaries (a few numbers per part), or the error one of them raised."""

    units: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    """``[n, 3]``: per unit summarised, its index, flat tokens and tree tokens."""
    parts: np.ndarray = field(default_factory=lambda: np.zeros((0, 6), dtype=np.int64))
    """``[n, 6]``: per part, its unit, tree in the unit, part in the tree, kind, tokens, visible pairs."""
    errors: list[tuple[int, str]] = field(default_factory=list)
    """``(unit, message)`` of the units whose trees could not be planned (a path over the budget)."""


def summarise_unit(unit: int, trees: UnitTrees) -> tuple[np.ndarray, np.ndarray]:
    """``(units row, parts rows)`` of :class:`StepSummary` for one unit."""
    rows = [
        (unit, tree, index, kind, part.n_tokens, part.visible_pairs)
        for tree, (kind, parts) in enumerate(trees.items)
        for index, part in enumerate(parts)
    ]
    parts = np.array(rows, dtype=np.int64).reshape(-1, 6)
    return np.array([[unit, trees.flat_tokens, trees.tree_tokens]], dtype=np.int64), parts


def summary_shares(sizes: np.ndarray, world_size: int) -> list[list[int]]:
    """Which units each rank summarises: near-equal flat tokens per rank (greedy LPT on the sizes)."""
    return lpt_shares([float(size) for size in sizes], world_size)


@dataclass(frozen=True)
class ItemSpec:
    """One item of a rank, before it is built: its kind and its parts (rows of :attr:`StepAssignment.table`)."""

    kind: str
    parts: tuple[int, ...]
    """In the item's order; empty for the empty rows that keep every rank's forwards in lockstep."""
    position: int = 0
    """Shard kinds: the rank's shard of the group's row (or walk)."""


@dataclass
class StepAssignment:
    """Every rank's item specs for a step, from the summaries alone (:func:`balance_summaries`)."""

    table: np.ndarray
    """The step's parts (:attr:`StepSummary.parts` of all ranks), sorted by unit, tree, part."""
    ranks: list[list[ItemSpec]]
    flat_tokens: int
    tree_tokens: int
    packed_tokens: int
    costs: np.ndarray
    """Per part of ``table``: the cost model's figure."""
    settings: PlanSettings

    def rank_costs(self) -> np.ndarray:
        """Each rank's predicted cost (a shard counts ``1/S`` of its row, as
        :meth:`~ds_tree.packing.plan.StepPlan.rank_costs` counts the items)."""
        size = self.settings.sequence_parallel_size

        def share(spec: ItemSpec) -> float:
            return float(self.costs[list(spec.parts)].sum()) / (size if spec.kind in SHARED_KINDS else 1)

        return np.array([sum(share(spec) for spec in specs) for specs in self.ranks])

    def units_of(self, rank: int) -> list[int]:
        """The units whose trees ``rank``'s items hold."""
        parts = [index for spec in self.ranks[rank] for index in spec.parts]
        return sorted({int(unit) for unit in self.table[parts, UNIT]})


def merged_summaries(summaries: Sequence[StepSummary]) -> tuple[np.ndarray, np.ndarray]:
    """``(units, parts)`` of all ranks, in step order; the first error of the step (by unit) is raised,
    on every rank alike."""
    errors = sorted(error for summary in summaries for error in summary.errors)
    if errors:
        raise DataError(errors[0][1])
    units = np.concatenate([s.units for s in summaries] or [np.zeros((0, 3), dtype=np.int64)])
    parts = np.concatenate([s.parts for s in summaries] or [np.zeros((0, 6), dtype=np.int64)])
    order = np.lexsort((parts[:, PART], parts[:, TREE], parts[:, UNIT]))
    return units[np.argsort(units[:, 0], kind="stable")], parts[order]


def balance_summaries(summaries: Sequence[StepSummary], settings: PlanSettings, world_size: int) -> StepAssignment:
    """Every rank's item specs from every rank's summaries: :func:`~ds_tree.packing.plan.plan_step`'s
    assignment, case by case (its branches, in its order)."""
    size = settings.sequence_parallel_size
    if world_size % size:
        raise ValueError(f"world size {world_size} is not a multiple of the sequence-parallel size {size}")
    units, table = merged_summaries(summaries)
    costs = settings.cost_per_token * table[:, TOKENS] + settings.cost_per_pair * table[:, PAIRS]
    plan = _Balancer(table, costs.astype(np.float64), settings, world_size)
    if size > 1 and settings.mode == "dfs":
        ranks, packed = plan.walked_shards(np.flatnonzero(table[:, KIND] == WALKED))
    elif size > 1 and settings.mode == "tree" and settings.over_budget == "dfs":
        ranks, packed = plan.walked_shards_and_rows()
    elif size > 1:
        ranks, packed = plan.sequence_parallel_rows()
    else:
        ranks, packed = plan.rows_and_walks()
    return StepAssignment(table, ranks, int(units[:, 1].sum()), int(units[:, 2].sum()), packed, plan.costs, settings)


class _Balancer:
    """The balance of one step's parts: each method one branch of :func:`~ds_tree.packing.plan.plan_step`,
    returning every rank's specs and the packed tokens (computed over all ranks, as the plan counts them)."""

    def __init__(self, table: np.ndarray, costs: np.ndarray, settings: PlanSettings, world_size: int) -> None:
        self.table, self.costs, self.settings, self.world_size = table, costs, settings, world_size
        self.size = settings.sequence_parallel_size
        self.tokens = table[:, TOKENS].tolist()

    def of_kind(self, kind: int) -> np.ndarray:
        return np.flatnonzero(self.table[:, KIND] == kind)

    def row_tokens(self, parts: tuple[int, ...], block: int) -> int:
        """Tokens of the row :func:`~ds_tree.packing.rows.assemble_row` makes of ``parts``, padding included."""
        real = sum(self.tokens[index] for index in parts)
        return -(-real // block) * block if real else block

    def shares(self, indices: np.ndarray, count: int) -> list[np.ndarray]:
        """``indices`` spread over ``count`` ranks or groups (:func:`~ds_tree.packing.balance.lpt_shares`)."""
        return [indices[members] for members in lpt_shares(self.costs[indices].tolist(), count)]

    def packed_rows(self, indices: np.ndarray, count: int, budget: int) -> list[list[tuple[int, ...]]]:
        """Each of ``count`` shares' rows under ``budget`` (first-fit decreasing, as ``pack_rows``)."""
        rows = []
        for share in self.shares(indices, count):
            bins = first_fit_decreasing(self.table[share, TOKENS].tolist(), budget)
            rows.append([tuple(share[members].tolist()) for members in bins])
        return rows

    def rows_per_rank(self, indices: np.ndarray) -> list[list[tuple[int, ...]]]:
        """:func:`~ds_tree.packing.balance.rows_per_rank`: rows padded with empty ones to the same count."""
        rows = self.packed_rows(indices, self.world_size, self.settings.budget)
        count = max(1, max(len(r) for r in rows))
        return [r + [()] * (count - len(r)) for r in rows]

    def rows_and_walks(self) -> tuple[list[list[ItemSpec]], int]:
        """No sequence parallelism: packed rows, then each rank's walked trees (``with_walked_rows``)."""
        rows = self.rows_per_rank(self.of_kind(PACKED))
        ranks = [[ItemSpec("packed", parts) for parts in own] for own in rows]
        walked = self.of_kind(WALKED)
        if walked.size:
            walks = self.shares(walked, self.world_size)
            ranks = [
                [spec for spec in specs if spec.parts] + [ItemSpec("walked", (int(i),)) for i in share]
                for specs, share in zip(ranks, walks, strict=True)
            ]
        block = self.settings.block
        packed = sum(
            self.row_tokens(spec.parts, block if spec.kind == "packed" else 1)
            for specs in ranks
            for spec in specs
            if spec.parts
        )
        return ranks, packed

    def walked_shards(self, walked: np.ndarray) -> tuple[list[list[ItemSpec]], int]:
        """``plan_walked_shards``: whole trees over the groups, each walked by all its ranks."""
        groups = self.shares(walked, self.world_size // self.size)
        ranks = [
            [ItemSpec("walked_shard", (int(i),), rank % self.size) for i in groups[rank // self.size]]
            for rank in range(self.world_size)
        ]
        return ranks, int(sum(self.table[share, TOKENS].sum() for share in groups))

    def walked_shards_and_rows(self) -> tuple[list[list[ItemSpec]], int]:
        """``_walked_over_budget``: each rank's group's walks first, then its own non-empty rows."""
        walks, walked_tokens = self.walked_shards(self.of_kind(WALKED))
        rows = self.rows_per_rank(self.of_kind(PACKED))
        ranks = [w + [ItemSpec("packed", parts) for parts in own if parts] for w, own in zip(walks, rows, strict=True)]
        block = self.settings.block
        return ranks, walked_tokens + sum(self.row_tokens(parts, block) for own in rows for parts in own if parts)

    def sequence_parallel_rows(self) -> tuple[list[list[ItemSpec]], int]:
        """``plan_sequence_parallel_rows``: the groups' rows (padded to a common count), then each rank's own."""
        settings, size = self.settings, self.size
        sharded, own_parts = self.of_kind(SHARDED), self.of_kind(PACKED)
        grouped = self.packed_rows(sharded, self.world_size // size, size * settings.budget)
        count = max(len(rows) for rows in grouped)
        grouped = [rows + [()] * (count - len(rows)) for rows in grouped]
        if own_parts.size or not sharded.size:
            own = self.rows_per_rank(own_parts)
        else:
            own = [[] for _ in range(self.world_size)]
        ranks = [
            [ItemSpec("shard", parts, rank % size) for parts in grouped[rank // size]]
            + [ItemSpec("packed", parts) for parts in own[rank]]
            for rank in range(self.world_size)
        ]
        packed = sum(self.row_tokens(parts, size * settings.block) for rows in grouped for parts in rows if parts)
        packed += sum(self.row_tokens(parts, settings.block) for rows in own for parts in rows if parts)
        return ranks, packed


class RankPlanner:
    """One rank's share of a step's planning (module docstring): :meth:`summarise`, then, with every rank's
    summaries, :meth:`plan` (:meth:`balance` and :meth:`materialise`). The trees it builds for its summaries
    are kept until its items are made."""

    def __init__(
        self, units: StepUnits, settings: PlanSettings, world_size: int, rank: int, share: Sequence[int] | None = None
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.units = WholeStep(units) if settings.merge == "global" else units
        self.settings, self.world_size, self.rank = settings, world_size, rank
        self.given_share = None if share is None or settings.merge == "global" else sorted(int(u) for u in share)
        """The units this rank summarises when they are given (those it holds: online rollouts); None: a
        ``1/W`` share by flat tokens (:func:`summary_shares`)."""
        self.built: dict[int, UnitTrees] = {}
        self.read_units: set[int] = set()
        """Every unit whose trajectories this rank read (what it received of the step's data)."""

    def share(self) -> list[int]:
        """The units this rank summarises: those given, else its share by flat tokens."""
        if self.given_share is not None:
            return self.given_share
        return summary_shares(self.units.sizes(), self.world_size)[self.rank]

    def build(self, units: Sequence[int]) -> None:
        """Read and build the trees of those of ``units`` not built yet."""
        missing = [unit for unit in units if unit not in self.built]
        for unit, trajectories in zip(missing, self.units.read(missing), strict=True):
            self.built[unit] = unit_trees(trajectories, self.settings)
        self.read_units.update(missing)

    def summarise(self) -> StepSummary:
        """This rank's :class:`StepSummary`; a unit's data error is sent, not raised (every rank raises the
        step's first error after the exchange, so none waits for a rank that stopped)."""
        summary = StepSummary()
        share = self.share()
        try:
            groups = self.units.read(share)  # one read of the whole share
        except DataError as error:  # a damaged row
            summary.errors.append((min(share), str(error)))
            return summary
        self.read_units.update(share)
        rows, parts = [summary.units], [summary.parts]
        for unit, trajectories in zip(share, groups, strict=True):
            try:
                self.built[unit] = unit_trees(trajectories, self.settings)
            except DataError as error:
                summary.errors.append((unit, str(error)))
                continue
            unit_row, part_rows = summarise_unit(unit, self.built[unit])
            rows.append(unit_row)
            parts.append(part_rows)
        summary.units, summary.parts = np.concatenate(rows), np.concatenate(parts)
        return summary

    def balance(self, summaries: Sequence[StepSummary]) -> StepAssignment:
        return balance_summaries(summaries, self.settings, self.world_size)

    def materialise(self, assignment: StepAssignment) -> RankPlan:
        """This rank's items, built from its own units' trees only."""
        self.build(assignment.units_of(self.rank))
        rows = [self.item(assignment.table, spec) for spec in assignment.ranks[self.rank]]
        return RankPlan(rows, assignment.flat_tokens, assignment.tree_tokens, assignment.packed_tokens)

    def plan(self, summaries: Sequence[StepSummary]) -> RankPlan:
        return self.materialise(self.balance(summaries))

    def item(self, table: np.ndarray, spec: ItemSpec) -> PackedRow:
        """The item of ``spec``, as :func:`~ds_tree.packing.plan.plan_step` assembles it."""
        settings, size = self.settings, self.settings.sequence_parallel_size
        parts = [self.built[unit].items[tree][1][part] for unit, tree, part in table[list(spec.parts), :3].tolist()]
        if spec.kind == "packed":
            return assemble_row(parts, settings.block, settings.pad_id)
        if spec.kind == "walked":
            return dfs_row(parts[0], settings.pad_id)
        if spec.kind == "shard":
            return shard_row(assemble_row(parts, size * settings.block, settings.pad_id), size, spec.position)
        chunk = settings.dfs_chunk or settings.budget
        return shard_walked_row(dfs_row(parts[0], settings.pad_id), chunk, size, spec.position)


Exchange = Callable[[StepSummary], Sequence[StepSummary]]
"""Gathers one summary from every rank, in rank order, on every rank (:func:`all_gather_exchange`)."""


def plan_rank(units: StepUnits, settings: PlanSettings, world_size: int, rank: int, exchange: Exchange) -> RankPlan:
    """This rank's items for the step of ``units``: the trainer's entry point (module docstring)."""
    planner = RankPlanner(units, settings, world_size, rank)
    return planner.plan(exchange(planner.summarise()))


def all_gather_exchange(summary: StepSummary) -> list[StepSummary]:
    """The exchange of a run: ``torch.distributed.all_gather_object`` over the default process group."""
    import torch.distributed as dist

    gathered: list[StepSummary | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summary)
    return gathered


def simulate_ranks(units: StepUnits, settings: PlanSettings, world_size: int) -> list[RankPlan]:
    """Every rank's :func:`plan_rank` in one process, rank after rank, the exchange a list (tests, the simulator)."""
    planners = [RankPlanner(units, settings, world_size, rank) for rank in range(world_size)]
    summaries = [planner.summarise() for planner in planners]
    return [planner.plan(summaries) for planner in planners]
