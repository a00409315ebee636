"""Tree parts: a whole tree, or a piece of a tree that carries its ancestor path.

A part is a list of token ranges of one :class:`~ds_tree.trees.trie.TokenTree` in its DFS order:
a chain of nodes from the root (context for what follows) and then whole child subtrees of the
chain's last node. Each range says whether the part *owns* its tokens: every token of a tree is
owned by exactly one part, which carries its loss weight; the other copies are weight-0 context
(DESIGN section 3). Because every included subtree sits below the chain, no attention crosses
parts, and the part is itself a valid packed tree.

:func:`split_tree` cuts a tree larger than a token budget into such parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds_tree.errors import DataError
from ds_tree.trees.trie import TokenTree


@dataclass
class TreePart:
    """A packed tree (or tree part), ready to be placed in a row. Indices are part-local."""

    tree: TokenTree
    token_index: np.ndarray
    """Indices into ``tree``'s token arrays, in part order."""
    input_ids: np.ndarray
    position_ids: np.ndarray
    kv_end: np.ndarray
    pred_pos: np.ndarray
    mask_sum: np.ndarray
    seq_mean_sum: np.ndarray
    mask_max: np.ndarray
    trajectory_ids: list[int]
    """Trajectories of ``tree`` whose last node this part owns (so their whole path is here)."""
    paths: list[np.ndarray] = field(default_factory=list)
    """Part-local token indices of each trajectory in ``trajectory_ids``."""

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs the tree mask allows: each token sees its in-part ancestors."""
        return int((self.position_ids - self.position_ids[0] + 1).sum())


def make_part(tree: TokenTree, ranges: list[tuple[int, int, bool]]) -> TreePart:
    """Part made of ``(start, end, owned)`` token ranges of ``tree`` (chain first, then subtrees)."""
    token_index = np.concatenate([np.arange(start, end) for start, end, _ in ranges])
    owned = np.concatenate([np.full(end - start, own) for start, end, own in ranges])
    to_part = np.full(tree.n_tokens, -1, dtype=np.int64)
    to_part[token_index] = np.arange(token_index.size)
    n = token_index.size

    # kv_end: a token's subtree either lies wholly inside the part (contiguous, so shift it by
    # where its range landed) or is cut by the part (a chain token), in which case the part's
    # tokens below it are all of what remains: the part's end.
    kv_end = np.empty(n, dtype=np.int64)
    offset = 0
    for start, end, _ in ranges:
        global_end = tree.kv_end[start:end]
        inside = global_end <= end
        kv_end[offset : offset + end - start] = np.where(inside, global_end - start + offset, n)
        offset += end - start
    predecessor = tree.pred_pos[token_index]
    pred_pos = np.where(predecessor >= 0, to_part[np.maximum(predecessor, 0)], -1)
    if np.any((predecessor >= 0) & (pred_pos < 0)):
        raise AssertionError("tree part lacks the ancestor of one of its tokens")

    owned_nodes = np.zeros(tree.n_nodes, dtype=bool)
    for node in range(tree.n_nodes):
        start = tree.node_start[node]
        owned_nodes[node] = to_part[start] >= 0 and owned[to_part[start]]
    trajectory_ids = [i for i, node in enumerate(tree.end_node) if owned_nodes[node]]
    return TreePart(
        tree=tree,
        token_index=token_index,
        input_ids=tree.input_ids[token_index],
        position_ids=tree.position_ids[token_index],
        kv_end=kv_end,
        pred_pos=pred_pos,
        mask_sum=np.where(owned, tree.mask_sum[token_index], 0.0),
        seq_mean_sum=np.where(owned, tree.seq_mean_sum[token_index], 0.0),
        mask_max=np.where(owned, tree.mask_max[token_index], 0.0),
        trajectory_ids=trajectory_ids,
        paths=[to_part[tree.paths[i]] for i in trajectory_ids],
    )


def whole_tree(tree: TokenTree) -> TreePart:
    return make_part(tree, [(0, tree.n_tokens, True)])


def _describe(trajectory, index: int) -> str:
    return trajectory.source or f"trajectory {index} of group {trajectory.group_id!r}"


def check_fits(tree: TokenTree, budget: int) -> None:
    """Every root-to-leaf path must fit the budget: paths are never cut."""
    for index, trajectory in enumerate(tree.trajectories):
        if len(trajectory) > budget:
            raise DataError(
                f"{_describe(trajectory, index)}: trajectory of {len(trajectory)} tokens is longer "
                f"than the token budget {budget}; raise the budget or shorten the trajectory"
            )


def split_tree(tree: TokenTree, budget: int) -> list[TreePart]:
    """Cut ``tree`` into parts of at most ``budget`` tokens, each carrying its ancestor path.

    Greedy from the root: a node's child subtrees that fit beside the node's ancestor chain are
    grouped first-fit-decreasing into parts of that chain; a child subtree too large even alone
    recurses with the node appended to its chain. Each node is owned by the first part that
    includes it, so every token's weight is counted once.
    """
    check_fits(tree, budget)
    if tree.n_tokens <= budget:
        return [whole_tree(tree)]
    children: list[list[int]] = [[] for _ in range(tree.n_nodes)]
    for node in range(1, tree.n_nodes):
        children[tree.node_parent[node]].append(node)
    subtree_size = tree.subtree_end - tree.node_start
    parts: list[TreePart] = []

    def emit(chain: list[list], subtrees: list[int]) -> None:
        ranges = [(tree.node_start[node], tree.node_end[node], owned) for node, owned in chain]
        ranges += [(tree.node_start[c], tree.subtree_end[c], True) for c in sorted(subtrees)]
        parts.append(make_part(tree, ranges))
        for entry in chain:
            entry[1] = False  # owned by the part just emitted

    def visit(node: int, chain: list[list]) -> None:
        chain = chain + [[node, True]]
        room = budget - sum(tree.node_end[n] - tree.node_start[n] for n, _ in chain)
        fitting = sorted((c for c in children[node] if subtree_size[c] <= room), key=lambda c: -subtree_size[c])
        bins: list[tuple[int, list[int]]] = []
        for child in fitting:
            for position, (used, members) in enumerate(bins):
                if used + subtree_size[child] <= room:
                    bins[position] = (used + subtree_size[child], members + [child])
                    break
            else:
                bins.append((subtree_size[child], [child]))
        large = [c for c in children[node] if subtree_size[c] > room]
        if not bins and not large:  # a leaf
            emit(chain, [])
        for _, members in bins:
            emit(chain, members)
        for child in large:
            visit(child, chain)

    visit(0, [])
    return parts
