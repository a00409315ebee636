"""Advantage estimators: hand-computed values, a brute-force TreePO oracle, edge cases and errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree.errors import DataError
from ds_tree.losses.advantages import Estimator, estimate, estimator, grpo, rloo, sibling, tempo, treepo
from ds_tree.registries import ESTIMATORS
from ds_tree.trees.trajectory import Trajectory
from tests.helpers.strategies import forests


def trajectory(ids, reward, group="g", source=None) -> Trajectory:
    ids = np.asarray(ids)
    return Trajectory(ids, np.ones(ids.size), group_id=group, reward=reward, source=source or f"{group}/{ids.tolist()}")


def scalars(advantages) -> list[float]:
    """The per-trajectory value, after checking it fills every token."""
    for values in advantages.values:
        assert values.dtype == np.float64 and np.all(values == values[0])
    return [float(values[0]) for values in advantages.values]


def test_registry():
    assert set(ESTIMATORS) == {"grpo", "rloo", "treepo", "tempo", "sibling", "gae", "given"}
    for name, found in ESTIMATORS.items():  # the lazy entries name the module's Estimator objects
        assert isinstance(found, Estimator) and found.name == name, name


def test_a_registered_estimator_is_what_estimate_dispatches_to():
    """A project's estimator: one function, wrapped by ``@estimator`` and registered by name (no table of
    the module's own to edit); ``estimate`` finds it, and an unknown name lists the registered ones."""

    @ESTIMATORS.register("best_of_group")
    @estimator(normalise=None)
    def best_of_group(group, settings):
        best = group.rewards.max()
        return [np.full(len(t), float(r == best)) for t, r in zip(group.trajectories, group.rewards, strict=True)]

    try:
        batch = [trajectory([5, 6], 1.0), trajectory([5, 7], 3.0), trajectory([4], 2.0, "alone")]
        computed = estimate(batch, "best_of_group")
        assert best_of_group.name == "best_of_group"
        assert scalars(computed) == [0.0, 1.0, 0.0] and computed.singletons == 1  # alone: no baseline, 0
        with pytest.raises(ValueError, match="normalisation"):
            estimate(batch, "best_of_group", normalise=True)
    finally:
        ESTIMATORS.unregister("best_of_group")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'best_of_group'.*choose one of grpo, rloo"):
        estimate(batch, "best_of_group")


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


@pytest.mark.parametrize(
    ("name", "normalise"),
    [("grpo", False), ("grpo", True), ("rloo", False), ("treepo", True), ("tempo", True)],
)
def test_one_trajectory_group_gets_zero_and_is_counted(name, normalise):
    batch = [trajectory([5, 6], 1.0, "alone"), trajectory([5, 7], 1.0, "pair"), trajectory([5, 8], 0.0, "pair")]
    result = ESTIMATORS.get(name)(batch, normalise=normalise)
    assert result.singletons == 1
    assert scalars(result)[0] == 0.0 and scalars(result)[1] > 0 > scalars(result)[2]


@pytest.mark.parametrize(
    ("name", "normalise"),
    [
        ("grpo", False),
        ("grpo", True),
        ("rloo", False),
        ("treepo", False),
        ("treepo", True),
        ("tempo", True),
        ("sibling", False),
        ("sibling", True),
    ],
)
def test_equal_rewards_give_exactly_zero(name, normalise):
    """0.1 * 3 / 3 != 0.1 in floating point: a naive mean gives 1e-17 and, normalised, +-1 garbage."""
    batch = [trajectory([5, 6, k], 0.1) for k in (7, 8, 9)] + [trajectory([5, 7, 8], 0.1, "h")] * 2
    assert scalars(ESTIMATORS.get(name)(batch, normalise=normalise)) == [0.0] * 5


@pytest.mark.parametrize("name", ["grpo", "rloo", "treepo", "tempo", "sibling", "gae"])
def test_missing_reward_names_the_trajectory(name):
    batch = [trajectory([5, 6], 1.0), trajectory([5, 7], None, source="rollouts.jsonl:17")]
    with pytest.raises(DataError, match=r"rollouts\.jsonl:17: .*needs a finite reward"):
        ESTIMATORS.get(name)(batch)


def test_given_advantages():
    a, b = trajectory([5, 6, 7], None), trajectory([5, 8], None, source="x.jsonl:2")
    a.advantages, b.advantages = [0.5, -1.0, 2.0], np.array([3.0, -4.0])
    result = ESTIMATORS.get("given")([a, b])
    assert [v.tolist() for v in result.values] == [[0.5, -1.0, 2.0], [3.0, -4.0]] and result.singletons == 0
    b.advantages = [1.0]
    with pytest.raises(DataError, match=r"x\.jsonl:2: 1 advantages for 2 tokens"):
        ESTIMATORS.get("given")([a, b])
    del b.advantages
    with pytest.raises(DataError, match=r"x\.jsonl:2: .*needs per-token advantages"):
        ESTIMATORS.get("given")([a, b])


@pytest.mark.parametrize("name", ["rloo", "given"])
def test_no_normalisation_where_none_is_defined(name):
    with pytest.raises(ValueError, match="has no normalisation"):
        ESTIMATORS.get(name)([trajectory([5], 1.0)], normalise=True)


# ----------------------------------------------------------------------------------------- TEMPO


def test_tempo_by_hand():
    """Prompt [5, 6]; x and y share the branch [7] and then differ, z takes [10]. Rewards 1, 0, 1.

    GRPO (mean 2/3): a = 1/3, -2/3, 1/3. The root [5, 6] fans out (not gated: its TD would repeat a).
    V([7]) = mean(a_x, a_y) = -1/6; V([8]) = 1/3 and V([9]) = -2/3, so predicting 8 gets the TD
    1/3 + 1/6 = 1/2 and predicting 9 gets -2/3 + 1/6 = -1/2; every other token is GRPO's.
    """
    x, y, z = trajectory([5, 6, 7, 8], 1.0), trajectory([5, 6, 7, 9], 0.0), trajectory([5, 6, 10], 1.0)
    for coef in (1.0, 0.5):
        values = tempo([z, x, y], tempo_coef=coef).values
        np.testing.assert_allclose(values[0], [1 / 3] * 3, rtol=1e-15)
        np.testing.assert_allclose(values[1], [1 / 3] * 3 + [1 / 3 + coef / 2], rtol=1e-15)
        np.testing.assert_allclose(values[2], [-2 / 3] * 3 + [-2 / 3 - coef / 2], rtol=1e-15)
    std = np.std([1.0, 0.0, 1.0], ddof=1)  # normalised: every value in units of the group's reward std
    normalised = tempo([z, x, y], normalise=True).values
    np.testing.assert_allclose(normalised[1], np.array([1 / 3] * 3 + [1 / 3 + 1 / 2]) / std, rtol=1e-15)


def test_tempo_is_grpo_where_only_the_root_branches():
    """GRPO samples of one prompt that differ from their first completion token on: no gated branch."""
    rng = np.random.default_rng(3)
    batch = [trajectory([5, 6, 7, *rng.integers(10, 99, rng.integers(1, 6))], float(r)) for r in rng.normal(size=6)]
    for normalise in (False, True):
        for got, want in zip(
            tempo(batch, normalise=normalise).values, grpo(batch, normalise=normalise).values, strict=True
        ):
            np.testing.assert_array_equal(got, want)


def brute_tempo(group: list[Trajectory], coef: float) -> list[np.ndarray]:
    """TEMPO from its definition on token prefixes, with no trie: V(P) is the mean GRPO advantage of
    the trajectories starting with P; the TD applies where P has two or more distinct next tokens and
    is longer than the root node (the longest prefix every trajectory with the same first token shares,
    up to the shortest of them)."""
    rewards = np.array([t.reward for t in group])
    a = rewards - rewards.mean() if np.any(rewards != rewards[0]) else np.zeros(len(group))
    ids = [t.input_ids.tolist() for t in group]

    def through(prefix):
        return [j for j, u in enumerate(ids) if u[: len(prefix)] == prefix and len(u) >= len(prefix)]

    out = []
    for i, u in enumerate(ids):
        tree = [v for v in ids if v[0] == u[0]]
        root = min(len(v) for v in tree)
        while any(v[:root] != tree[0][:root] for v in tree):
            root -= 1
        values = np.full(len(u), a[i])
        for t in range(1, len(u)):
            prefix, after = u[:t], u[: t + 1]
            nexts = {ids[j][t] for j in through(prefix) if len(ids[j]) > t}
            if len(nexts) >= 2 and t > root:
                values[t] += coef * (np.mean(a[through(after)]) - np.mean(a[through(prefix)]))
        out.append(values)
    return out


@settings(max_examples=100, deadline=None)
@given(trajectories=forests(max_groups=3, max_trajectories=8), data=st.data())
def test_tempo_equals_its_definition_on_prefixes(trajectories, data):
    rewards = data.draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0]), min_size=len(trajectories)))
    coef = data.draw(st.sampled_from([1.0, 0.3]))
    for t, r in zip(trajectories, rewards, strict=False):
        t.reward = r
    result = tempo(trajectories, tempo_coef=coef)
    relative = grpo(trajectories).values
    by_group: dict[str, list[int]] = {}
    for position, t in enumerate(trajectories):
        by_group.setdefault(t.group_id, []).append(position)
    for positions in by_group.values():
        group = [trajectories[i] for i in positions]
        expected = brute_tempo(group, coef) if len(group) > 1 else [np.zeros(len(group[0]))]
        for i, want in zip(positions, expected, strict=True):
            np.testing.assert_allclose(result.values[i], want, rtol=1e-12, atol=1e-14)
            assert result.values[i][0] == relative[i][0]  # token 0 is never predicted: no TD there


def test_tempo_td_telescopes_to_leaf_minus_first_branch_value():
    """A three-level tree without trajectories ending inside others: sum_t TD = V(leaf) - V(root child)."""
    paths = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 10], [5, 6, 7, 11], [5, 6, 12, 13], [5, 6, 12, 14]]
    rewards = [1.0, 0.0, 0.5, 2.0, -1.0]
    batch = [trajectory(p, r) for p, r in zip(paths, rewards, strict=True)]
    a = np.array(rewards) - np.mean(rewards)
    first_branch_value = {7: a[:3].mean(), 12: a[3:].mean()}  # V of the root's child each path enters
    for k, values in enumerate(tempo(batch).values):
        td_sum = float((values - a[k]).sum())
        assert td_sum == pytest.approx(a[k] - first_branch_value[paths[k][2]], abs=1e-15)


def test_tempo_coefficient_zero_is_grpo_and_estimate_passes_it():
    x, y, z = trajectory([5, 6, 7, 8], 1.0), trajectory([5, 6, 7, 9], 0.0), trajectory([5, 6, 10], 1.0)
    for got, want in zip(estimate([x, y, z], "tempo", tempo_coef=0.0).values, grpo([x, y, z]).values, strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(estimate([x, y, z], "tempo").values[0], grpo([x, y, z]).values[0])


# --------------------------------------------------------------------------------------- Sibling-GRPO


def test_sibling_by_hand():
    """Prompt [1]; branches [2] (leaves [3]: 1, [4]: 0) and [5] (leaves [6]: 1, [7, 8]: 1).

    At the root: R([2]) = 1/2, R([5]) = 1, their mean 3/4: -1/4 and +1/4 along each branch until it forks.
    Below [2]: 1 and 0 against their mean 1/2: +-1/2. Below [5]: equal rewards, exactly 0. The prompt: 0.
    """
    batch = [trajectory([1, 2, 3], 1.0), trajectory([1, 2, 4], 0.0), trajectory([1, 5, 6], 1.0)]
    batch.append(trajectory([1, 5, 7, 8], 1.0))
    values = sibling(batch).values
    expected = [[0, -0.25, 0.5], [0, -0.25, -0.5], [0, 0.25, 0], [0, 0.25, 0, 0]]
    for got, want in zip(values, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    alone = sibling([*batch, trajectory([1, 9], 5.0, "alone")])
    assert alone.singletons == 1 and alone.values[-1].tolist() == [0.0, 0.0]  # no siblings to compare with
    normalised = sibling(batch, normalise=True).values  # each sibling set in units of its own values' std
    np.testing.assert_allclose(normalised[0], [0, -0.25 / np.std([0.5, 1], ddof=1), 0.5 / np.std([1, 0], ddof=1)])


@pytest.mark.parametrize("normalise", [False, True])
def test_sibling_is_grpo_where_only_the_root_branches(normalise):
    """GRPO samples of one prompt that differ from their first completion token on: one sibling set, the group."""
    rng = np.random.default_rng(5)
    batch = [
        trajectory([5, 6, int(k), *rng.integers(10, 99, rng.integers(0, 5))], float(r))
        for k, r in zip(rng.permutation(np.arange(20, 26)), rng.normal(size=6), strict=True)
    ]
    for got, want in zip(
        sibling(batch, normalise=normalise).values, grpo(batch, normalise=normalise).values, strict=True
    ):
        np.testing.assert_allclose(got[2:], want[2:], rtol=1e-14, atol=1e-15)
        assert got[0] == got[1] == 0.0  # the prompt: above every branch point


def brute_sibling(group: list[Trajectory], normalise: bool) -> list[np.ndarray]:
    """Sibling-GRPO from its definition on token prefixes, with no trie: a prefix Q (of any length, the empty one
    included) is a branch point when the trajectories starting with it continue with two or more distinct tokens;
    token t of u lies on the branch u[k] taken at the deepest branch point u[:k] with k <= t, and gets the mean
    reward of the trajectories starting with u[:k + 1] minus the mean over the distinct continuations x of Q of the
    mean reward of those starting with Q + [x] (over their sample std when normalising); 0 below no branch point."""
    ids = [t.input_ids.tolist() for t in group]
    rewards = np.array([t.reward for t in group])

    def mean_through(prefix):
        return rewards[[j for j, v in enumerate(ids) if v[: len(prefix)] == prefix and len(v) >= len(prefix)]].mean()

    out = []
    for u in ids:
        values = np.zeros(len(u))
        for t in range(len(u)):
            for k in range(t, -1, -1):
                nexts = sorted({v[k] for v in ids if v[:k] == u[:k] and len(v) > k})
                if len(nexts) >= 2:
                    siblings = np.array([mean_through(u[:k] + [x]) for x in nexts])
                    if np.any(siblings != siblings[0]):
                        centred = mean_through(u[: k + 1]) - siblings.mean()
                        values[t] = centred / siblings.std(ddof=1) if normalise else centred
                    break
        out.append(values)
    return out


@settings(max_examples=100, deadline=None)
@given(trajectories=forests(max_groups=3, max_trajectories=8), data=st.data())
def test_sibling_equals_its_definition_on_prefixes(trajectories, data):
    rewards = data.draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 3.0]), min_size=len(trajectories)))
    normalise = data.draw(st.booleans())
    for t, r in zip(trajectories, rewards, strict=False):
        t.reward = r
    result = sibling(trajectories, normalise=normalise)
    by_group: dict[str, list[int]] = {}
    for position, t in enumerate(trajectories):
        by_group.setdefault(t.group_id, []).append(position)
    for positions in by_group.values():
        group = [trajectories[i] for i in positions]
        expected = brute_sibling(group, normalise) if len(group) > 1 else [np.zeros(len(group[0]))]
        for i, want in zip(positions, expected, strict=True):
            np.testing.assert_allclose(result.values[i], want, rtol=1e-12, atol=1e-14)
