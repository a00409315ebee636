"""Planning with sequence-parallel rows (Ulysses, docs/DESIGN.md section 5).

``world_size`` ranks form ``world_size / S`` sequence-parallel groups of ``S`` consecutive ranks.
A tree whose longest root-to-leaf path fits one rank's ``budget`` is split and packed exactly as
without sequence parallelism, its parts balanced over all ranks. A tree with a longer path goes to
*sequence-parallel rows*: it is split under ``S x budget`` (parts carry their ancestor path, so no
attention crosses rows), its parts are balanced over the groups with the same cost model and packed
into rows of at most ``S x budget`` real tokens, padded to a multiple of ``S x block`` with self-only
tokens. Every rank of a group holds the group's whole rows and computes one contiguous shard of
each (:func:`shard_bounds`).

Every rank takes part in the same number of forwards (ZeRO-3 gathers parameters collectively):
the groups' row lists are padded with empty rows to a common count, and so are the ranks' own rows.

A rank computes its shard of a row as a :class:`RowShard`: the whole row's arrays, with the loss
terms of the targets predicted from other shards set to 0 (labels are shifted on the whole row:
``pred_pos`` may point into an earlier shard) and ``pred_pos`` made shard-local, and model inputs cut
to the shard except ``kv_end``, which the tree attention needs whole after the all-to-all. The
shards of a row hold each loss term exactly once, so :func:`~ds_tree.objectives.sft.run_rows` and the
step-wide sums of :class:`~ds_tree.losses.sft.Normalisers` take them as they take rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ds_tree.packing.balance import balance_parts, rows_per_rank
from ds_tree.packing.parts import TreePart, split_tree
from ds_tree.packing.rows import PackedRow, RowImages, assemble_row, pack_rows
from ds_tree.trees.token_arrays import TOKEN_FIELDS, ArrayKind
from ds_tree.trees.trie import TokenTree


@dataclass
class SequenceParallelRows:
    """One step's rows on every rank."""

    sharded: list[list[PackedRow]]
    """Per sequence-parallel group: its whole rows (each rank of the group computes one shard)."""
    own: list[list[PackedRow]]
    """Per rank: the rows it computes alone."""

    def rank_rows(self, rank: int, size: int) -> list[PackedRow]:
        """What ``rank`` computes: its shard of each of its group's rows, then its own rows."""
        group, position = divmod(rank, size)
        return [shard_row(row, size, position) for row in self.sharded[group]] + self.own[rank]

    @property
    def packed_tokens(self) -> int:
        """Tokens computed over all ranks (each sequence-parallel row once), padding of non-empty rows included."""
        return sum(row.n_tokens for rows in self.sharded + self.own for row in rows if row.n_real)


def longest_path(tree: TokenTree) -> int:
    return max(len(trajectory) for trajectory in tree.trajectories)


def split_for_sequence_parallel(
    trees: list[TokenTree], budget: int, size: int
) -> tuple[list[TreePart], list[TreePart]]:
    """``(parts for one rank, parts for sequence-parallel rows)``: a tree whose longest path is over
    ``budget`` is split under ``size x budget`` (a path over that is the error of :func:`split_tree`)."""
    own, sharded = [], []
    for tree in trees:
        if longest_path(tree) > budget:
            sharded.extend(split_tree(tree, size * budget))
        else:
            own.extend(split_tree(tree, budget))
    return own, sharded


def plan_sequence_parallel_rows(
    trees: list[TokenTree],
    world_size: int,
    size: int,
    budget: int,
    block: int = 1,
    cost_per_token: float = 1.0,
    cost_per_pair: float = 0.0,
    pad_id: int = 0,
) -> SequenceParallelRows:
    """Every rank's rows for one step with sequence-parallel groups of ``size`` ranks."""
    if world_size % size:
        raise ValueError(f"world size {world_size} is not a multiple of the sequence-parallel size {size}")
    own_parts, sharded_parts = split_for_sequence_parallel(trees, budget, size)
    row_block = size * block
    sharded = [
        pack_rows(share, size * budget, row_block, pad_id) if share else []
        for share in balance_parts(sharded_parts, world_size // size, cost_per_token, cost_per_pair)
    ]
    sharded = _padded(sharded, row_block, pad_id)
    if own_parts or not sharded_parts:
        own = rows_per_rank(own_parts, world_size, budget, block, cost_per_token, cost_per_pair, pad_id)
    else:
        own = [[] for _ in range(world_size)]
    return SequenceParallelRows(sharded, own)


def _padded(lists: list[list[PackedRow]], block: int, pad_id: int) -> list[list[PackedRow]]:
    count = max(len(rows) for rows in lists)
    return [rows + [assemble_row([], block, pad_id) for _ in range(count - len(rows))] for rows in lists]


def shard_bounds(n_tokens: int, size: int, position: int) -> tuple[int, int]:
    """``[start, end)`` of shard ``position`` of a row of ``n_tokens`` (a multiple of ``size``)."""
    if n_tokens % size:
        raise ValueError(f"a sequence-parallel row of {n_tokens} tokens does not split into {size} equal shards")
    length = n_tokens // size
    return position * length, (position + 1) * length


@dataclass(kw_only=True)
class RowShard(PackedRow):
    """Shard ``[start, end)`` of a sequence-parallel row, as one rank of its group computes it."""

    kind: ClassVar[str] = "shard"

    start: int
    end: int
    row_parts: list[TreePart]
    """The whole row's parts, on every shard (``parts`` lists them on the first shard only): the
    trajectories laid out in the row's tokens, whose per-token RL terms each shard forms for the
    targets predicted inside it (:func:`~ds_tree.objectives.rl_rows.trajectory_copies`)."""

    @property
    def layout_parts(self) -> list[TreePart]:
        return self.row_parts

    def tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The shard's ``input_ids`` and ``position_ids`` (a row with images: ``[4, 1, n]``, the multimodal
        rotary rows cut like the depth), and the whole row's ``kv_end``. A row with images passes the
        images with placeholders in the shard (``row_images``, :meth:`image_inputs` of the shard's tokens;
        none: the shard has no placeholder): the rank encodes them, gathers its placeholders' features and
        backpropagates their gradients into the tower, so the tower's gradient summed over the group is the
        row's, as the language model's is (:mod:`ds_tree.models.ulysses`)."""
        whole = super().tensors(device)
        shard = {name: value[..., self.start : self.end] for name, value in whole.items() if name != "row_images"}
        shard["kv_end"] = whole["kv_end"]
        if "row_images" in whole:
            shard["row_images"] = whole["row_images"]
        return shard

    def forward_images(self) -> RowImages | None:
        """The images with placeholders in the shard (None: none), not the whole row's."""
        images = self.image_inputs(np.arange(self.start, self.end))
        return images if images.pixel_values else None


def shard_row(row: PackedRow, size: int, position: int) -> RowShard:
    """The shard ``position`` of ``row`` (module docstring). Only the first shard lists the row's
    parts, so that sums over a group's ranks (trained sequences) count each trajectory once."""
    start, end = shard_bounds(row.n_tokens, size, position)
    here = (row.pred_pos >= start) & (row.pred_pos < end)
    arrays = {name: getattr(row, name) for name in TOKEN_FIELDS}
    for name, spec in TOKEN_FIELDS.items():
        if spec.kind is ArrayKind.WEIGHT:
            arrays[name] = np.where(here, arrays[name], 0)
    arrays["pred_pos"] = np.where(here, row.pred_pos - start, -1)
    parts = row.parts if position == 0 else []
    return RowShard(**arrays, parts=parts, n_real=row.n_real, start=start, end=end, row_parts=row.parts)
