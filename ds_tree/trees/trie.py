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
from dataclasses import dataclass

import numpy as np

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


def _build_nodes(trajectories: Sequence[Trajectory]) -> list[_Node]:
    """Root nodes of the trie (one per distinct first token), children in token order."""
    order = sorted(range(len(trajectories)), key=lambda i: trajectories[i].input_ids.tolist())
    top = _Node(0, 0, -1)  # virtual node above the roots, holds no tokens
    stack = [top]
    previous = None
    for index in order:
        ids = trajectories[index].input_ids
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
    return TokenTree(
        input_ids=input_ids,
        position_ids=position_ids,
        kv_end=kv_end,
        pred_pos=pred_pos,
        owned=np.ones(n, dtype=bool),
        **restoration_sums(own, paths, n),
        trajectories=own,
        node_start=node_start,
        node_end=node_end,
        node_parent=node_parent,
        subtree_end=subtree_end,
        end_node=end_node,
        paths=paths,
    )


def _path(node: int, node_start: np.ndarray, node_end: np.ndarray, node_parent: np.ndarray) -> np.ndarray:
    chain = []
    while node >= 0:
        chain.append(np.arange(node_start[node], node_end[node]))
        node = node_parent[node]
    return np.concatenate(chain[::-1])


def build_trees(trajectories: Sequence[Trajectory]) -> list[TokenTree]:
    """Trie of ``trajectories``: one tree per distinct first token (usually exactly one)."""
    if not trajectories:
        return []
    return [_serialise(root, trajectories) for root in _build_nodes(trajectories)]


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
