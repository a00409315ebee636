"""Trajectories -> packed rows for one process, in each execution mode (docs/DESIGN.md section 5).

``tree``: one trie per group (or over everything), trees larger than the budget split into parts
that carry their ancestor path, parts bin-packed into rows. ``flat``: the baseline, every
trajectory its own sequence, packed into rows the same way with the same kernels. ``dfs``: whole
trees, never split and under no budget (each is walked chunk by chunk, :mod:`ds_tree.engine.dfs`).
Both functions are the step plan (:mod:`ds_tree.packing.plan`) on one rank, as ``verify`` and
``bench`` run it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ds_tree.packing.parts import TreePart, whole_tree
from ds_tree.packing.plan import PlanSettings, plan_step, tree_parts
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest

MODES = ("tree", "flat", "dfs")


def _settings(mode: str, budget: int, block: int = 1, merge: str = "group", pad_id: int = 0) -> PlanSettings:
    if mode not in MODES:
        raise ValueError(f"packing mode must be one of {MODES}, got {mode!r}")
    return PlanSettings(mode=mode, budget=budget, block=block, merge=merge, pad_id=pad_id)


def make_parts(trajectories: Sequence[Trajectory], mode: str, budget: int, merge: str = "group") -> list[TreePart]:
    """Parts of at most ``budget`` tokens (dfs: whole trees); a trajectory longer than the budget is an
    error naming it."""
    settings = _settings(mode, budget, merge=merge)
    trees = build_forest(trajectories, merge=merge if mode != "flat" else "none")
    return [whole_tree(tree) for tree in trees] if mode == "dfs" else tree_parts(trees, settings)


def pack_trajectories(
    trajectories: Sequence[Trajectory],
    mode: str,
    budget: int,
    block: int = 1,
    merge: str = "group",
    pad_id: int = 0,
) -> list[PackedRow]:
    """Rows of at most ``budget`` real tokens, padded to a multiple of ``block`` (dfs: one whole tree each)."""
    return plan_step(trajectories, _settings(mode, budget, block, merge, pad_id), world_size=1).ranks[0]
