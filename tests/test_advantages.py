"""Advantage estimators: hand-computed values, a brute-force TreePO oracle, edge cases and errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree.errors import DataError
from ds_tree.losses.advantages import ESTIMATORS, grpo, rloo, treepo
from ds_tree.trees.trajectory import Trajectory
from tests.strategies import forests


def trajectory(ids, reward, group="g", source=None) -> Trajectory:
    ids = np.asarray(ids)
    return Trajectory(ids, np.ones(ids.size), group_id=group, reward=reward, source=source or f"{group}/{ids.tolist()}")


def scalars(advantages) -> list[float]:
    """The per-trajectory value, after checking it fills every token."""
    for values in advantages.values:
        assert values.dtype == np.float64 and np.all(values == values[0])
    return [float(values[0]) for values in advantages.values]


def test_registry():
    assert set(ESTIMATORS) == {"grpo", "rloo", "treepo", "given"}


def test_grpo_and_rloo_by_hand():
    group = [trajectory([5, 6], 1.0), trajectory([5, 7], 2.0), trajectory([5, 8, 9], 6.0)]
    other = [trajectory([3], 0.0, "h"), trajectory([4], 4.0, "h")]
    mixed = [group[0], other[0], group[1], other[1], group[2]]  # groups interleaved: input order is kept
    assert scalars(grpo(mixed)) == pytest.approx([-2, -2, -1, 2, 3], rel=1e-15)
    root7 = np.sqrt(7.0)  # sample std of (1, 2, 6): sqrt((4 + 1 + 9) / 2)
    root8 = np.sqrt(8.0)  # sample std of (0, 4)
    assert scalars(grpo(mixed, normalise=True)) == pytest.approx(
        [-2 / root7, -2 / root8, -1 / root7, 2 / root8, 3 / root7], rel=1e-15
    )
    # leave one out: 1 - (2 + 6) / 2, 2 - (1 + 6) / 2, 6 - (1 + 2) / 2; 0 - 4, 4 - 0
    assert scalars(rloo(mixed)) == pytest.approx([-3, -4, -1.5, 4, 4.5], rel=1e-15)
    assert [v.size for v in grpo(mixed).values] == [2, 1, 2, 1, 3]


def test_treepo_three_leaf_tree_by_hand():
    """Prompt [5, 6]; x and y share the branch [7], z takes [10].

    Sub-groups: the root {x, y, z} (mean 2/3) and the node [7] {x, y} (mean 1/2), so
    x = mean(1 - 2/3, 1 - 1/2) = 5/12, y = mean(0 - 2/3, 0 - 1/2) = -7/12, z = 1 - 2/3 = 1/3.
    """
    x, y, z = trajectory([5, 6, 7, 8], 1.0), trajectory([5, 6, 7, 9], 0.0), trajectory([5, 6, 10], 1.0)
    result = treepo([z, x, y])
    assert scalars(result) == pytest.approx([1 / 3, 5 / 12, -7 / 12], rel=1e-15)
    assert result.singletons == 0
    std = np.std([1 / 3, 5 / 12, -7 / 12], ddof=1)
    assert scalars(treepo([z, x, y], normalise=True)) == pytest.approx([1 / 3 / std, 5 / 12 / std, -7 / 12 / std])


def test_treepo_duplicates_prefixes_and_several_roots():
    # duplicates end at one node and are two leaves: sub-groups {d1, d2, p} and {d1, d2}
    d1, d2, p = trajectory([5, 6, 7], 1.0), trajectory([5, 6, 7], 0.0), trajectory([5, 6], 0.5)
    assert scalars(treepo([d1, d2, p])) == pytest.approx([(0.5 + 0.5) / 2, (-0.5 - 0.5) / 2, 0.0], abs=1e-15)
    # first tokens differ: two tries {a, b} and {c}, and the group itself is one more sub-group (mean 1)
    a, b, c = trajectory([5, 6], 1.0), trajectory([5, 7], 0.0), trajectory([8, 9], 2.0)
    assert scalars(treepo([a, b, c])) == pytest.approx([(0.5 + 0) / 2, (-0.5 - 1) / 2, 1.0], abs=1e-15)


def brute_treepo(group: list[Trajectory]) -> list[float]:
    """Sub-groups are the distinct sets "trajectories sharing this token prefix" and the group, if >= 2."""
    members = [frozenset(range(len(group)))]
    for t in group:
        for length in range(1, len(t) + 1):
            prefix = t.input_ids[:length].tolist()
            members.append(frozenset(j for j, u in enumerate(group) if u.input_ids[:length].tolist() == prefix))
    subgroups = {s for s in members if len(s) >= 2}
    out = []
    for i, t in enumerate(group):
        terms = [t.reward - np.mean([group[j].reward for j in s]) for s in subgroups if i in s]
        out.append(float(np.mean(terms)) if terms else 0.0)
    return out


@settings(max_examples=150, deadline=None)
@given(trajectories=forests(max_groups=3, max_trajectories=8), data=st.data())
def test_treepo_equals_brute_force_subgroups(trajectories, data):
    rewards = data.draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0]), min_size=len(trajectories)))
    for t, r in zip(trajectories, rewards, strict=False):
        t.reward = r
    result = treepo(trajectories)
    by_group: dict[str, list[int]] = {}
    for position, t in enumerate(trajectories):
        by_group.setdefault(t.group_id, []).append(position)
    expected = np.zeros(len(trajectories))
    for positions in by_group.values():
        expected[positions] = brute_treepo([trajectories[i] for i in positions])
    np.testing.assert_allclose(scalars(result), expected, rtol=1e-12, atol=1e-15)
    assert result.singletons == sum(len(p) == 1 for p in by_group.values())


@pytest.mark.parametrize(("name", "normalise"), [("grpo", False), ("grpo", True), ("rloo", False), ("treepo", True)])
def test_one_trajectory_group_gets_zero_and_is_counted(name, normalise):
    batch = [trajectory([5, 6], 1.0, "alone"), trajectory([5, 7], 1.0, "pair"), trajectory([5, 8], 0.0, "pair")]
    result = ESTIMATORS[name](batch, normalise=normalise)
    assert result.singletons == 1
    assert scalars(result)[0] == 0.0 and scalars(result)[1] > 0 > scalars(result)[2]


@pytest.mark.parametrize(
    ("name", "normalise"), [("grpo", False), ("grpo", True), ("rloo", False), ("treepo", False), ("treepo", True)]
)
def test_equal_rewards_give_exactly_zero(name, normalise):
    """0.1 * 3 / 3 != 0.1 in floating point: a naive mean gives 1e-17 and, normalised, +-1 garbage."""
    batch = [trajectory([5, 6, k], 0.1) for k in (7, 8, 9)] + [trajectory([5, 7, 8], 0.1, "h")] * 2
    assert scalars(ESTIMATORS[name](batch, normalise=normalise)) == [0.0] * 5


@pytest.mark.parametrize("name", ["grpo", "rloo", "treepo"])
def test_missing_reward_names_the_trajectory(name):
    batch = [trajectory([5, 6], 1.0), trajectory([5, 7], None, source="rollouts.jsonl:17")]
    with pytest.raises(DataError, match=r"rollouts\.jsonl:17: .*needs a finite reward"):
        ESTIMATORS[name](batch)


def test_given_advantages():
    a, b = trajectory([5, 6, 7], None), trajectory([5, 8], None, source="x.jsonl:2")
    a.advantages, b.advantages = [0.5, -1.0, 2.0], np.array([3.0, -4.0])
    result = ESTIMATORS["given"]([a, b])
    assert [v.tolist() for v in result.values] == [[0.5, -1.0, 2.0], [3.0, -4.0]] and result.singletons == 0
    b.advantages = [1.0]
    with pytest.raises(DataError, match=r"x\.jsonl:2: 1 advantages for 2 tokens"):
        ESTIMATORS["given"]([a, b])
    del b.advantages
    with pytest.raises(DataError, match=r"x\.jsonl:2: .*needs per-token advantages"):
        ESTIMATORS["given"]([a, b])


@pytest.mark.parametrize("name", ["rloo", "given"])
def test_no_normalisation_where_none_is_defined(name):
    with pytest.raises(ValueError, match="has no normalisation"):
        ESTIMATORS[name]([trajectory([5], 1.0)], normalise=True)
