"""How much a set of trees shares: token counts, prefix overlap ratio (POR) and tree shape.

Flat tokens are what training every trajectory as its own sequence computes; tree tokens are the
distinct tokens of the tries, what computing every shared prefix once computes. POR is
``1 - tree / flat`` and the ideal speedup ``flat / tree``: the most that tree packing can save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import TokenTree, build_forest


@dataclass(frozen=True)
class TokenCounts:
    flat_tokens: int
    """Tokens of all trajectories, each counted once per trajectory through it."""
    tree_tokens: int
    """Distinct tokens of the trees (each shared prefix counted once)."""

    @property
    def por(self) -> float:
        return 1.0 - self.tree_tokens / self.flat_tokens

    @property
    def ideal_speedup(self) -> float:
        return self.flat_tokens / self.tree_tokens

    def as_dict(self) -> dict:
        return {
            "flat_tokens": self.flat_tokens,
            "tree_tokens": self.tree_tokens,
            "por": self.por,
            "ideal_speedup": self.ideal_speedup,
        }


def token_counts(trees: Sequence[TokenTree] | Sequence[Trajectory], merge: str = "group") -> TokenCounts:
    """Flat and tree tokens of ``trees``; trajectories are first built into trees with ``merge``."""
    if trees and isinstance(trees[0], Trajectory):
        trees = build_forest(trees, merge=merge)
    return TokenCounts(
        flat_tokens=sum(tree.flat_tokens for tree in trees),
        tree_tokens=sum(tree.n_tokens for tree in trees),
    )


def _summary(values: np.ndarray) -> dict:
    return {
        "min": float(values.min()),
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "max": float(values.max()),
    }


def tree_arrays(trees: Sequence[TokenTree]) -> dict[str, np.ndarray]:
    """Per-path depths, per-internal-node child counts and per-tree ideal speedups."""
    depths, branching = [], []
    for tree in trees:
        depths.append(tree.node_depths()[tree.end_node])
        children = tree.num_children()
        branching.append(children[children > 0])
    return {
        "depth": np.concatenate(depths),
        "branching": np.concatenate(branching) if branching else np.zeros(0, dtype=np.int64),
        "tree_speedup": np.array([token_counts([tree]).ideal_speedup for tree in trees]),
    }


def image_counts(trees: Sequence[TokenTree]) -> dict | None:
    """What the vision tower encodes, flat (each trajectory's distinct images) against tree (each
    tree's), in images and patches (its sequence length: t x h x w); None without images."""
    patches = lambda image: int(np.prod(image.grid_thw))  # noqa: E731
    flat = [image for tree in trees for t in tree.trajectories for image in {i.key: i for i in t.images}.values()]
    tree_images = [image for tree in trees for image in tree.images]
    if not flat:
        return None
    flat_patches, tree_patches = sum(map(patches, flat)), sum(map(patches, tree_images))
    return {
        "images_flat": len(flat),
        "images_tree": len(tree_images),
        "patches_flat": flat_patches,
        "patches_tree": tree_patches,
        "patches_saved": 1.0 - tree_patches / flat_patches,
    }


def tree_stats(trees: Sequence[TokenTree]) -> dict:
    """Counts, token counts, depth (nodes on a root-to-leaf path), branching (children per internal
    node), per-tree ideal speedups and, with images, :func:`image_counts`, as a JSON-ready dict."""
    arrays = tree_arrays(trees)
    branching = arrays["branching"]
    return {
        "n_groups": len({trajectory.group_id for tree in trees for trajectory in tree.trajectories}),
        "n_trees": len(trees),
        "n_trajectories": sum(len(tree.trajectories) for tree in trees),
        **token_counts(trees).as_dict(),
        "depth": _summary(arrays["depth"]),
        # A forest of single paths has no internal node: no branching to summarise.
        "branching": {"mean": float(branching.mean()), "max": int(branching.max())} if branching.size else None,
        "tree_speedup": _summary(arrays["tree_speedup"]),
        **({"images": images} if (images := image_counts(trees)) else {}),
    }
