"""Walked trees sharded over a sequence-parallel group: dfs with Ulysses (docs/DESIGN.md section 5).

With ``packing.mode: dfs`` and ``parallel.sequence_parallel_size`` ``S > 1``, every tree is walked
(:mod:`ds_tree.engine.dfs`) by one sequence-parallel group of ``S`` ranks together: all of them walk
the same chunks (:func:`~ds_tree.packing.dfs_chunks.row_chunks`) in the same order, and each forwards
one contiguous shard of every chunk, the chunk padded at its end to a multiple of ``S`` tokens
(:func:`chunk_shard_of`). Inside the attention, Ulysses' all-to-all gives each rank the whole chunk
for ``H / S`` heads, so the cached ancestor keys and values it keeps are those heads' only
(:mod:`ds_tree.engine.dfs_sequence_parallel`): activations and cache are both ``1 / S`` of one
rank's walk.

A rank's item is a :class:`DfsRowShard`: the whole tree's row, with the loss weights of the targets
predicted outside the rank's shards set to 0 (each term is then held by exactly one rank of the
group, so :class:`~ds_tree.losses.sft.Normalisers` and the loss sums take shards as they take rows)
and the parts listed on position 0 only (a trajectory is counted once). ``pred_pos`` stays
row-global: the walk finds each target's chunk and shard itself. The shard of a token depends on
the chunks, so the plan cuts them with the walk's own ``chunk`` (carried by the item).

Trees are balanced over the groups by the packing cost model, as walked trees are over ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ds_tree.packing.dfs_chunks import Chunks, row_chunks
from ds_tree.packing.dfs_rows import DfsRow, dfs_rows_per_rank
from ds_tree.packing.parts import TreePart
from ds_tree.trees.token_arrays import TOKEN_FIELDS, ArrayKind
from ds_tree.trees.trie import TokenTree


@dataclass(kw_only=True)
class DfsRowShard(DfsRow):
    """One rank's share of a tree that its sequence-parallel group walks (module docstring)."""

    kind: ClassVar[str] = "walked_shard"

    chunk: int
    """The walk's chunk size (the shards follow its chunks)."""
    size: int
    """Ranks of the sequence-parallel group (S)."""
    position: int
    """This rank's shard of every chunk."""
    row_parts: list[TreePart]
    """The whole row's parts, on every shard (``parts`` lists them on position 0 only)."""

    @property
    def layout_parts(self) -> list[TreePart]:
        return self.row_parts

    def predicted_here(self) -> np.ndarray:
        """Per row token, whether this rank's shards predict it (``pred_pos`` stays row-global)."""
        return predicted_in_shard(self, self.chunk, self.size, self.position)


def shard_length(chunk_tokens: np.ndarray | int, size: int) -> np.ndarray | int:
    """Tokens of each shard of a chunk of ``chunk_tokens`` real tokens padded to a multiple of ``size``."""
    return -(-chunk_tokens // size)


def chunk_shard_of(chunks: Chunks, n_tokens: int, size: int) -> np.ndarray:
    """For each of a row's ``n_tokens`` tokens, the shard (``0 .. size - 1``) of its chunk that holds it
    (-1: padding, in no chunk)."""
    shard = np.full(n_tokens, -1, dtype=np.int64)
    if len(chunks) == 0:
        return shard
    within = np.arange(chunks.order.size) - chunks.start[chunks.chunk_of]
    lengths = shard_length(chunks.end - chunks.start, size)
    shard[chunks.order] = within // lengths[chunks.chunk_of]
    return shard


def predicted_in_shard(row: DfsRow, chunk: int, size: int, position: int) -> np.ndarray:
    """Per token of ``row`` walked in chunks of ``chunk`` tokens by ``size`` ranks, whether shard ``position``
    predicts it."""
    shard_of = chunk_shard_of(row_chunks(row, chunk), row.n_tokens, size)
    predicted = row.pred_pos >= 0
    return predicted & (shard_of[np.where(predicted, row.pred_pos, 0)] == position)


def shard_walked_row(row: DfsRow, chunk: int, size: int, position: int) -> DfsRowShard:
    """Position ``position``'s :class:`DfsRowShard` of ``row`` walked in chunks of ``chunk`` tokens."""
    here = predicted_in_shard(row, chunk, size, position)
    arrays = {name: getattr(row, name) for name in TOKEN_FIELDS}
    for name, spec in TOKEN_FIELDS.items():
        if spec.kind is ArrayKind.WEIGHT:
            arrays[name] = np.where(here, arrays[name], 0)
    parts = row.parts if position == 0 else []
    return DfsRowShard(
        **arrays, parts=parts, n_real=row.n_real, chunk=chunk, size=size, position=position, row_parts=row.parts
    )


def plan_walked_shards(
    trees: Sequence[TokenTree],
    world_size: int,
    size: int,
    chunk: int,
    cost_per_token: float = 1.0,
    cost_per_pair: float = 0.0,
    pad_id: int = 0,
) -> list[list[DfsRowShard]]:
    """Every rank's items: the trees balanced over the ``world_size / size`` groups, each group's trees
    walked by all its ranks, rank ``r`` computing shard ``r % size`` (groups of consecutive ranks)."""
    if world_size % size:
        raise ValueError(f"world size {world_size} is not a multiple of the sequence-parallel size {size}")
    if chunk < 1:
        raise ValueError(f"the dfs chunk size must be >= 1, got {chunk}")
    groups = dfs_rows_per_rank(trees, world_size // size, cost_per_token, cost_per_pair, pad_id)
    return [
        [shard_walked_row(row, chunk, size, rank % size) for row in groups[rank // size]] for rank in range(world_size)
    ]
