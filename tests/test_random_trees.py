"""The random tree generator behind the hypothesis forests and the kernel benchmark."""

import random

import pytest

from ds_tree.trees.random_trees import TreeShape, random_forest, random_token_paths
from ds_tree.trees.stats import token_counts
from tests.helpers.strategies import distinct_prefixes


@pytest.mark.parametrize("seed", range(10))
def test_every_path_has_depth_nodes_when_every_inner_node_has_children(seed):
    shape = TreeShape(trees=2, depth=3, children=(1, 3), node_tokens=(4, 5))
    paths = random_token_paths(random.Random(seed), shape)
    assert 2 <= len(paths) <= 2 * 3**2
    assert all(3 * 4 <= len(path) <= 3 * 5 for path in paths)  # two nodes would be 10 tokens at most
    assert all(shape.alphabet[0] <= token <= shape.alphabet[1] for path in paths for token in path)


@pytest.mark.parametrize("seed", range(10))
def test_prefixes_and_duplicates_follow_their_path(seed):
    shape = TreeShape(depth=2, children=(0, 3), node_tokens=(1, 4), prefixes=1.0, duplicates=1.0)
    paths = random_token_paths(random.Random(seed), shape)
    index = 0
    while index < len(paths):
        path = paths[index]
        extras = paths[index + 1 : index + 3] if len(path) > 1 else paths[index + 1 : index + 2]
        if len(path) > 1:
            prefix, duplicate = extras
            assert 1 <= len(prefix) < len(path) and path[: len(prefix)] == prefix
        else:
            (duplicate,) = extras
        assert duplicate == path
        index += 1 + len(extras)


def test_a_seed_gives_one_forest_and_its_trie_holds_every_distinct_prefix():
    shape = TreeShape(trees=3, depth=4, children=(0, 3), alphabet=(3, 6), prefixes=0.5, duplicates=0.5)
    forest, again = (random_forest(random.Random(7), shape) for _ in range(2))
    assert [t.input_ids.tolist() for t in forest] == [t.input_ids.tolist() for t in again]
    counts = token_counts(forest)
    assert counts.flat_tokens == sum(len(t) for t in forest)
    assert counts.tree_tokens == len(distinct_prefixes(forest))


@pytest.mark.parametrize(
    "fields", [{"children": (2, 1)}, {"node_tokens": (0, 3)}, {"depth": 0}, {"trees": 0}, {"alphabet": (-1, 5)}]
)
def test_bad_shapes_are_refused(fields):
    with pytest.raises(ValueError):
        TreeShape(**fields)
