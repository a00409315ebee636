"""Trajectories and the exact-token prefix trees built from them."""

from ds_tree.trees.trajectory import Trajectory, check_vocab
from ds_tree.trees.trie import TokenTree, build_forest, build_trees

__all__ = ["TokenTree", "Trajectory", "build_forest", "build_trees", "check_vocab"]
