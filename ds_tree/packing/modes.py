"""Trajectories -> packed rows, for each execution mode that packs (docs/DESIGN.md section 5).

``tree``: one trie per group (or over everything), trees larger than the budget split into parts
that carry their ancestor path, parts bin-packed into rows. ``flat``: the baseline, every
trajectory its own sequence, packed into rows the same way with the same kernels. ``dfs``: whole
trees, never split and under no budget (each is walked chunk by chunk, :mod:`ds_tree.engine.dfs`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ds_tree.packing.dfs_rows import dfs_row
from ds_tree.packing.parts import TreePart, check_fits, split_tree, whole_tree
from ds_tree.packing.rows import PackedRow, pack_rows
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import TokenTree, build_forest

MODES = ("tree", "flat", "dfs")


def make_parts(
    trajectories: Sequence[Trajectory],
    mode: str,
    budget: int,
    merge: str = "group",
    trees: list[TokenTree] | None = None,
) -> list[TreePart]:
    """Parts of at most ``budget`` tokens; a trajectory longer than the budget is an error naming it.

    ``trees``: the tree-mode forest when the caller already built it (with the same ``merge``).
    """
    if mode == "flat":
        trees = build_forest(trajectories, merge="none")
        for tree in trees:
            check_fits(tree, budget)
        return [whole_tree(tree) for tree in trees]
    if mode == "tree":
        trees = build_forest(trajectories, merge=merge) if trees is None else trees
        return [part for tree in trees for part in split_tree(tree, budget)]
    if mode == "dfs":
        trees = build_forest(trajectories, merge=merge) if trees is None else trees
        return [whole_tree(tree) for tree in trees]
    raise ValueError(f"packing mode must be one of {MODES}, got {mode!r}")


def pack_trajectories(
    trajectories: Sequence[Trajectory],
    mode: str,
    budget: int,
    block: int = 1,
    merge: str = "group",
    pad_id: int = 0,
) -> list[PackedRow]:
    """Rows of at most ``budget`` real tokens, padded to a multiple of ``block`` (dfs: one whole tree each)."""
    parts = make_parts(trajectories, mode, budget, merge)
    if mode == "dfs":
        return [dfs_row(part, pad_id) for part in parts]
    return pack_rows(parts, budget, block, pad_id)
