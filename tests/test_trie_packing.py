"""Trie, tree parts and packed rows against a brute-force oracle built from the trajectories alone.

The oracle never reads ``kv_end``, ``pred_pos`` or the weights it checks: it maps every packed
token to the (group, token prefix) it stands for, through the trajectories' paths, and derives
ancestry, targets and weights from those prefixes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree.attention.reference import visibility_mask
from ds_tree.errors import DataError
from ds_tree.packing.bins import first_fit_decreasing
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.parts import make_part, split_tree, whole_tree
from ds_tree.packing.rows import assemble_row
from ds_tree.trees.random_trees import TreeShape, random_token_paths
from ds_tree.trees.token_arrays import TOKEN_FIELDS
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import _sort_key, build_forest
from tests.helpers.strategies import distinct_prefixes, forests, longest, prefix_key

SETTINGS = settings(max_examples=150, deadline=None)


# ------------------------------------------------------------------------------- oracle


def token_keys(n_tokens: int, trajectories: list[Trajectory], paths: list[np.ndarray]) -> list[tuple]:
    """(group, prefix) of every token, from where each trajectory's tokens were placed.

    Asserts that the paths agree: a token reached by several trajectories stands for one prefix.
    """
    keys: list[tuple | None] = [None] * n_tokens
    for trajectory, path in zip(trajectories, paths, strict=True):
        assert len(path) == len(trajectory)
        for depth, index in enumerate(path.tolist()):
            key = prefix_key(trajectory, depth + 1)
            assert keys[index] in (None, key), f"token {index} stands for two prefixes"
            keys[index] = key
    return keys


def is_ancestor_or_self(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and len(a[1]) <= len(b[1]) and b[1][: len(a[1])] == a[1]


def ancestry(keys: list[tuple | None], copies: list[int] | None = None) -> np.ndarray:
    """``[q, k]``: key token k is an ancestor-or-self of query token q (None: sees only itself).

    ``copies[k]`` tells tokens with equal keys apart when several parts of one tree share a row.
    """
    n = len(keys)
    copies = copies or [0] * n
    out = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for k in range(n):
            if keys[q] is None or keys[k] is None:
                out[q, k] = q == k
            else:
                out[q, k] = copies[q] == copies[k] and is_ancestor_or_self(keys[k], keys[q])
    return out


def brute_weights(trajectories: list[Trajectory], keys: list[tuple]) -> dict[str, np.ndarray]:
    """mask_sum / seq_mean_sum / mask_max of every token, from the trajectories through it."""
    through: dict[tuple, list[tuple[Trajectory, int]]] = {}
    for trajectory in trajectories:
        for depth in range(len(trajectory)):
            through.setdefault(prefix_key(trajectory, depth + 1), []).append((trajectory, depth))
    out = {name: np.zeros(len(keys)) for name in ("mask_sum", "seq_mean_sum", "mask_max")}
    for index, key in enumerate(keys):
        for trajectory, depth in through[key]:
            if depth == 0:
                continue  # the first token is never predicted
            coefficient = trajectory.loss_mask[depth]
            trained = trajectory.loss_mask[1:].sum()
            out["mask_sum"][index] += coefficient
            out["seq_mean_sum"][index] += coefficient / trained if trained > 0 else 0.0
            out["mask_max"][index] = max(out["mask_max"][index], coefficient)
    return out


def check_layout(input_ids, position_ids, kv_end, pred_pos, keys, copies=None) -> None:
    """A packed layout against the keys its tokens stand for."""
    n = len(keys)
    for index, key in enumerate(keys):
        if key is None:
            continue
        assert input_ids[index] == key[1][-1]
        assert position_ids[index] == len(key[1]) - 1
    expected = ancestry(keys, copies)
    mask = visibility_mask(torch.as_tensor(np.asarray(kv_end))[None])[0].numpy()
    bad = np.argwhere(mask != expected)
    assert bad.size == 0, f"visibility differs from trie ancestry at (query, key) {bad[:5].tolist()}"
    for index, key in enumerate(keys):
        if key is None or len(key[1]) == 1:
            assert pred_pos[index] == -1, f"token {index} has no predecessor but pred_pos {pred_pos[index]}"
            continue
        parent = pred_pos[index]
        assert 0 <= parent < n
        assert keys[parent] == (key[0], key[1][:-1]), f"pred_pos of token {index} is not its parent token"
        if copies is not None:
            assert copies[parent] == copies[index]


# -------------------------------------------------------------------------------- tests


@SETTINGS
@given(forests())
def test_trie_matches_brute_force(trajectories):
    trees = build_forest(trajectories)
    members = [t for tree in trees for t in tree.trajectories]
    assert sorted(map(id, members)) == sorted(map(id, trajectories)), "every trajectory in exactly one tree"

    expected_prefixes = distinct_prefixes(trajectories)
    assert sum(tree.n_tokens for tree in trees) == len(expected_prefixes)
    first_tokens = {(t.group_id, int(t.input_ids[0])) for t in trajectories}
    assert len(trees) == len(first_tokens), "one tree per (group, first token)"

    seen = set()
    for tree in trees:
        for trajectory, path in zip(tree.trajectories, tree.paths, strict=True):
            np.testing.assert_array_equal(tree.input_ids[path], trajectory.input_ids)
            np.testing.assert_array_equal(tree.position_ids[path], np.arange(len(trajectory)))
            assert np.all(np.diff(path) > 0), "ancestors precede descendants (pre-order)"
        keys = token_keys(tree.n_tokens, tree.trajectories, tree.paths)
        assert None not in keys, "a tree token that no trajectory passes through"
        assert len(set(keys)) == tree.n_tokens, "two tokens of one tree stand for the same prefix"
        seen.update(keys)
        check_layout(tree.input_ids, tree.position_ids, tree.kv_end, tree.pred_pos, keys)
        for name, values in brute_weights(tree.trajectories, keys).items():
            np.testing.assert_allclose(getattr(tree, name), values, rtol=1e-13, atol=1e-15, err_msg=name)
    assert seen == expected_prefixes


@SETTINGS
@given(forests(), st.data())
def test_split_tree_parts(trajectories, data):
    for tree in build_forest(trajectories):
        budget = data.draw(st.integers(tree.max_path_tokens, max(tree.max_path_tokens, tree.n_tokens)), "budget")
        parts = split_tree(tree, budget)
        keys = token_keys(tree.n_tokens, tree.trajectories, tree.paths)
        owners = [[] for _ in range(len(tree.trajectories))]
        covered = np.zeros(tree.n_tokens, dtype=bool)
        sums = {name: np.zeros(tree.n_tokens) for name in ("mask_sum", "seq_mean_sum", "mask_max")}
        for number, part in enumerate(parts):
            assert part.n_tokens <= budget
            index = part.token_index
            assert len(set(index.tolist())) == index.size, "a token twice in one part"
            covered[index] = True
            part_keys = [keys[i] for i in index]
            check_layout(part.input_ids, part.position_ids, part.kv_end, part.pred_pos, part_keys)
            for name in sums:
                np.add.at(sums[name], index, getattr(part, name))
            for trajectory_id, path in zip(part.trajectory_ids, part.paths, strict=True):
                owners[trajectory_id].append(number)
                np.testing.assert_array_equal(index[path], tree.paths[trajectory_id])
        assert covered.all(), "a tree token in no part"
        assert all(len(o) == 1 for o in owners), f"trajectory -> owning parts: {owners}"
        for name, total in sums.items():
            # each token's weight is carried by exactly one part: the sum over parts is the tree's
            np.testing.assert_array_equal(total, getattr(tree, name), err_msg=name)


@SETTINGS
@given(forests(), st.data())
def test_split_tree_owns_each_token_once(trajectories, data):
    """Exactly one copy of every tree token is owned; with all-ones masks every non-root token has
    weight, and the owned copy is the one that carries it."""
    trajectories = [Trajectory(t.input_ids, np.ones(len(t)), t.group_id, source=t.source) for t in trajectories]
    for tree in build_forest(trajectories):
        assert tree.owned.all()
        budget = data.draw(st.integers(tree.max_path_tokens, max(tree.max_path_tokens, tree.n_tokens)), "budget")
        owners = np.zeros(tree.n_tokens, dtype=np.int64)
        weighted_copies = np.zeros(tree.n_tokens, dtype=np.int64)
        for part in split_tree(tree, budget):
            np.add.at(owners, part.token_index, part.owned)
            np.add.at(weighted_copies, part.token_index, part.mask_sum > 0)
            assert not np.any(part.mask_sum[~part.owned]), "a copy that is not owned carries weight"
        assert np.all(owners == 1)
        weighted = tree.mask_sum > 0
        assert np.all(weighted_copies[weighted] == 1)
        assert weighted.sum() == tree.n_tokens - 1, "all tokens but the root's first carry weight"


@SETTINGS
@given(forests(), st.data(), st.sampled_from(["tree", "flat"]))
def test_packed_rows(trajectories, data, mode):
    budget = data.draw(st.integers(longest(trajectories), max(longest(trajectories), 320)), "budget")
    block = data.draw(st.sampled_from([1, 2, 7, 16, 64]), "block")
    rows = pack_trajectories(trajectories, mode, budget, block)
    found = []
    total_mask = 0.0
    for row in rows:
        assert row.n_tokens % block == 0 and row.n_tokens - row.n_real < block
        assert row.n_real <= budget
        keys: list[tuple | None] = [None] * row.n_tokens
        copies = [-1] * row.n_tokens
        offset = 0
        for number, part in enumerate(row.parts):
            part_keys = token_keys(part.tree.n_tokens, part.tree.trajectories, part.tree.paths)
            for local, tree_index in enumerate(part.token_index.tolist()):
                keys[offset + local] = part_keys[tree_index]
                copies[offset + local] = number
            offset += part.n_tokens
        assert offset == row.n_real
        check_layout(row.input_ids, row.position_ids, row.kv_end, row.pred_pos, keys, copies)
        padding = slice(row.n_real, row.n_tokens)
        np.testing.assert_array_equal(row.kv_end[padding], np.arange(row.n_real, row.n_tokens) + 1)
        for name in ("owned", "mask_sum", "seq_mean_sum", "mask_max"):
            assert np.all(getattr(row, name)[padding] == 0), f"padding weighs in {name}"
        total_mask += row.mask_sum.sum()
        for part, trajectory_id, path in row.trajectory_paths():
            trajectory = part.tree.trajectories[trajectory_id]
            found.append(id(trajectory))
            np.testing.assert_array_equal(row.input_ids[path], trajectory.input_ids)
            np.testing.assert_array_equal(row.position_ids[path], np.arange(len(trajectory)))
            np.testing.assert_array_equal(row.pred_pos[path[1:]], path[:-1])
            assert row.pred_pos[path[0]] == -1
    assert sorted(found) == sorted(map(id, trajectories)), "every trajectory in exactly one row, once"
    expected_mask = sum(t.loss_mask[1:].sum() for t in trajectories)
    assert total_mask == pytest.approx(expected_mask, rel=1e-12, abs=1e-12)
    packed = sum(row.n_real for row in rows)
    if mode == "flat":
        assert packed == sum(len(t) for t in trajectories)
    else:
        assert packed >= len(distinct_prefixes(trajectories))


@SETTINGS
@given(forests(max_groups=3))
def test_assembled_row_of_whole_trees(trajectories):
    """Several whole trees in one row: tree tokens only see their own tree, padding only itself."""
    trees = build_forest(trajectories)
    row = assemble_row([whole_tree(tree) for tree in trees], block=8, pad_id=0)
    mask = visibility_mask(torch.as_tensor(row.kv_end)[None])[0].numpy()
    starts = np.cumsum([0] + [tree.n_tokens for tree in trees])
    owner = np.searchsorted(starts, np.arange(row.n_tokens), side="right") - 1
    q, k = np.nonzero(mask)
    assert np.all(owner[q] == owner[k]), "attention crosses trees"
    pad_q = q >= row.n_real
    assert np.all(q[pad_q] == k[pad_q]) and np.all(mask[np.arange(row.n_real, row.n_tokens)].sum(1) == 1)
    assert not mask[:, row.n_real :][: row.n_real].any(), "a real token sees padding"


@SETTINGS
@given(st.lists(st.integers(1, 50), max_size=40), st.integers(50, 120))
def test_first_fit_decreasing(sizes, capacity):
    bins = first_fit_decreasing(sizes, capacity)
    items = sorted(i for members in bins for i in members)
    assert items == list(range(len(sizes))), "every item exactly once"
    totals = [sum(sizes[i] for i in members) for members in bins]
    assert all(total <= capacity for total in totals)
    assert all(members for members in bins), "no empty bin"
    # first fit: an item in a later bin did not fit any earlier one, so any two bins overflow together
    for a in range(len(bins)):
        for b in range(a + 1, len(bins)):
            assert totals[a] + min(sizes[i] for i in bins[b]) > capacity


def test_split_rejects_a_trajectory_longer_than_the_budget():
    long = Trajectory(np.arange(3, 13), np.ones(10), group_id="g", source="data.jsonl:7")
    short = Trajectory(np.arange(3, 6), np.ones(3), group_id="g", source="data.jsonl:8")
    (tree,) = build_forest([short, long])
    with pytest.raises(DataError, match=r"data\.jsonl:7.*10 tokens.*budget 9"):
        split_tree(tree, 9)
    with pytest.raises(DataError, match=r"data\.jsonl:7"):
        pack_trajectories([short, long], "flat", 9)


def test_small_hand_built_tree():
    """A hand-checked layout: root [5 6], children [7] and [8 9]; [5 6] is also a trajectory."""
    trajectories = [
        Trajectory([5, 6, 8, 9], [0, 1, 1, 1], "g"),
        Trajectory([5, 6], [0, 0.5], "g"),
        Trajectory([5, 6, 7], [0, 1, 2], "g"),
    ]
    (tree,) = build_forest(trajectories)
    np.testing.assert_array_equal(tree.input_ids, [5, 6, 7, 8, 9])
    np.testing.assert_array_equal(tree.position_ids, [0, 1, 2, 2, 3])
    np.testing.assert_array_equal(tree.kv_end, [5, 5, 3, 5, 5])
    np.testing.assert_array_equal(tree.pred_pos, [-1, 0, 1, 1, 3])
    np.testing.assert_allclose(tree.mask_sum, [0, 2.5, 2, 1, 1])
    np.testing.assert_allclose(tree.mask_max, [0, 1, 2, 1, 1])


def test_the_tries_sort_key_orders_as_the_token_lists_do():
    """Keys as bytes (sign bit flipped, big-endian) sort exactly as the lists of ids (image keys negative)."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        keys = [rng.integers(-4, 4, rng.integers(0, 6)).astype(np.int64) for _ in range(rng.integers(1, 9))]
        keys.append(np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max]))
        by_list = sorted(range(len(keys)), key=lambda i: keys[i].tolist())
        assert sorted(range(len(keys)), key=lambda i: _sort_key(keys[i])) == by_list


def test_a_whole_tree_part_is_the_identity_remapping():
    """``whole_tree`` copies the tree's arrays: what ``make_part`` over the whole tree computes by remapping."""
    rng = random.Random(3)
    for _ in range(20):
        shape = TreeShape(trees=2, depth=rng.randint(1, 4), children=(1, 3), node_tokens=(1, 9), alphabet=(3, 50))
        trajectories = [Trajectory(np.array(p), np.ones(len(p)), group_id="g") for p in random_token_paths(rng, shape)]
        for tree in build_forest(trajectories):
            fast, remapped = whole_tree(tree), make_part(tree, [(0, tree.n_tokens, True)])
            for name in TOKEN_FIELDS:
                assert getattr(fast, name).dtype == getattr(remapped, name).dtype
                assert np.array_equal(getattr(fast, name), getattr(remapped, name)), name
            assert fast.trajectory_ids == remapped.trajectory_ids
            assert all(np.array_equal(a, b) for a, b in zip(fast.paths, remapped.paths, strict=True))
