"""Tree parts: a whole tree, or a piece of a tree that carries its ancestor path.

A part is a list of token ranges of one :class:`~ds_tree.trees.trie.TokenTree` in its DFS order:
a chain of nodes from the root (context for what follows) and then whole child subtrees of the
chain's last node. Each range says whether the part *owns* its tokens: every token of a tree is
owned by exactly one part, which carries its loss weight; the other copies are weight-0 context
(docs/DESIGN.md section 3). Because every included subtree sits below the chain, no attention crosses
parts, and the part is itself a valid packed tree.

:func:`split_tree` cuts a tree larger than a token budget into such parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds_tree.errors import DataError
from ds_tree.packing.bins import first_fit_decreasing
from ds_tree.trees.token_arrays import TOKEN_FIELDS, TokenArrays, take_tokens
from ds_tree.trees.trie import TokenTree


@dataclass(kw_only=True)
class TreePart(TokenArrays):
    """A packed tree (or tree part), ready to be placed in a row. Indices are part-local."""

    tree: TokenTree
    token_index: np.ndarray
    """Indices into ``tree``'s token arrays, in part order."""
    trajectory_ids: list[int]
    """Trajectories of ``tree`` whose last node this part owns (so their whole path is here)."""
    paths: list[np.ndarray] = field(default_factory=list)
    """Part-local token indices of each trajectory in ``trajectory_ids``."""

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs the tree mask allows: each token sees its in-part ancestors."""
        return int((self.position_ids - self.position_ids[0] + 1).sum())


def make_part(tree: TokenTree, ranges: list[tuple[int, int, bool]]) -> TreePart:
    """Part made of ``(start, end, owned)`` token ranges of ``tree`` (chain first, then subtrees)."""
    token_index = np.concatenate([np.arange(start, end) for start, end, _ in ranges])
    owned = np.concatenate([np.full(end - start, own) for start, end, own in ranges])
    owned_in_tree = np.zeros(tree.n_tokens, dtype=bool)
    owned_in_tree[token_index[owned]] = True
    trajectory_ids = [i for i, node in enumerate(tree.end_node) if owned_in_tree[tree.node_start[node]]]
    return TreePart(
        **take_tokens(tree, token_index, owned),
        tree=tree,
        token_index=token_index,
        trajectory_ids=trajectory_ids,
        paths=[np.searchsorted(token_index, tree.paths[i]) for i in trajectory_ids],
    )


def whole_tree(tree: TokenTree) -> TreePart:
    """The whole tree as one part: ``make_part(tree, [(0, tree.n_tokens, True)])``, whose remapping is the
    identity here, so the tree's arrays and paths are copied as they are (most parts of a step are whole trees;
    their searches were a third of the step plan's time)."""
    return TreePart(
        **{name: getattr(tree, name).copy() for name in TOKEN_FIELDS},
        tree=tree,
        token_index=np.arange(tree.n_tokens),
        trajectory_ids=list(range(len(tree.end_node))),
        paths=[path.copy() for path in tree.paths],
    )


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
        fitting = [c for c in children[node] if subtree_size[c] <= room]
        bins = first_fit_decreasing([subtree_size[c] for c in fitting], room)
        large = [c for c in children[node] if subtree_size[c] > room]
        if not bins and not large:  # a leaf
            emit(chain, [])
        for members in bins:
            emit(chain, [fitting[i] for i in members])
        for child in large:
            visit(child, chain)

    visit(0, [])
    return parts
