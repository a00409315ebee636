"""Hypothesis strategies and plain helpers for tree-shaped test data.

A forest is a list of :class:`Trajectory` in several groups. Each group's token sequences come
from the library's random tree generator (:mod:`ds_tree.trees.random_trees`), with its shape
parameters and its random source drawn by hypothesis (``st.randoms()``, so failures shrink): forks
at any depth, 1-token nodes, long chains, strict prefixes (a cut inside a node splits it),
duplicates and several roots. A small alphabet makes accidental sharing likely (siblings and
roots that start alike merge in the trie, 1-token nodes appear); a large one keeps branches
distinct. Loss masks are all zeros, all ones, fractional or a mix.

Sizes stay small (``MAX_TOTAL_TOKENS`` flat tokens) so that model tests run in seconds.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ds_tree.trees.random_trees import TreeShape, random_token_paths
from ds_tree.trees.trajectory import Trajectory

VOCAB = 1024
"""Vocabulary of the tiny model configs (configs/models/tiny_*.json)."""
FIRST_ID = 3
"""Token ids start above pad/bos/eos (0/1/2) so no test depends on special ids."""
MAX_TOTAL_TOKENS = 300
MASK_KINDS = ("zeros", "ones", "fractional", "mixed")


@st.composite
def tree_shapes(draw) -> TreeShape:
    """Shapes from single short paths to bushy trees with long chains."""
    small = draw(st.booleans())
    low, high = draw(st.sampled_from([(1, 1), (1, 3), (1, 12), (2, 9), (20, 40)]))
    return TreeShape(
        trees=draw(st.integers(1, 3)),
        depth=draw(st.integers(1, 4)),
        children=(draw(st.integers(0, 1)), draw(st.integers(1, 3))),
        node_tokens=(low, high),
        alphabet=(FIRST_ID, FIRST_ID + 3) if small else (FIRST_ID, VOCAB - 1),
        prefixes=draw(st.sampled_from([0.0, 0.3, 1.0])),
        duplicates=draw(st.sampled_from([0.0, 0.3])),
    )


@st.composite
def token_groups(draw, max_trajectories: int = 6) -> list[list[int]]:
    """Token sequences of one group (at most ``max_trajectories``), with real prefix sharing."""
    rng = draw(st.randoms(use_true_random=False))
    paths = random_token_paths(rng, draw(tree_shapes()))
    return rng.sample(paths, min(len(paths), max_trajectories))


@st.composite
def loss_masks(draw, length: int) -> np.ndarray:
    kind = draw(st.sampled_from(MASK_KINDS))
    if kind == "zeros":
        return np.zeros(length)
    if kind == "ones":
        return np.ones(length)
    if kind == "fractional":
        values = st.floats(0.05, 2.0, allow_nan=False, allow_infinity=False)
    else:
        # No subnormal coefficients (below 2.2e-308): they carry fewer than 52 significant bits, so no
        # float64 computation on them, flat or tree, holds the 1e-12 relative accuracy the tests check.
        fraction = st.floats(0.0, 2.0, allow_nan=False, allow_infinity=False, allow_subnormal=False)
        values = st.one_of(st.just(0.0), st.just(1.0), fraction)
    return np.array(draw(st.lists(values, min_size=length, max_size=length)), dtype=np.float64)


@st.composite
def forests(
    draw,
    max_groups: int = 4,
    max_trajectories: int = 6,
    max_total_tokens: int = MAX_TOTAL_TOKENS,
) -> list[Trajectory]:
    """Trajectories of 1..``max_groups`` groups, at most ``max_total_tokens`` flat tokens in all.

    Trajectories of a group are shuffled so that no test relies on input order.
    """
    trajectories: list[Trajectory] = []
    total = 0
    for group in range(draw(st.integers(1, max_groups))):
        sequences = draw(token_groups(max_trajectories))
        order = draw(st.permutations(range(len(sequences))))
        for index in order:
            ids = sequences[index]
            if trajectories and total + len(ids) > max_total_tokens:
                continue
            total += len(ids)
            mask = draw(loss_masks(len(ids)))
            trajectories.append(
                Trajectory(np.array(ids, dtype=np.int64), mask, group_id=f"g{group}", source=f"g{group}/t{index}")
            )
    return trajectories


# ------------------------------------------------------------------------ plain helpers


def prefix_key(trajectory: Trajectory, length: int) -> tuple:
    """Identity of a trie token: (group, the first ``length`` token ids)."""
    return (trajectory.group_id, tuple(trajectory.input_ids[:length].tolist()))


def distinct_prefixes(trajectories: list[Trajectory]) -> set[tuple]:
    """Every distinct (group, prefix) of the trajectories: the tokens a per-group trie must hold."""
    return {prefix_key(t, n) for t in trajectories for n in range(1, len(t) + 1)}


def longest(trajectories: list[Trajectory]) -> int:
    return max(len(t) for t in trajectories)


def flat_coefficients(trajectories: list[Trajectory], normalisation: str) -> list[np.ndarray]:
    """Per trajectory the flat baseline's loss coefficients c_{i,t} (c_{i,0} = 0: never predicted)."""
    masks = [np.concatenate([[0.0], t.loss_mask[1:]]) for t in trajectories]
    if normalisation == "sum":
        return masks
    if normalisation == "token_mean":
        total = sum(m.sum() for m in masks)
        return [m / total if total > 0 else m * 0 for m in masks]
    if normalisation == "sequence_mean":
        trained = [m.sum() for m in masks]
        n_seq = sum(s > 0 for s in trained)
        return [m / (s * n_seq) if s > 0 else m * 0 for m, s in zip(masks, trained, strict=True)]
    raise ValueError(normalisation)
