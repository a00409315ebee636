"""Preference pairs on token trees (``objective.kind: dpo``; docs/RL.md, "DPO").

``siblings`` (as TreeCUA-DPO pairs the branches of exploration trees, arXiv 2602.09662): at every branch
point of a tree, the trajectories that leave it, each ending in its own child node (the branch right after
the fork), are compared two by two, and every two with different rewards make a pair, the higher reward
chosen. A trajectory that goes on below its child (a later turn branches again) is not a sibling of that
fork's others; one without a reward is in no pair; identical trajectories end in one node and are never a
pair. A preference record converted by ``ds-tree convert --format preference`` is a tree of its prompt and two
sibling leaves (chosen: reward 1, rejected: 0), so its pair is exactly the record's.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import TokenTree, build_forest

PAIRINGS = ("siblings",)
"""Where pairs come from (``objective.dpo.pairs``)."""


def sibling_pairs(tree: TokenTree) -> list[tuple[int, int]]:
    """``(chosen, rejected)`` indices into ``tree.trajectories`` of every sibling pair (module docstring), by
    fork in pre-order, then by trajectory order."""
    by_fork: dict[int, list[int]] = {}
    for index, node in enumerate(tree.end_node):
        parent = int(tree.node_parent[node])
        if parent >= 0 and tree.trajectories[index].reward is not None:
            by_fork.setdefault(parent, []).append(index)
    pairs = []
    for fork in sorted(by_fork):
        for first, second in combinations(by_fork[fork], 2):
            a, b = tree.trajectories[first].reward, tree.trajectories[second].reward
            if tree.end_node[first] != tree.end_node[second] and a != b:
                pairs.append((first, second) if a > b else (second, first))
    return pairs


def preference_pairs(trajectories: Sequence[Trajectory], merge: str = "group") -> list[tuple[int, int]]:
    """``(chosen, rejected)`` positions in ``trajectories`` of every sibling pair of their trees (``merge``: as
    the trainer builds them); the same list on every rank for the same trajectories."""
    position = {id(t): i for i, t in enumerate(trajectories)}
    pairs = []
    for tree in build_forest(trajectories, merge=merge):
        own = tree.trajectories
        pairs.extend((position[id(own[c])], position[id(own[r])]) for c, r in sibling_pairs(tree))
    return pairs
