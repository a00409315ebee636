"""Advantage estimators: per-trajectory, per-token advantages for the RL objective (:mod:`ds_tree.losses.rl`).

Every estimator takes the trajectories of one optimizer step (any order, several groups) and
returns, for each trajectory in input order, a float64 array aligned with its ``input_ids``
(``values[i][t]`` is the advantage of predicting token ``t``; ``t = 0`` is never predicted and
carries a value only for alignment). A group is the trajectories that share a ``group_id``.

- ``grpo``  (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300): ``A_i = R_i - mean_G R``, divided
  by the group's sample standard deviation (ddof 1, as ``torch.std``) when ``normalise``; without
  the division it is Dr. GRPO's advantage (Liu et al. 2025, arXiv 2503.20783).
- ``rloo``  (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et
  al. 2024, arXiv 2402.14740): ``A_i = R_i - mean_{j != i} R_j``.
- ``treepo`` (Li et al. 2025, TreePO, arXiv 2508.17445): every node of the group's exact-token trie
  with two or more trajectories ending in its subtree is a sub-group (trajectories that share that
  prefix); ``A_i = mean over the sub-groups S containing i of (R_i - mean_S R)``. When a group's
  trajectories start with different tokens (several tries), the whole group is one more sub-group.
  With ``normalise`` the advantages are divided by their sample standard deviation over the batch
  (trajectories of groups of two or more; no re-centring, so a lone trajectory's 0 stays 0).
- ``given``: per-token advantages carried by the data (a trajectory's ``advantages`` array).

A trajectory alone in its group has no baseline: it gets advantage 0 and is counted in
``Advantages.singletons``, for the trainer to report. A group whose rewards are all equal gets
exactly 0 (no division by a zero or round-off standard deviation: the rewards' mean need not equal
them bit for bit). Estimators that need rewards raise :class:`~ds_tree.errors.DataError` naming
the first trajectory without one.

Trie sub-groups come from :func:`ds_tree.trees.trie.build_trees`, so flat trajectories and
explicit trees (expanded into trajectories, see :mod:`ds_tree.data.explicit`) are treated alike:
sub-groups are the shared token prefixes, whatever the node split a record gave. Duplicate
trajectories end at the same trie node and each counts as its own leaf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ds_tree.errors import DataError
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import TokenTree, build_trees


@dataclass
class Advantages:
    values: list[np.ndarray]
    """Per trajectory (input order) a float64 array as long as its ``input_ids``."""
    singletons: int
    """Trajectories that were alone in their group and got advantage 0."""
    trajectories: Sequence[Trajectory] = ()
    """The trajectories ``values`` belong to (set by :func:`estimate`)."""

    def by_trajectory(self) -> dict[int, np.ndarray]:
        """``id(trajectory) -> its per-token advantages``, as the RL rows look them up."""
        return {id(t): a for t, a in zip(self.trajectories, self.values, strict=True)}


def _describe(trajectory: Trajectory) -> str:
    return trajectory.source or f"a trajectory of group {trajectory.group_id!r}"


def _rewards(trajectories: Sequence[Trajectory], estimator: str) -> np.ndarray:
    for trajectory in trajectories:
        if trajectory.reward is None or not np.isfinite(trajectory.reward):
            raise DataError(
                f"{_describe(trajectory)}: the {estimator!r} advantage estimator needs a finite reward, "
                f"got {trajectory.reward!r}"
            )
    return np.array([t.reward for t in trajectories], dtype=np.float64)


def _groups(trajectories: Sequence[Trajectory]) -> list[np.ndarray]:
    """Input positions of each group's trajectories, groups in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for position, trajectory in enumerate(trajectories):
        groups.setdefault(trajectory.group_id, []).append(position)
    return [np.array(members, dtype=np.int64) for members in groups.values()]


def _per_token(trajectories: Sequence[Trajectory], scalars: np.ndarray, singletons: int) -> Advantages:
    return Advantages([np.full(len(t), a) for t, a in zip(trajectories, scalars, strict=True)], singletons)


def _no_normalise(name: str, normalise: bool) -> None:
    if normalise:
        raise ValueError(f"the {name!r} advantage estimator has no normalisation; use normalise=False")


def _group_relative(
    trajectories: Sequence[Trajectory], name: str, baseline: Callable[[np.ndarray], np.ndarray], normalise: bool
) -> Advantages:
    rewards = _rewards(trajectories, name)
    scalars = np.zeros(len(trajectories))
    singletons = 0
    for members in _groups(trajectories):
        group = rewards[members]
        if members.size == 1:
            singletons += 1
            continue
        if np.all(group == group[0]):
            continue  # exactly 0, whatever the round-off of the mean
        centred = group - baseline(group)
        scalars[members] = centred / group.std(ddof=1) if normalise else centred
    return _per_token(trajectories, scalars, singletons)


def grpo(trajectories: Sequence[Trajectory], *, normalise: bool = False) -> Advantages:
    """``A_i = R_i - mean_G R`` (``/ std_G R``, sample std, when ``normalise``); see the module docstring."""
    return _group_relative(trajectories, "grpo", lambda group: group.mean(), normalise)


def rloo(trajectories: Sequence[Trajectory], *, normalise: bool = False) -> Advantages:
    """``A_i = R_i - (sum_G R - R_i) / (|G| - 1)``, the leave-one-out baseline."""
    _no_normalise("rloo", normalise)
    return _group_relative(trajectories, "rloo", lambda group: (group.sum() - group) / (group.size - 1), False)


def _subgroup_sums(tree: TokenTree, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per trajectory of ``tree`` (its order): sum over its trie sub-groups of ``R_i - mean_S R``, and their count.

    ``rewards`` follows ``tree.trajectories``. A node's sub-group is every trajectory ending in its
    subtree; parents precede children in ``node_parent`` (pre-order), so one backward pass folds
    the leaf counts, reward sums and reward ranges upwards. A sub-group of equal rewards adds
    exactly 0 (its computed mean may differ from them in the last bit).
    """
    count, total = np.zeros(tree.n_nodes), np.zeros(tree.n_nodes)
    low, high = np.full(tree.n_nodes, np.inf), np.full(tree.n_nodes, -np.inf)
    np.add.at(count, tree.end_node, 1.0)
    np.add.at(total, tree.end_node, rewards)
    np.minimum.at(low, tree.end_node, rewards)
    np.maximum.at(high, tree.end_node, rewards)
    for node in range(tree.n_nodes - 1, 0, -1):
        parent = tree.node_parent[node]
        count[parent] += count[node]
        total[parent] += total[node]
        low[parent] = min(low[parent], low[node])
        high[parent] = max(high[parent], high[node])
    sums, counts = np.zeros(len(rewards)), np.zeros(len(rewards))
    for k, node in enumerate(tree.end_node):
        while node >= 0:
            if count[node] >= 2:
                sums[k] += 0.0 if low[node] == high[node] else rewards[k] - total[node] / count[node]
                counts[k] += 1
            node = tree.node_parent[node]
    return sums, counts


def _treepo_group(group: list[Trajectory], rewards: np.ndarray) -> np.ndarray:
    """TreePO advantages of one group of two or more trajectories (``rewards`` in ``group`` order)."""
    trees = build_trees(group)
    reward_of = {id(t): r for t, r in zip(group, rewards, strict=True)}
    sums, counts = {}, {}
    for tree in trees:
        tree_sums, tree_counts = _subgroup_sums(tree, np.array([reward_of[id(t)] for t in tree.trajectories]))
        for trajectory, s, c in zip(tree.trajectories, tree_sums, tree_counts, strict=True):
            sums[id(trajectory)], counts[id(trajectory)] = s, c
    scalars = np.array([sums[id(t)] for t in group])
    subgroups = np.array([counts[id(t)] for t in group])
    if len(trees) > 1:  # the group itself, which no single trie node holds
        centred = rewards - rewards.mean() if np.any(rewards != rewards[0]) else 0.0
        scalars, subgroups = scalars + centred, subgroups + 1
    return scalars / subgroups


def treepo(trajectories: Sequence[Trajectory], *, normalise: bool = False) -> Advantages:
    """Mean over trie sub-groups of ``R_i - mean_S R`` (``/ batch std`` when ``normalise``); see the module doc."""
    rewards = _rewards(trajectories, "treepo")
    scalars = np.zeros(len(trajectories))
    with_peers = np.zeros(len(trajectories), dtype=bool)
    for members in _groups(trajectories):
        if members.size > 1:
            scalars[members] = _treepo_group([trajectories[i] for i in members], rewards[members])
            with_peers[members] = True
    spread = scalars[with_peers]
    if normalise and np.any(spread != spread[:1]):
        scalars = scalars / spread.std(ddof=1)
    return _per_token(trajectories, scalars, int((~with_peers).sum()))


def given(trajectories: Sequence[Trajectory], *, normalise: bool = False) -> Advantages:
    """The per-token ``advantages`` each trajectory carries (same length as its ``input_ids``), as float64."""
    _no_normalise("given", normalise)
    values = []
    for trajectory in trajectories:
        carried = getattr(trajectory, "advantages", None)
        if carried is None:
            raise DataError(f"{_describe(trajectory)}: the 'given' advantage estimator needs per-token advantages")
        carried = np.asarray(carried, dtype=np.float64).reshape(-1)
        if carried.size != len(trajectory):
            raise DataError(
                f"{_describe(trajectory)}: {carried.size} advantages for {len(trajectory)} tokens; give one per token"
            )
        if not np.all(np.isfinite(carried)):
            raise DataError(f"{_describe(trajectory)}: advantages contain a non-finite value")
        values.append(carried)
    return Advantages(values, 0)


ESTIMATORS: dict[str, Callable[..., Advantages]] = {"grpo": grpo, "rloo": rloo, "treepo": treepo, "given": given}
"""name -> ``estimator(trajectories, *, normalise) -> Advantages``."""


def estimate(trajectories: Sequence[Trajectory], estimator: str, normalise: bool = False) -> Advantages:
    """The advantages of ``trajectories`` by the estimator named ``estimator`` (:data:`ESTIMATORS`): the
    one dispatch the trainer, ``verify`` and ``bench`` share."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {tuple(ESTIMATORS)}, got {estimator!r}")
    computed = ESTIMATORS[estimator](trajectories, normalise=normalise)
    computed.trajectories = trajectories
    return computed


def non_finite_statistics(trajectories: Sequence[Trajectory], advantages: Sequence[np.ndarray]) -> str | None:
    """What is not finite among a step's reward and advantage statistics, or ``None``.

    Finite rewards can still overflow float64 in their mean or spread (1.5e308 and 0), and so can
    the advantages built from them; the step's loss then hides it (every advantage 0, or NaN
    clipped away). The statistics are those the trainer logs: reward mean and standard deviation,
    the mean and spread of the advantages per trained token. A step with any of them non-finite
    is treated as a non-finite loss (``optimizer.non_finite``).
    """
    rewards = np.array([t.reward for t in trajectories if t.reward is not None], dtype=np.float64)
    masks = [t.loss_mask[1:] for t in trajectories]
    weight = float(sum(m.sum() for m in masks))
    with np.errstate(over="ignore", invalid="ignore"):
        mean = sum(float((m * a[1:]).sum()) for m, a in zip(masks, advantages, strict=True)) / weight if weight else 0.0
        spread = sum(float((m * (a[1:] - mean) ** 2).sum()) for m, a in zip(masks, advantages, strict=True))
        statistics = {
            "the reward mean": float(rewards.mean()) if rewards.size else 0.0,
            "the reward standard deviation": float(rewards.std()) if rewards.size else 0.0,
            "an advantage": 0.0 if all(np.all(np.isfinite(a)) for a in advantages) else np.nan,
            "the advantage mean": mean,
            "the advantage standard deviation": spread,
        }
    bad = [name for name, value in statistics.items() if not np.isfinite(value)]
    if not bad:
        return None
    return f"not finite over {len(trajectories)} trajectories: {', '.join(bad)} (rewards overflow float64)"


def check_finite_statistics(trajectories: Sequence[Trajectory], advantages: Sequence[np.ndarray]) -> None:
    """Raise a :class:`DataError` when :func:`non_finite_statistics` finds something."""
    problem = non_finite_statistics(trajectories, advantages)
    if problem is not None:
        raise DataError(problem)
