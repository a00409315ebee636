"""Exact-token prefix tries ("token trees") built from trajectories.

A group of trajectories becomes the trie of their token sequences. A node is a maximal run of
tokens without branching inside; a trajectory that ends inside a run splits it there, so every
trajectory ends at the end of a node, and identical trajectories end at the same node.

Construction sorts the group lexicographically and walks it with the longest common prefix (LCP)
of neighbours, the classic stack construction of a compacted trie: O(total tokens) numpy
comparisons plus O(trajectories * log) sorting, so 10k trajectories of 2k tokens take seconds.

The result is serialised at once in DFS pre-order (node, then each child subtree), the layout the
packer and the tree kernels use (docs/DESIGN.md section 2):
- ``position_ids[k]``: depth of token ``k`` (what the flat sequence had as its position);
- ``kv_end[k]``: end of the subtree of the node holding ``k``;
- ``pred_pos[k]``: the position whose logits predict token ``k`` (``-1`` for a root's first token);
- per-token target weights summed over the trajectories through the token (restoration weights
  before normalisation, see :mod:`ds_tree.trees.weights`).

The per-token arrays are those of :class:`~ds_tree.trees.token_arrays.TokenArrays`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ds_tree.errors import DataError
from ds_tree.trees.images import TrajectoryImage, patch_index, trie_keys
from ds_tree.trees.token_arrays import TokenArrays
from ds_tree.trees.trajectory import Trajectory, group_trajectories
from ds_tree.trees.weights import restoration_sums


@dataclass
class TokenTree(TokenArrays):
    """One tree in DFS pre-order: the per-token arrays of :class:`TokenArrays` (length ``n_tokens``),
    node arrays (length ``n_nodes``) and where each trajectory's tokens lie."""

    trajectories: list[Trajectory]
    node_start: np.ndarray
    node_end: np.ndarray
    node_parent: np.ndarray
    """Parent node id, ``-1`` for the root. Parents precede children (pre-order)."""
    subtree_end: np.ndarray
    end_node: np.ndarray
    """Node at whose end each trajectory stops."""
    paths: list[np.ndarray]
    """Per trajectory: indices of its tokens in this tree, in order."""
    images: list[TrajectoryImage] = field(default_factory=list)
    """The tree's distinct images (``image_id`` indexes them)."""

    @property
    def n_nodes(self) -> int:
        return int(self.node_start.size)

    @property
    def flat_tokens(self) -> int:
        return int(sum(len(t) for t in self.trajectories))

    @property
    def max_path_tokens(self) -> int:
        return int(max(len(t) for t in self.trajectories))

    def num_children(self) -> np.ndarray:
        """Number of children of every node."""
        counts = np.zeros(self.n_nodes, dtype=np.int64)
        parents = self.node_parent[self.node_parent >= 0]
        np.add.at(counts, parents, 1)
        return counts

    def node_depths(self) -> np.ndarray:
        """Depth of every node in nodes (the root is 1)."""
        depth = np.ones(self.n_nodes, dtype=np.int64)
        for node in range(1, self.n_nodes):
            depth[node] = depth[self.node_parent[node]] + 1
        return depth


class _Node:
    __slots__ = ("start", "end", "source", "children", "endings")

    def __init__(self, start: int, end: int, source: int) -> None:
        self.start = start  # depth of the node's first token
        self.end = end  # depth just past the node's last token
        self.source = source  # a trajectory whose tokens [start, end) are this node's
        self.children: list[_Node] = []
        self.endings: list[int] = []  # trajectories that end here


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


_SIGN = np.uint64(1 << 63)


def _sort_key(keys: np.ndarray) -> bytes:
    """Bytes that sort as ``keys`` sorts lexicographically: each int64 with its sign bit flipped (so unsigned
    order is signed order; image keys are negative), big-endian. ``sorted`` then compares with ``memcmp``
    instead of list by list of Python ints (a group of 8 agent trials of 3K tokens: 14x faster)."""
    return (np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64) ^ _SIGN).astype(">u8").tobytes()


def _build_nodes(keys: Sequence[np.ndarray]) -> list[_Node]:
    """Root nodes of the trie of the key sequences (one per distinct first key), children in key order."""
    sort_keys = [_sort_key(key) for key in keys]
    order = sorted(range(len(keys)), key=sort_keys.__getitem__)
    top = _Node(0, 0, -1)  # virtual node above the roots, holds no tokens
    stack = [top]
    previous = None
    for index in order:
        ids = keys[index]
        shared = 0 if previous is None else _common_prefix(previous, ids)
        while stack[-1].start >= shared and stack[-1] is not top:
            stack.pop()
        parent = stack[-1]
        if parent.end > shared:  # the divergence falls inside this node: split it
            lower = _Node(shared, parent.end, parent.source)
            lower.children, lower.endings = parent.children, parent.endings
            parent.end, parent.children, parent.endings = shared, [lower], []
        if ids.size == shared:  # identical to the previous trajectory (sorted order)
            parent.endings.append(index)
        else:
            node = _Node(shared, ids.size, index)
            node.endings.append(index)
            parent.children.append(node)
            stack.append(node)
        previous = ids
    return top.children


def _serialise(root: _Node, trajectories: Sequence[Trajectory]) -> TokenTree:
    nodes: list[_Node] = []
    parents: list[int] = []
    pending = [(root, -1)]
    while pending:  # iterative pre-order; children pushed reversed to keep token order
        node, parent = pending.pop()
        parents.append(parent)
        nodes.append(node)
        me = len(nodes) - 1
        pending.extend((child, me) for child in reversed(node.children))

    lengths = np.array([node.end - node.start for node in nodes], dtype=np.int64)
    node_end = np.cumsum(lengths)
    node_start = node_end - lengths
    node_parent = np.array(parents, dtype=np.int64)
    subtree_end = node_end.copy()
    for node in range(len(nodes) - 1, 0, -1):  # children come after parents: fold upwards
        parent = node_parent[node]
        subtree_end[parent] = max(subtree_end[parent], subtree_end[node])

    n = int(node_end[-1])
    input_ids = np.empty(n, dtype=np.int64)
    position_ids = np.empty(n, dtype=np.int64)
    kv_end = np.empty(n, dtype=np.int64)
    pred_pos = np.arange(-1, n - 1, dtype=np.int64)
    for node_id, node in enumerate(nodes):
        span = slice(node_start[node_id], node_end[node_id])
        input_ids[span] = trajectories[node.source].input_ids[node.start : node.end]
        position_ids[span] = np.arange(node.start, node.end)
        kv_end[span] = subtree_end[node_id]
        parent = node_parent[node_id]
        pred_pos[node_start[node_id]] = -1 if parent < 0 else node_end[parent] - 1

    members = sorted(index for node in nodes for index in node.endings)
    local = {index: position for position, index in enumerate(members)}
    end_node = np.empty(len(members), dtype=np.int64)
    for node_id, node in enumerate(nodes):
        for index in node.endings:
            end_node[local[index]] = node_id
    paths = [_path(node, node_start, node_end, node_parent) for node in end_node]
    own = [trajectories[index] for index in members]
    images, image_id, image_patch = _tree_images(nodes, trajectories, node_start, node_end, n)
    if images:
        _check_paths(own, paths, input_ids, images, image_id)
    if any(t.images or t.rope_positions is not None for t in own):
        rope = _rope_on_tree(own, paths, n)
    else:  # text: the rotary position is the depth
        rope = np.tile(position_ids, (3, 1))
    return TokenTree(
        input_ids=input_ids,
        position_ids=position_ids,
        kv_end=kv_end,
        pred_pos=pred_pos,
        owned=np.ones(n, dtype=bool),
        **restoration_sums(own, paths, n),
        image_id=image_id,
        image_patch=image_patch,
        rope_t=rope[0],
        rope_h=rope[1],
        rope_w=rope[2],
        images=images,
        trajectories=own,
        node_start=node_start,
        node_end=node_end,
        node_parent=node_parent,
        subtree_end=subtree_end,
        end_node=end_node,
        paths=paths,
    )


def _tree_images(nodes, trajectories, node_start, node_end, n: int):
    """The tree's distinct images (by identity, first appearance) and per token its image and patch."""
    images: list[TrajectoryImage] = []
    slots: dict[str, int] = {}
    image_id = np.full(n, -1, dtype=np.int64)
    image_patch = np.full(n, -1, dtype=np.int64)
    patches: dict[int, np.ndarray] = {}  # per source trajectory
    for node_id, node in enumerate(nodes):
        source = trajectories[node.source]
        if not source.images:
            continue
        if node.source not in patches:
            patches[node.source] = patch_index(source.image_index)
        span = slice(node_start[node_id], node_end[node_id])
        local = source.image_index[node.start : node.end]
        to_tree = np.array([slots.setdefault(image.key, len(slots)) for image in source.images], dtype=np.int64)
        for image, slot in zip(source.images, to_tree, strict=True):
            if slot == len(images):
                images.append(image)
        image_id[span] = np.where(local >= 0, to_tree[np.maximum(local, 0)], -1)
        image_patch[span] = patches[node.source][node.start : node.end]
    return images, image_id, image_patch


def _check_paths(own, paths, input_ids, images, image_id) -> None:
    """Every trajectory of a tree with images reads back from it: its ids, and at its image tokens its
    own images' identities. A trie that merged two different images would fail here, loudly."""
    tree_keys = np.array([image.key for image in images] + [""], dtype=object)
    for trajectory, path in zip(own, paths, strict=True):
        wrong = np.flatnonzero(input_ids[path] != trajectory.input_ids)
        keys = tree_keys[image_id[path]]  # index -1 (text) reads the trailing ""
        if trajectory.images:
            expected = np.array([image.key for image in trajectory.images] + [""], dtype=object)
            wrong = np.union1d(wrong, np.flatnonzero(keys != expected[trajectory.image_index]))
        elif np.any(image_id[path] >= 0):
            wrong = np.union1d(wrong, np.flatnonzero(image_id[path] >= 0))
        if wrong.size:
            raise AssertionError(
                f"{trajectory.where}: the tree holds other tokens than the trajectory at token {int(wrong[0])} "
                "(a trie that merged different images or ids); the trie must key images by identity"
            )


def _rope_on_tree(own, paths, n: int) -> np.ndarray:
    """``[3, n]``: each trajectory's rotary positions laid out on its path, checked to agree wherever
    paths share a token (they depend on the prefix only, so a disagreement is a wrong rule or input).
    A trajectory with images whose positions are not attached yet gets ``-1`` (see ``PackedRow.tensors``)."""
    rope = np.zeros((3, n), dtype=np.int64)
    seen = np.zeros(n, dtype=bool)
    for trajectory, path in zip(own, paths, strict=True):
        positions = trajectory.rope_positions
        if positions is None and trajectory.images:  # not attached yet: counts and stats need no positions,
            positions = np.full((3, len(trajectory)), -1, dtype=np.int64)  # a forward refuses them (PackedRow)
        if positions is None:
            positions = np.broadcast_to(np.arange(len(trajectory)), (3, len(trajectory)))
        shared = seen[path]
        differs = np.flatnonzero(shared & np.any(rope[:, path] != positions, axis=0))
        if differs.size:
            token = int(differs[0])
            raise DataError(
                f"{trajectory.where}: rope positions {positions[:, token].tolist()} at token {token} differ from "
                f"{rope[:, path[token]].tolist()}, which another trajectory through the same tree token has; "
                "positions must depend on the prefix only"
            )
        rope[:, path] = positions
        seen[path] = True
    return rope


def _path(node: int, node_start: np.ndarray, node_end: np.ndarray, node_parent: np.ndarray) -> np.ndarray:
    chain = []
    while node >= 0:
        chain.append(np.arange(node_start[node], node_end[node]))
        node = node_parent[node]
    return np.concatenate(chain[::-1])


def build_trees(trajectories: Sequence[Trajectory]) -> list[TokenTree]:
    """Trie of ``trajectories``: one tree per distinct first token (usually exactly one). Image
    tokens are compared by their image's identity (:func:`~ds_tree.trees.images.trie_keys`)."""
    if not trajectories:
        return []
    codes: dict[str, int] = {}
    keys = [trie_keys(t.input_ids, t.image_index, t.images, codes) for t in trajectories]
    return [_serialise(root, trajectories) for root in _build_nodes(keys)]


def build_forest(trajectories: Sequence[Trajectory], merge: str = "group") -> list[TokenTree]:
    """Trees for a list of trajectories.

    ``merge="group"``: one trie per ``group_id`` (the default); ``"global"``: one trie over
    everything; ``"none"``: every trajectory its own single-path tree (the flat baseline).
    Trees come out in order of their first trajectory.
    """
    if merge == "none":
        return [tree for trajectory in trajectories for tree in build_trees([trajectory])]
    if merge == "global":
        return build_trees(trajectories)
    if merge != "group":
        raise ValueError(f"merge must be 'group', 'global' or 'none', got {merge!r}")
    return [tree for members in group_trajectories(trajectories) for tree in build_trees(members)]
