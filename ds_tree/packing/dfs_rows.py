"""Rows for the dfs mode: whole trees, one per row, under no token budget (docs/DESIGN.md section 5).

A :class:`DfsRow` is a packed row that :mod:`ds_tree.engine.dfs` walks chunk by chunk instead of
forwarding at once, so its size is not bounded by ``packing.budget``. In tree mode with
``packing.over_budget: dfs``, the trees that no row can hold (a root-to-leaf path over the budget)
become such rows and the rest is packed as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

from ds_tree.packing.balance import balance_parts
from ds_tree.packing.parts import TreePart, whole_tree
from ds_tree.packing.rows import PackedRow, assemble_row
from ds_tree.trees.trie import TokenTree


@dataclass(kw_only=True)
class DfsRow(PackedRow):
    """A packed row that the dfs walk runs (whole trees; no budget applies to it)."""

    kind: ClassVar[str] = "walked"


def dfs_row(part: TreePart, pad_id: int = 0) -> DfsRow:
    row = assemble_row([part], 1, pad_id)
    return DfsRow(**{item.name: getattr(row, item.name) for item in fields(row)})


def dfs_rows_per_rank(
    trees: Sequence[TokenTree], world_size: int, cost_per_token: float, cost_per_pair: float, pad_id: int = 0
) -> list[list[DfsRow]]:
    """Whole trees balanced over ranks by the packing cost model, one :class:`DfsRow` each."""
    shares = balance_parts([whole_tree(tree) for tree in trees], world_size, cost_per_token, cost_per_pair)
    return [[dfs_row(part, pad_id) for part in share] for share in shares]


def with_walked_rows(
    shares: list[list[PackedRow]],
    walked: Sequence[TokenTree],
    cost_per_token: float,
    cost_per_pair: float,
    pad_id: int = 0,
) -> list[list[PackedRow]]:
    """Each rank's packed rows (``shares``) followed by its share of ``walked`` trees as :class:`DfsRow`.

    When trees are walked, the empty rows that even out the row counts are dropped: the dfs step
    evens out the backward calls itself (:func:`ds_tree.objectives.sft.run_rows` with ``dfs``).
    """
    if not walked:
        return shares
    extra = dfs_rows_per_rank(walked, len(shares), cost_per_token, cost_per_pair, pad_id)
    return [[row for row in rows if row.n_real] + more for rows, more in zip(shares, extra, strict=True)]


def split_over_budget(
    trees: Sequence[TokenTree], mode: str, over_budget: str, budget: int
) -> tuple[list[TokenTree], list[TokenTree]]:
    """``(trees to pack, trees to walk)``: in dfs mode every tree is walked; in tree mode with
    ``over_budget="dfs"`` the trees with a root-to-leaf path longer than ``budget``; else none."""
    if mode == "dfs":
        return [], list(trees)
    if mode != "tree" or over_budget != "dfs":
        return list(trees), []
    walk = [tree.max_path_tokens > budget for tree in trees]
    return [t for t, w in zip(trees, walk, strict=True) if not w], [t for t, w in zip(trees, walk, strict=True) if w]
