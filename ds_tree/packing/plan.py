"""The step plan: one pure function from a step's trajectories to every rank's work items.

A step's trees are built once (:func:`plan_step`), then each tree goes to one execution kind and
its items are balanced over the ranks by the cost model (``cost_per_token * tokens +
cost_per_pair * visible attention pairs``, :mod:`ds_tree.packing.balance`):

- ``packed`` (:class:`~ds_tree.packing.rows.PackedRow`): trees, or parts of a tree that each carry
  their ancestor path, bin-packed into rows of at most ``packing.budget`` tokens;
- ``walked`` (:class:`~ds_tree.packing.dfs_rows.DfsRow`): a whole tree walked depth-first in
  chunks (``packing.mode: dfs``, or ``over_budget: dfs`` for a tree with a root-to-leaf path over
  the budget);
- ``shard`` (:class:`~ds_tree.packing.sequence_parallel.RowShard`): this rank's shard of a row of
  up to ``S x budget`` tokens that a sequence-parallel group of ``S`` ranks computes together
  (a tree with a path over the budget when ``parallel.sequence_parallel_size`` is ``S > 1``);
- ``walked_shard`` (:class:`~ds_tree.packing.dfs_shards.DfsRowShard`): this rank's shard of every chunk
  of a tree its sequence-parallel group walks together (``S > 1`` with ``packing.mode: dfs``, every
  tree; or with ``over_budget: dfs``, a tree with a path over the budget, the others packed).

An item's kind is its class's ``kind``; the engine runs each kind with the runner registered for
it (:mod:`ds_tree.engine.runners`), whatever the objective. Every rank computes the same plan from
the same trajectories, so no rank needs another's to know its share. :meth:`StepPlan.explain`
prints it (``ds-tree plan CONFIG --explain``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ds_tree.packing.balance import part_cost, rows_per_rank
from ds_tree.packing.dfs_rows import split_over_budget, with_walked_rows
from ds_tree.packing.dfs_shards import plan_walked_shards
from ds_tree.packing.parts import TreePart, check_fits, split_tree, whole_tree
from ds_tree.packing.rows import PackedRow
from ds_tree.packing.sequence_parallel import plan_sequence_parallel_rows
from ds_tree.trees.stats import token_counts
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import TokenTree, build_forest


@dataclass(frozen=True)
class PlanSettings:
    """The config fields a step plan depends on (``packing``, ``data.merge``, sequence parallelism)."""

    mode: str = "tree"
    budget: int = 2048
    block: int = 1
    over_budget: str = "error"
    merge: str = "group"
    cost_per_token: float = 1.0
    cost_per_pair: float = 0.0
    sequence_parallel_size: int = 1
    pad_id: int = 0
    dfs_chunk: int = 0
    """The dfs walk's chunk (0: ``budget``): walked trees sharded over a sequence-parallel group follow its chunks."""

    @classmethod
    def of_config(cls, config, pad_id: int = 0) -> PlanSettings:
        """From a :class:`ds_tree.config.Config` (``pad_id``: the model's padding token)."""
        packing = config.packing
        return cls(
            mode=packing.mode,
            budget=packing.budget,
            block=packing.block,
            over_budget=packing.over_budget,
            merge=config.data.merge,
            cost_per_token=packing.cost_per_token,
            cost_per_pair=packing.cost_per_pair,
            sequence_parallel_size=config.parallel.sequence_parallel_size,
            pad_id=pad_id,
            dfs_chunk=packing.dfs_chunk,
        )


@dataclass
class RankPlan:
    """One rank's view of a :class:`StepPlan`: its items and the step's token counts."""

    rows: list[PackedRow]
    """This rank's work items, in the order it runs them."""
    flat_tokens: int
    """Sum of trajectory lengths of the whole step (all ranks)."""
    tree_tokens: int
    """Distinct tokens of the step's trees."""
    packed_tokens: int
    """Tokens actually computed over all ranks (duplicated prefixes and padding included)."""


@dataclass
class StepPlan:
    """Every rank's work items for one step (module docstring)."""

    ranks: list[list[PackedRow]]
    flat_tokens: int
    tree_tokens: int
    packed_tokens: int
    settings: PlanSettings

    def for_rank(self, rank: int) -> RankPlan:
        return RankPlan(self.ranks[rank], self.flat_tokens, self.tree_tokens, self.packed_tokens)

    def as_dict(self) -> dict:
        """The plan as JSON-ready data: counts, and per rank its items' kind, tokens, trees, cost and why."""
        settings = self.settings
        return {
            "flat_tokens": self.flat_tokens,
            "tree_tokens": self.tree_tokens,
            "packed_tokens": self.packed_tokens,
            "ranks": [
                [
                    {
                        "kind": row.kind,
                        "tokens": row.n_tokens,
                        "real_tokens": row.n_real,
                        "trees": len(row.parts),
                        "trajectories": sum(len(part.trajectory_ids) for part in row.parts),
                        "cost": item_cost(row, settings),
                        "why": why(row, settings),
                    }
                    for row in items
                ]
                for items in self.ranks
            ],
        }

    def rank_costs(self) -> list[float]:
        """Each rank's predicted cost (:func:`item_share` summed over its items)."""
        return [sum(item_share(row, self.settings) for row in items) for items in self.ranks]

    def explain(self) -> str:
        """A table of every rank's items: kind, tokens, trees, trajectories, predicted cost."""
        settings = self.settings
        lines = [
            f"step plan: {self.flat_tokens} flat tokens, {self.tree_tokens} tree tokens "
            f"(ideal speedup {self.flat_tokens / max(self.tree_tokens, 1):.2f}x), {self.packed_tokens} computed "
            f"over {len(self.ranks)} rank(s)",
            f"{'rank':>4}  {'item':>4}  {'kind':<6}  {'tokens':>7}  {'trees':>5}  {'paths':>5}  {'cost':>10}  why",
        ]
        for rank, items in enumerate(self.ranks):
            total = 0.0
            for index, row in enumerate(items):
                cost = item_cost(row, settings)
                total += cost
                paths = sum(len(part.trajectory_ids) for part in row.parts)
                lines.append(
                    f"{rank:>4}  {index:>4}  {row.kind:<6}  {row.n_tokens:>7}  {len(row.parts):>5}  {paths:>5}  "
                    f"{cost:>10.1f}  {why(row, settings)}"
                )
            lines.append(f"{rank:>4}  {'all':>4}  {'':<6}  {'':>7}  {'':>5}  {'':>5}  {total:>10.1f}")
        return "\n".join(lines)


def item_cost(row: PackedRow, settings: PlanSettings) -> float:
    """The cost model's figure for an item (its parts' costs, :func:`~ds_tree.packing.balance.part_cost`)."""
    return sum(part_cost(part, settings.cost_per_token, settings.cost_per_pair) for part in row.parts)


def item_share(row: PackedRow, settings: PlanSettings) -> float:
    """The cost model's figure for what the rank running ``row`` computes of it: a row or walk it computes
    alone, whole; a shard of a row (or walk) that its sequence-parallel group computes together, ``1/S`` of it."""
    cost = sum(part_cost(part, settings.cost_per_token, settings.cost_per_pair) for part in row.layout_parts)
    return cost / settings.sequence_parallel_size if row.kind in ("shard", "walked_shard") else cost


def balance(costs: Sequence[float]) -> float:
    """Max over mean of the ranks' predicted costs (1: perfectly even; 1 for a step with nothing to do)."""
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean > 0 else 1.0


def why(row: PackedRow, settings: PlanSettings) -> str:
    """Why an item got its kind, in words."""
    if row.kind == "walked":
        if settings.mode == "dfs":
            return "packing.mode dfs walks every tree"
        longest = max((p.tree.max_path_tokens for p in row.parts), default=0)
        return f"a path of {longest} tokens is over packing.budget {settings.budget} (over_budget: dfs)"
    if row.kind == "walked_shard":
        sharded = f"its chunks sharded over {row.size} ranks"
        if settings.mode == "dfs":
            return f"packing.mode dfs walks every tree, {sharded}"
        longest = max((p.tree.max_path_tokens for p in row.row_parts), default=0)
        return f"a path of {longest} tokens is over packing.budget {settings.budget} (over_budget: dfs), {sharded}"
    if row.kind == "shard":
        size = settings.sequence_parallel_size
        return f"its row's paths are over packing.budget {settings.budget}: one of {size} shards"
    if not row.n_real:
        return "empty (every rank runs as many rows)"
    return f"{settings.mode} rows under packing.budget {settings.budget}"


def plan_step(trajectories: Sequence[Trajectory], settings: PlanSettings, world_size: int) -> StepPlan:
    """Every rank's items for ``trajectories`` (module docstring); the trees are built here, once."""
    trees = build_forest(trajectories, merge=settings.merge)
    counts = token_counts(trees)
    layout = trees if settings.mode != "flat" else build_forest(trajectories, merge="none")
    if settings.sequence_parallel_size > 1 and settings.mode == "dfs":  # every tree walked by a group
        size, chunk = settings.sequence_parallel_size, settings.dfs_chunk or settings.budget
        ranks = plan_walked_shards(
            layout, world_size, size, chunk, settings.cost_per_token, settings.cost_per_pair, settings.pad_id
        )
        packed = sum(row.n_tokens for rows in ranks[::size] for row in rows)
        return StepPlan(ranks, counts.flat_tokens, counts.tree_tokens, packed, settings)
    if settings.sequence_parallel_size > 1 and settings.mode == "tree" and settings.over_budget == "dfs":
        return _walked_over_budget(layout, counts.flat_tokens, counts.tree_tokens, settings, world_size)
    if settings.sequence_parallel_size > 1:
        rows = plan_sequence_parallel_rows(
            layout,
            world_size,
            settings.sequence_parallel_size,
            settings.budget,
            settings.block,
            settings.cost_per_token,
            settings.cost_per_pair,
            pad_id=settings.pad_id,
        )
        ranks = [rows.rank_rows(rank, settings.sequence_parallel_size) for rank in range(world_size)]
        return StepPlan(ranks, counts.flat_tokens, counts.tree_tokens, rows.packed_tokens, settings)
    packed_trees, walked = split_over_budget(layout, settings.mode, settings.over_budget, settings.budget)
    parts = tree_parts(packed_trees, settings)
    ranks = rows_per_rank(
        parts,
        world_size,
        settings.budget,
        settings.block,
        settings.cost_per_token,
        settings.cost_per_pair,
        pad_id=settings.pad_id,
    )
    ranks = with_walked_rows(ranks, walked, settings.cost_per_token, settings.cost_per_pair, settings.pad_id)
    packed = sum(row.n_tokens for rows in ranks for row in rows if row.n_real)
    return StepPlan(ranks, counts.flat_tokens, counts.tree_tokens, packed, settings)


def _walked_over_budget(
    trees: Sequence[TokenTree], flat_tokens: int, tree_tokens: int, settings: PlanSettings, world_size: int
) -> StepPlan:
    """Tree mode with ``over_budget: dfs`` and ``S > 1``: each tree with a path over the budget walked by one
    sequence-parallel group (each rank one shard of every chunk, as ``packing.mode: dfs`` walks every tree),
    the others packed into rows under the budget that each rank computes alone. Every rank runs its walked
    shards first: the ranks of a group hold the same ones, so they make their calls (and the all-to-alls
    inside them) in the same order, under ZeRO-3's lockstep schedule too, before their own rows. The two
    kinds are balanced separately: the walks over the groups, the rows over the ranks."""
    size, chunk = settings.sequence_parallel_size, settings.dfs_chunk or settings.budget
    packed_trees, walked = split_over_budget(trees, settings.mode, settings.over_budget, settings.budget)
    cost = dict(cost_per_token=settings.cost_per_token, cost_per_pair=settings.cost_per_pair, pad_id=settings.pad_id)
    shards = plan_walked_shards(walked, world_size, size, chunk, **cost)
    rows = rows_per_rank(tree_parts(packed_trees, settings), world_size, settings.budget, settings.block, **cost)
    ranks = [walks + [row for row in own if row.n_real] for walks, own in zip(shards, rows, strict=True)]
    packed = sum(row.n_tokens for walks in shards[::size] for row in walks)  # a walk once per group
    packed += sum(row.n_tokens for own in rows for row in own if row.n_real)
    return StepPlan(ranks, flat_tokens, tree_tokens, packed, settings)


def tree_parts(trees: Sequence[TokenTree], settings: PlanSettings) -> list[TreePart]:
    """The parts of ``trees`` under the budget: a flat trajectory whole (an error when over the budget),
    a tree split into parts that carry their ancestor path (:func:`~ds_tree.packing.parts.split_tree`)."""
    if settings.mode == "flat":
        for tree in trees:
            check_fits(tree, settings.budget)
        return [whole_tree(tree) for tree in trees]
    return [part for tree in trees for part in split_tree(tree, settings.budget)]
