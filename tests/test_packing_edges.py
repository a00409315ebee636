"""Edges of the step plan: the per-token array table, parts spread over ranks (``rows_per_rank``)
and the groups each step trains on (``StepSampler``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree.data.sampler import StepSampler
from ds_tree.packing.balance import rows_per_rank
from ds_tree.packing.modes import make_parts
from ds_tree.packing.parts import whole_tree
from ds_tree.trees.token_arrays import TOKEN_FIELDS, ArrayKind, TokenArrays, concatenate_tokens, take_tokens
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_trees
from tests.helpers.strategies import forests, longest

SETTINGS = settings(max_examples=100, deadline=None)


def _tree():
    """Root [5 6], children [7] and [8 9]."""
    (tree,) = build_trees([Trajectory([5, 6, 7], [0, 1, 1]), Trajectory([5, 6, 8, 9], [0, 1, 0.5, 1])])
    return tree


def test_token_arrays_are_checked_and_cast():
    arrays = {name: np.zeros(3) for name in TOKEN_FIELDS}
    cast = TokenArrays(**arrays)
    assert all(getattr(cast, name).dtype == spec.dtype for name, spec in TOKEN_FIELDS.items())
    with pytest.raises(ValueError, match="'kv_end' has shape"):
        TokenArrays(**{**arrays, "kv_end": np.zeros(4)})
    with pytest.raises(ValueError, match="'input_ids' has shape"):
        TokenArrays(**{**arrays, "input_ids": np.zeros((3, 1))})


def test_take_tokens_follows_each_kind():
    """The chain [5 6] as a non-owned copy plus the subtree [8 9]: values copied, weights only on
    owned copies, pointers remapped, ends cut to the subset."""
    tree = _tree()
    taken = take_tokens(tree, np.array([0, 1, 3, 4]), np.array([False, False, True, True]))
    np.testing.assert_array_equal(taken["input_ids"], [5, 6, 8, 9])
    np.testing.assert_array_equal(taken["position_ids"], [0, 1, 2, 3])
    np.testing.assert_array_equal(taken["pred_pos"], [-1, 0, 1, 2])
    np.testing.assert_array_equal(taken["kv_end"], [4, 4, 4, 4])
    np.testing.assert_array_equal(taken["owned"], [False, False, True, True])
    np.testing.assert_array_equal(taken["mask_sum"], [0, 0, 0.5, 1])
    with pytest.raises(ValueError, match="strictly increasing"):
        take_tokens(tree, np.array([0, 3, 1]), np.ones(3, dtype=bool))
    with pytest.raises(AssertionError, match="pred_pos: a token points at a token the subset lacks"):
        take_tokens(tree, np.array([0, 3, 4]), np.ones(3, dtype=bool))


def test_concatenate_tokens_shifts_indices_and_pads_by_kind():
    part = whole_tree(_tree())
    joined = concatenate_tokens([part, part], 2, {"input_ids": 1})
    np.testing.assert_array_equal(joined["kv_end"], [5, 5, 3, 5, 5, 10, 10, 8, 10, 10, 11, 12])
    np.testing.assert_array_equal(joined["pred_pos"], [-1, 0, 1, 1, 3, -1, 5, 6, 6, 8, -1, -1])
    np.testing.assert_array_equal(joined["input_ids"][-3:], [9, 1, 1])
    for name, spec in TOKEN_FIELDS.items():
        assert joined[name].dtype == spec.dtype and joined[name].size == 12, name
        if spec.kind is ArrayKind.WEIGHT:
            assert not joined[name][-2:].any(), name
    with pytest.raises(ValueError, match="only name VALUE fields"):
        concatenate_tokens([part], 1, {"kv_end": 0})


@SETTINGS
@given(forests(), st.data())
def test_rows_per_rank_places_every_part_once_on_equal_row_counts(trajectories, data):
    world_size = data.draw(st.integers(1, 6), "world_size")
    budget = data.draw(st.integers(longest(trajectories), max(longest(trajectories), 200)), "budget")
    block = data.draw(st.sampled_from([1, 4, 16]), "block")
    cost_per_pair = data.draw(st.sampled_from([0.0, 0.01, 1.0]), "cost_per_pair")
    parts = make_parts(trajectories, data.draw(st.sampled_from(["tree", "flat"]), "mode"), budget)
    ranks = rows_per_rank(parts, world_size, budget, block, cost_per_pair=cost_per_pair, pad_id=2)

    assert len(ranks) == world_size
    assert len({len(rows) for rows in ranks}) == 1, "every rank runs the same number of micro-batches"
    placed = [id(part) for rows in ranks for row in rows for part in row.parts]
    assert sorted(placed) == sorted(map(id, parts)), "every part on exactly one rank, in one row, once"
    for row in (row for rows in ranks for row in rows if row.parts):
        assert row.n_real == sum(part.n_tokens for part in row.parts) <= budget, "budget respected"
        assert row.n_tokens % block == 0 and row.n_tokens - row.n_real < block
    empty = [rows for rows in ranks if not any(row.parts for row in rows)]
    assert len(empty) >= world_size - len(parts), "a rank without parts when there are fewer parts than ranks"
    for rows in ranks:  # shares are padded with empty rows that cost one block and weigh nothing
        for row in (row for row in rows if not row.parts):
            assert row.n_real == 0 and row.n_tokens == block
            np.testing.assert_array_equal(row.input_ids, 2)
            np.testing.assert_array_equal(row.kv_end, np.arange(1, block + 1))
            np.testing.assert_array_equal(row.pred_pos, -1)
            assert not row.mask_sum.any() and not row.seq_mean_sum.any() and not row.mask_max.any()


def test_rows_per_rank_without_parts_gives_every_rank_one_empty_row():
    ranks = rows_per_rank([], world_size=3, budget=8, block=4)
    assert [len(rows) for rows in ranks] == [1, 1, 1]
    assert all(rows[0].n_real == 0 and rows[0].n_tokens == 4 and not rows[0].parts for rows in ranks)


@given(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_step_sampler_covers_every_group_once_per_epoch(n_groups, groups_per_step, seed):
    sampler = StepSampler(n_groups, groups_per_step, seed)
    epochs = 3
    steps = -(-epochs * n_groups // groups_per_step)
    sequence = [group for step in range(steps) for group in sampler.groups_for_step(step)]
    assert all(len(sampler.groups_for_step(step)) == groups_per_step for step in range(steps))
    for epoch in range(epochs):  # steps that straddle an epoch end finish one epoch and start the next
        assert sorted(sequence[epoch * n_groups : (epoch + 1) * n_groups]) == list(range(n_groups))
    assert sampler.epoch_of_step(steps) == steps * groups_per_step / n_groups


@given(st.integers(2, 30), st.integers(1, 12), st.integers(0, 2**32 - 1), st.integers(0, 50))
@settings(max_examples=200, deadline=None)
def test_step_sampler_is_a_function_of_seed_and_step(n_groups, groups_per_step, seed, step):
    """A resumed run (a fresh sampler asked for step ``step`` first) sees what an uninterrupted one saw."""
    running = StepSampler(n_groups, groups_per_step, seed)
    history = [running.groups_for_step(s) for s in range(step + 1)]
    resumed = StepSampler(n_groups, groups_per_step, seed)
    assert resumed.groups_for_step(step) == history[step]


def test_step_sampler_shuffles_by_seed_and_epoch():
    first = StepSampler(20, 20, seed=1)
    assert first.groups_for_step(0) != first.groups_for_step(1), "each epoch has its own order"
    assert first.groups_for_step(0) != StepSampler(20, 20, seed=2).groups_for_step(0), "the seed changes the order"
    assert first.groups_for_step(0) != list(range(20))
