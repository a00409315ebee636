"""Random token trees, the one generator behind the tree-shaped test data and the kernel benchmarks.

A tree grows node by node: a node is a run of random tokens, and a node above ``depth`` gets a
random number of children; every root-to-leaf path is one trajectory's tokens. Extras make the
cases a trie must get right: strict prefixes of paths (a cut inside a node splits it, a cut of
one token leaves a 1-token root) and exact duplicates. With a small alphabet, siblings and roots
often start with the same token, so the trie merges what the generator grew apart (the tree it
builds is not the one grown); with a large one branches stay distinct and the trie is the tree
grown. Randomness comes from a :class:`random.Random`, so hypothesis can drive it (and shrink it)
through ``st.randoms()``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from ds_tree.trees.trajectory import Trajectory


@dataclass(frozen=True)
class TreeShape:
    """What a random forest looks like; every range is inclusive."""

    trees: int = 1
    """Roots grown (a trie merges roots that start with the same token)."""
    depth: int = 4
    """Nodes on the longest root-to-leaf path."""
    children: tuple[int, int] = (0, 3)
    """Children of a node above ``depth``; a lower bound of 1 puts every leaf at ``depth``."""
    node_tokens: tuple[int, int] = (1, 8)
    """Tokens in one node."""
    alphabet: tuple[int, int] = (3, 1023)
    """Token ids (above pad/bos/eos by default, within a 1024-token vocabulary)."""
    prefixes: float = 0.0
    """Chance that a path also yields a strict prefix of itself (when it has one)."""
    duplicates: float = 0.0
    """Chance that a path yields a second, identical trajectory."""

    def __post_init__(self) -> None:
        for name in ("children", "node_tokens", "alphabet"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range 0 <= low <= high, got {(low, high)}")
        if self.trees < 1 or self.depth < 1 or self.node_tokens[0] < 1:
            raise ValueError("trees, depth and the smallest node must be at least 1")


def random_token_paths(rng: random.Random, shape: TreeShape) -> list[list[int]]:
    """Token ids of every trajectory of one random forest, in the order they were grown."""
    paths: list[list[int]] = []

    def grow(prefix: list[int], level: int) -> None:
        tokens = prefix + [rng.randint(*shape.alphabet) for _ in range(rng.randint(*shape.node_tokens))]
        count = rng.randint(*shape.children) if level < shape.depth else 0
        if count == 0:
            paths.append(tokens)
            if len(tokens) > 1 and rng.random() < shape.prefixes:
                paths.append(tokens[: rng.randint(1, len(tokens) - 1)])
            if rng.random() < shape.duplicates:
                paths.append(list(tokens))
        for _ in range(count):
            grow(tokens, level + 1)

    for _ in range(shape.trees):
        grow([], 1)
    return paths


def random_forest(rng: random.Random, shape: TreeShape, group_id: str = "g") -> list[Trajectory]:
    """The paths of :func:`random_token_paths` as trajectories of one group, every token trained."""
    return [
        Trajectory(np.array(ids), np.ones(len(ids)), group_id=group_id, source=f"{group_id}/path {index}")
        for index, ids in enumerate(random_token_paths(rng, shape))
    ]
