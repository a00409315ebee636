"""Which chunk of a dfs walk encodes each of a walked row's images, and where every chunk reads its
placeholders' features (:mod:`ds_tree.engine.dfs`, :mod:`ds_tree.models.vision`).

An image (one of a tree's distinct images, by identity) is encoded by one chunk of the walk, its
*owner*: the deepest chunk that is, or is an ancestor of, every chunk holding its placeholders (their
lowest common ancestor in the chunk tree). The owner's forward precedes and its backward follows
every one of theirs, so the walk can keep the owner's features cached with its keys and values
(leaves that accumulate the gradient its descendants send them) and backward them through the tower
once, with the owner's own. An image cut by a chunk boundary, one shown again deeper in a path, and
one in two sibling branches are all encoded once per walk. Chunks under different root chunks share
no ancestor: an image of a tree whose parts sit under several roots of one row is encoded once per
root (a tree laid out whole is under one root).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_tree.packing.dfs_chunks import Chunks
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.images import TrajectoryImage


@dataclass
class ChunkImages:
    """One chunk's share of the walk's images."""

    encodes: list[TrajectoryImage]
    """The images this chunk encodes (it owns them), in order of first appearance in the row."""
    sources: list[int]
    """The ancestor chunks whose cached features it reads, root first."""
    feature_index: np.ndarray
    """Per placeholder token of the chunk, ascending: the index of its merged patch in the concatenation of
    the chunk's own features (``encodes``') and each source's, in ``sources`` order."""


class WalkImages:
    """The owner of each of a walked row's images and every chunk's :class:`ChunkImages` (module docstring)."""

    def __init__(self, row: PackedRow, chunks: Chunks) -> None:
        placeholders = np.flatnonzero(row.image_id[: row.n_real] >= 0)
        holder = chunks.of_tokens(placeholders)
        parent = np.asarray(chunks.parent)
        depth, root = _depths_and_roots(parent)
        slot_of, images = _slots(row, placeholders, root[holder])
        owner = [_lowest_common_ancestor(np.unique(holder[slot_of == s]), parent, depth) for s in range(len(images))]
        offset = np.zeros(len(images), dtype=np.int64)
        """Each image's first merged patch in its owner's features."""
        self.owned: list[list[int]] = [[] for _ in range(len(chunks))]
        for slot, chunk in enumerate(owner):
            offset[slot] = sum(images[s].tokens for s in self.owned[chunk])
            self.owned[chunk].append(slot)
        self.images = images
        self._chunks: list[ChunkImages] = []
        for index in range(len(chunks)):
            mine = holder == index
            owners = np.asarray(owner, dtype=np.int64)[slot_of[mine]]
            sources = sorted({int(o) for o in owners} - {index}, key=lambda chunk: depth[chunk])
            blocks = [index, *sources]  # the chunk's own features, then each source's
            base = dict(
                zip(blocks, np.cumsum([0] + [self.encoded_tokens(chunk) for chunk in blocks[:-1]]), strict=True)
            )
            starts = np.array([base[int(o)] for o in owners], dtype=np.int64) + offset[slot_of[mine]]
            self._chunks.append(
                ChunkImages(
                    encodes=[images[s] for s in self.owned[index]],
                    sources=sources,
                    feature_index=starts + row.image_patch[placeholders[mine]],
                )
            )

    def encoded_tokens(self, chunk: int) -> int:
        """The merged patches of the images ``chunk`` encodes."""
        return sum(self.images[s].tokens for s in self.owned[chunk])

    def chunk(self, index: int) -> ChunkImages:
        return self._chunks[index]

    def __len__(self) -> int:
        """The images the walk encodes."""
        return len(self.images)


def _depths_and_roots(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each chunk's depth in the chunk tree and its root chunk (a parent comes before its children)."""
    depth = np.zeros(parent.size, dtype=np.int64)
    root = np.arange(parent.size)
    for index in range(parent.size):
        if parent[index] >= 0:
            depth[index] = depth[parent[index]] + 1
            root[index] = root[parent[index]]
    return depth, root


def _slots(row: PackedRow, placeholders: np.ndarray, roots: np.ndarray) -> tuple[np.ndarray, list[TrajectoryImage]]:
    """Each placeholder's slot (its tree's image under its root chunk) and the slots' images, in order of
    first appearance."""
    starts = np.cumsum([0] + [part.n_tokens for part in row.layout_parts])
    part_of = np.searchsorted(starts, placeholders, side="right") - 1
    trees: dict[int, int] = {}
    slots: dict[tuple[int, int, int], int] = {}
    images: list[TrajectoryImage] = []
    slot_of = np.empty(placeholders.size, dtype=np.int64)
    for j, token in enumerate(placeholders):
        tree = row.layout_parts[part_of[j]].tree
        image_id = int(row.image_id[token])
        key = (trees.setdefault(id(tree), len(trees)), image_id, int(roots[j]))
        if key not in slots:
            slots[key] = len(images)
            images.append(tree.images[image_id])
        slot_of[j] = slots[key]
    return slot_of, images


def _lowest_common_ancestor(chunks: np.ndarray, parent: np.ndarray, depth: np.ndarray) -> int:
    """The deepest chunk that is, or is an ancestor of, each of ``chunks`` (all under one root)."""
    common = int(chunks[0])
    for chunk in chunks[1:]:
        other = int(chunk)
        while common != other:
            if depth[common] >= depth[other]:
                common = int(parent[common])
            else:
                other = int(parent[other])
    return common
