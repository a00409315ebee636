"""Advantage estimators: per-trajectory, per-token advantages for the RL objective (:mod:`ds_tree.losses.rl`).

Every estimator takes the trajectories of one optimizer step (any order, several groups) and
returns, for each trajectory in input order, a float64 array aligned with its ``input_ids``
(``values[i][t]`` is the advantage of predicting token ``t``; ``t = 0`` is never predicted and
carries a value only for alignment). A group is the trajectories that share a ``group_id``.

One interface: an estimator is a function of one group (:class:`GroupTrie`: its trajectories, their
rewards and, built on first use and shared, the group's exact-token trie with per-node leaf counts and
reward sums) and the :class:`EstimatorSettings`, returning the group's per-token advantages, wrapped in
an :class:`Estimator` (by the :func:`estimator` decorator) and registered by name in
:data:`ds_tree.registries.ESTIMATORS` (the built-ins below as lazy entries; a project's own with
``ESTIMATORS.register("mine", Estimator(...))`` or the decorator ``@ESTIMATORS.register("mine")`` above
``@estimator(...)``). :func:`estimate` is the one dispatch the trainer, ``verify`` and ``bench`` share. A
new tree estimator is one function and a registration.

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
- ``tempo`` (Tran, Yao, Yu 2025, "Exploiting Tree Structure for Credit Assignment in RL Training of
  LLMs", arXiv 2509.18314): the GRPO advantage ``a_i`` (centred, ``/ std_G R`` when ``normalise``)
  plus a temporal-difference term at branching tokens. The value of a prefix ``s`` is the mean
  GRPO advantage of the trajectories through it, ``V(s) = mean_{j through s} a_j`` (P2T: the trie's
  leaf counts and advantage sums per node). Token ``t`` of trajectory ``i`` gets
  ``A_{i,t} = a_i + tempo_coef * (V(s_{<=t}) - V(s_{<t}))`` where the prefix ``s_{<t}`` ends a trie
  node that has two or more children and is not the group's root node; elsewhere the TD term is 0
  (inside a node both prefixes have the same trajectories, so ``V`` does not change; a split made
  only by a trajectory ending there is not a branch). The root's fan-out is not gated in: there
  ``V`` is the group mean, and the TD term would repeat the group-relative advantage itself. So a
  group that branches only at its root (plain GRPO samples that differ from their first completion
  token on) gets exactly GRPO, and along a path the TD terms sum to ``V(leaf) - V(root child)``
  (telescoping) when no trajectory ends inside another.
- ``sibling`` (Sibling-GRPO, from V-STAR: Jiang et al. 2026, "Spend Search Where It Pays", arXiv 2602.10699): each
  branch is scored against its siblings at each branch point of the group's trie. A node ``c`` whose parent has two
  or more children (a branch point; the tries' roots are siblings when the group has several) has the value
  ``R(c)``, the mean reward of the trajectories ending in its subtree, and the advantage
  ``A(c) = R(c) - mean_{siblings s of c, c included} R(s)`` (each branch weighs once; ``/ std`` of the siblings'
  values, sample std, when ``normalise``: GRPO within each sibling set). A token takes the advantage of the branch
  it lies on: its node's, or the nearest ancestor's that is a branch (a node split only because a trajectory ends
  there continues its branch); a token above every branch point (the shared prompt and any shared start) compares
  with nothing and gets 0, which is also what GRPO's advantages sum to there. The advantage is a function of the
  token, the same for every trajectory through it; a group that branches only at its root (plain GRPO samples) gets
  exactly GRPO's advantage (Dr. GRPO's without ``normalise``).
- ``gae`` (Schulman et al. 2016, arXiv 1506.02438): generalised advantage estimation along each path from the
  values of PPO's learned critic (:mod:`ds_tree.losses.values`; ``objective.critic``), with ``gamma`` and ``lam``.
  The values come with the settings (:attr:`EstimatorSettings.values`, from the critic's forward before the step's
  updates); a trajectory alone in its group needs no peers. With ``normalise`` the advantages are whitened over the
  batch, as PPO trainers do: ``(A - mean) / std`` at every trained token, the mean and the (population) standard
  deviation taken over the batch's (trajectory, trained token) pairs weighted by the loss mask, as flat counts them
  (:func:`token_moments`; ``rl/advantage_mean`` and ``rl/advantage_std`` become 0 and 1). The returns the critic
  learns stay ``A + V`` of the advantages before whitening.
- ``given``: per-token advantages carried by the data (a trajectory's ``advantages`` array).

A trajectory alone in its group has no baseline: it gets advantage 0 and is counted in
``Advantages.singletons``, for the trainer to report. A group whose rewards are all equal gets
exactly 0 (no division by a zero or round-off standard deviation: the rewards' mean need not equal
them bit for bit). Estimators that need rewards raise :class:`~ds_tree.errors.DataError` naming
the first trajectory without one.

Trie sub-groups come from :func:`ds_tree.trees.trie.build_trees`, so flat trajectories and
explicit trees (expanded into trajectories, see :mod:`ds_tree.data.explicit`) are treated alike:
sub-groups are the shared token prefixes, whatever the node split a record gave. Duplicate
trajectories end at the same trie node and each counts as its own leaf. No estimator sees the
execution mode: packed rows, split parts, dfs walks and sequence-parallel shards all look the
per-token values up by trajectory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ds_tree.errors import DataError
from ds_tree.losses.values import gae as path_gae
from ds_tree.registries import ESTIMATORS
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import TokenTree, build_trees
from ds_tree.trees.weights import predicted_mask


@dataclass
class Advantages:
    values: list[np.ndarray]
    """Per trajectory (input order) a float64 array as long as its ``input_ids``."""
    singletons: int
    """Trajectories that were alone in their group and got advantage 0."""
    trajectories: Sequence[Trajectory] = ()
    """The trajectories ``values`` belong to (set by :func:`estimate`)."""
    with_peers: np.ndarray | None = None
    """Per trajectory: not alone in its group (or the estimator needs no peers); what a batch normalisation
    spans (:meth:`Estimator.per_group`)."""

    def by_trajectory(self) -> dict[int, np.ndarray]:
        """``id(trajectory) -> its per-token advantages``, as the RL rows look them up."""
        return {id(t): a for t, a in zip(self.trajectories, self.values, strict=True)}


@dataclass(frozen=True)
class EstimatorSettings:
    """What an estimator may read besides the group (``objective.normalise_advantages``, ``tempo_coef``)."""

    normalise: bool = False
    """Divide by the reward standard deviation (the estimator says of what: group or batch)."""
    tempo_coef: float = 1.0
    """``tempo``: the coefficient of the branch-gated TD term (0: exactly GRPO)."""
    values: Mapping[int, np.ndarray] | None = None
    """``gae``: ``id(trajectory) -> the critic's value at each of its tokens`` (finite at its trained tokens)."""
    gamma: float = 1.0
    """``gae``: the discount per trained token."""
    lam: float = 0.95
    """``gae``: GAE's ``lambda``."""


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


@dataclass
class NodeStatistics:
    """Per node of one trie: the trajectories ending in its subtree (``count``), the sum, minimum and
    maximum of a per-trajectory quantity over them, and each trajectory's end node and token nodes."""

    tree: TokenTree
    count: np.ndarray
    total: np.ndarray
    low: np.ndarray
    high: np.ndarray

    @property
    def mean(self) -> np.ndarray:
        """Per node the mean over its subtree's trajectories; exactly the common value when they agree
        (a computed mean may differ from equal values in the last bit)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.low == self.high, self.low, self.total / self.count)


def node_statistics(tree: TokenTree, values: np.ndarray) -> NodeStatistics:
    """Fold ``values`` (one per trajectory of ``tree``, its order) up the trie: parents precede children
    in ``node_parent`` (pre-order), so one backward pass accumulates every subtree."""
    count, total = np.zeros(tree.n_nodes), np.zeros(tree.n_nodes)
    low, high = np.full(tree.n_nodes, np.inf), np.full(tree.n_nodes, -np.inf)
    np.add.at(count, tree.end_node, 1.0)
    np.add.at(total, tree.end_node, values)
    np.minimum.at(low, tree.end_node, values)
    np.maximum.at(high, tree.end_node, values)
    for node in range(tree.n_nodes - 1, 0, -1):
        parent = tree.node_parent[node]
        count[parent] += count[node]
        total[parent] += total[node]
        low[parent] = min(low[parent], low[node])
        high[parent] = max(high[parent], high[node])
    return NodeStatistics(tree, count, total, low, high)


class GroupTrie:
    """One group: its trajectories, their rewards (``None`` for an estimator that needs none) and, built
    on first use, its exact-token tries, shared by every tree estimator of the group."""

    def __init__(self, trajectories: list[Trajectory], rewards: np.ndarray | None) -> None:
        self.trajectories = trajectories
        self.rewards = rewards
        self._trees: list[TokenTree] | None = None

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def trees(self) -> list[TokenTree]:
        """The group's tries (one per distinct first token), built once."""
        if self._trees is None:
            self._trees = build_trees(self.trajectories)
        return self._trees

    def per_tree(self, values: np.ndarray) -> list[tuple[TokenTree, np.ndarray]]:
        """``values`` (group order) re-ordered for each trie (its ``trajectories`` order)."""
        position = {id(t): k for k, t in enumerate(self.trajectories)}
        return [(tree, values[[position[id(t)] for t in tree.trajectories]]) for tree in self.trees]

    def in_group_order(self, per_tree: list[list[np.ndarray]]) -> list[np.ndarray]:
        """Per-trajectory arrays given per trie (each in its trie's order) back in group order."""
        found = {
            id(t): v
            for tree, arrays in zip(self.trees, per_tree, strict=True)
            for t, v in zip(tree.trajectories, arrays, strict=True)
        }
        return [found[id(t)] for t in self.trajectories]


GroupEstimator = Callable[[GroupTrie, EstimatorSettings], list[np.ndarray]]
"""``(group of two or more, settings) -> per-token advantages of each trajectory, group order``."""


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: the per-group function and what it needs (module docstring)."""

    name: str
    group_advantages: GroupEstimator
    normalise: Literal["group", "batch", "token", None]
    """What ``normalise`` divides by: the group's reward std, the batch's advantage std, the batch's per-token
    advantages' mean and std (:func:`token_moments`), or nothing (``normalise`` is then refused)."""
    needs_rewards: bool = True
    needs_peers: bool = True
    """A trajectory alone in its group gets 0 (no baseline) and is counted as a singleton."""

    def __call__(self, trajectories: Sequence[Trajectory], *, normalise: bool = False, **settings) -> Advantages:
        """Advantages of a batch of trajectories (several groups, any order)."""
        computed = self.per_group(trajectories, normalise=normalise, **settings)
        if normalise and self.normalise == "batch":
            computed.values = _batch_normalised(computed.values, computed.with_peers)
        if normalise and self.normalise == "token":
            computed.values = batch_whitened(trajectories, computed.values)
        return computed

    def per_group(self, trajectories: Sequence[Trajectory], *, normalise: bool = False, **settings) -> Advantages:
        """:meth:`__call__` but a ``batch`` normalisation, which spans every group of the batch (a run takes the
        spread of every rank's groups: :mod:`ds_tree.objectives.rl_statistics`)."""
        if normalise and self.normalise is None:
            raise ValueError(f"the {self.name!r} advantage estimator has no normalisation; use normalise=False")
        chosen = EstimatorSettings(normalise=normalise, **settings)
        rewards = _rewards(trajectories, self.name) if self.needs_rewards else None
        values: list[np.ndarray | None] = [None] * len(trajectories)
        with_peers = np.zeros(len(trajectories), dtype=bool)
        for members in _groups(trajectories):
            group = GroupTrie([trajectories[i] for i in members], None if rewards is None else rewards[members])
            if self.needs_peers and members.size == 1:
                values[members[0]] = np.zeros(len(trajectories[members[0]]))
                continue
            with_peers[members] = True
            for position, computed in zip(members, self.group_advantages(group, chosen), strict=True):
                values[position] = computed
        singletons = int((~with_peers).sum()) if self.needs_peers else 0
        return Advantages(values, singletons, with_peers=with_peers)


def estimator(
    *,
    normalise: Literal["group", "batch", None],
    needs_rewards: bool = True,
    needs_peers: bool = True,
    name: str | None = None,
) -> Callable[[GroupEstimator], Estimator]:
    """The :class:`Estimator` of the decorated per-group function (named after it unless ``name``), not
    registered: :data:`ds_tree.registries.ESTIMATORS` names it (``objective.estimator``)."""

    def build(group_advantages: GroupEstimator) -> Estimator:
        return Estimator(name or group_advantages.__name__, group_advantages, normalise, needs_rewards, needs_peers)

    return build


def trajectory_scalars(values: Sequence[np.ndarray]) -> np.ndarray:
    """Each trajectory's advantage (the estimators a batch normalises give one value per trajectory)."""
    return np.array([v[0] if v.size else 0.0 for v in values])


def batch_std(scalars: np.ndarray, with_peers: np.ndarray) -> float | None:
    """The sample std of the per-trajectory advantages over the trajectories with peers; None when they are all
    equal (nothing to divide by)."""
    spread = scalars[with_peers]
    if not np.any(spread != spread[:1]):
        return None
    return float(spread.std(ddof=1))


def _batch_normalised(values: list[np.ndarray], with_peers: np.ndarray) -> list[np.ndarray]:
    """Divide by :func:`batch_std` of the batch (nothing when it is None)."""
    std = batch_std(trajectory_scalars(values), with_peers)
    return values if std is None else [v / std for v in values]


def token_sums(loss_mask: np.ndarray, advantages: np.ndarray) -> tuple[float, float]:
    """One trajectory's share of the batch's per-token advantage mean: ``(sum m_t A_t, sum m_t)`` over its tokens
    ``t >= 1`` (``m``: the loss mask), the terms ``rl/advantage_mean`` sums."""
    mask = np.asarray(loss_mask, dtype=np.float64)[1:]
    return float((mask * advantages[1:]).sum()), float(mask.sum())


def token_deviations(loss_mask: np.ndarray, advantages: np.ndarray, mean: float) -> float:
    """One trajectory's share of the batch's per-token advantage variance: ``sum m_t (A_t - mean)^2``."""
    return float((np.asarray(loss_mask, dtype=np.float64)[1:] * (advantages[1:] - mean) ** 2).sum())


def token_moments(sums: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """``(mean, total weight)`` of the batch's per-token advantages from each trajectory's :func:`token_sums`
    (in batch order); None when no token is trained."""
    weight = sum(w for _, w in sums)
    return None if weight == 0 else (sum(x for x, _ in sums) / weight, weight)


def whitening(moments: tuple[float, float], deviations: Sequence[float]) -> tuple[float, float] | None:
    """``(mean, std)`` the advantages are whitened with, from :func:`token_moments` and each trajectory's
    :func:`token_deviations`; None when the advantages are all equal (nothing to divide by: left as they are)."""
    mean, weight = moments
    std = (sum(deviations) / weight) ** 0.5
    return (mean, std) if std > 0 else None


def whitened(
    loss_masks: Sequence[np.ndarray], values: Sequence[np.ndarray], moments: tuple[float, float] | None
) -> list[np.ndarray]:
    """``(A - mean) / std`` at each trajectory's trained tokens (loss mask not 0, ``t >= 1``), others as they are."""
    if moments is None:
        return list(values)
    mean, std = moments
    out = []
    for mask, advantages in zip(loss_masks, values, strict=True):
        trained = predicted_mask(mask) != 0
        out.append(np.where(trained, (advantages - mean) / std, advantages))
    return out


def batch_whitened(trajectories: Sequence[Trajectory], values: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``values`` (per-token advantages of ``trajectories``) whitened over the batch (:func:`token_moments`,
    :func:`whitening`, :func:`whitened`; a run sums the same terms over the ranks in step order)."""
    masks = [t.loss_mask for t in trajectories]
    moments = token_moments([token_sums(m, a) for m, a in zip(masks, values, strict=True)])
    if moments is not None:
        moments = whitening(moments, [token_deviations(m, a, moments[0]) for m, a in zip(masks, values, strict=True)])
    return whitened(masks, values, moments)


def _per_token(group: GroupTrie, scalars: np.ndarray) -> list[np.ndarray]:
    return [np.full(len(t), a) for t, a in zip(group.trajectories, scalars, strict=True)]


def _centred(group: GroupTrie, baseline: Callable[[np.ndarray], np.ndarray], normalise: bool) -> np.ndarray:
    """``R - baseline`` per trajectory (``/ std_G R`` when ``normalise``); exactly 0 for equal rewards."""
    rewards = group.rewards
    if np.all(rewards == rewards[0]):
        return np.zeros(rewards.size)  # exactly 0, whatever the round-off of the mean
    centred = rewards - baseline(rewards)
    return centred / rewards.std(ddof=1) if normalise else centred


def _group_mean(rewards: np.ndarray) -> np.ndarray:
    return rewards.mean()


@estimator(normalise="group")
def grpo(group: GroupTrie, settings: EstimatorSettings) -> list[np.ndarray]:
    """``A_i = R_i - mean_G R`` (``/ std_G R``, sample std, when ``normalise``); see the module docstring."""
    return _per_token(group, _centred(group, _group_mean, settings.normalise))


@estimator(normalise=None)
def rloo(group: GroupTrie, settings: EstimatorSettings) -> list[np.ndarray]:
    """``A_i = R_i - (sum_G R - R_i) / (|G| - 1)``, the leave-one-out baseline."""
    return _per_token(group, _centred(group, lambda r: (r.sum() - r) / (r.size - 1), False))


def _subgroup_sums(statistics: NodeStatistics, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per trajectory of the trie (its order): sum over its sub-groups of ``R_i - mean_S R``, and their
    count. A sub-group of equal rewards adds exactly 0 (its computed mean may differ from them)."""
    tree, count, total = statistics.tree, statistics.count, statistics.total
    sums, counts = np.zeros(len(rewards)), np.zeros(len(rewards))
    for k, node in enumerate(tree.end_node):
        while node >= 0:
            if count[node] >= 2:
                same = statistics.low[node] == statistics.high[node]
                sums[k] += 0.0 if same else rewards[k] - total[node] / count[node]
                counts[k] += 1
            node = tree.node_parent[node]
    return sums, counts


@estimator(normalise="batch")
def treepo(group: GroupTrie, settings: EstimatorSettings) -> list[np.ndarray]:
    """Mean over trie sub-groups of ``R_i - mean_S R`` (``/ batch std`` when ``normalise``); see the module doc."""
    per_tree = []
    for tree, rewards in group.per_tree(group.rewards):
        sums, counts = _subgroup_sums(node_statistics(tree, rewards), rewards)
        per_tree.append(list(zip(sums, counts, strict=True)))
    sums, subgroups = (np.array(v) for v in zip(*group.in_group_order(per_tree), strict=True))
    rewards = group.rewards
    if len(group.trees) > 1:  # the group itself, which no single trie node holds
        centred = rewards - rewards.mean() if np.any(rewards != rewards[0]) else 0.0
        sums, subgroups = sums + centred, subgroups + 1
    return _per_token(group, sums / subgroups)


def _branch_gate(tree: TokenTree) -> np.ndarray:
    """Per node: its prefix is a branching state whose TD term TEMPO applies (two or more children,
    not the root)."""
    gate = tree.num_children() >= 2
    gate[tree.node_parent < 0] = False
    return gate


@estimator(normalise="group")
def tempo(group: GroupTrie, settings: EstimatorSettings) -> list[np.ndarray]:
    """GRPO's advantage plus ``tempo_coef`` times the branch-gated TD of the prefix values; see the module doc."""
    relative = _centred(group, _group_mean, settings.normalise)
    per_tree = []
    for tree, advantages in group.per_tree(relative):
        value = node_statistics(tree, advantages).mean
        gate = _branch_gate(tree)
        token_node = np.repeat(np.arange(tree.n_nodes), tree.node_end - tree.node_start)
        arrays = []
        for a, path in zip(advantages, tree.paths, strict=True):
            nodes = token_node[path]
            td = np.zeros(path.size)
            if path.size > 1:
                enters = (nodes[1:] != nodes[:-1]) & gate[nodes[:-1]]
                td[1:] = np.where(enters, value[nodes[1:]] - value[nodes[:-1]], 0.0)
            arrays.append(a + settings.tempo_coef * td)
        per_tree.append(arrays)
    return group.in_group_order(per_tree)


def _branch_advantages(tree: TokenTree, value: np.ndarray, root: float, normalise: bool) -> np.ndarray:
    """Per node of ``tree``: the sibling-relative advantage of the branch it lies on (``sibling``, module doc).
    ``value``: per node, the mean reward of its subtree's trajectories; ``root``: the root's own advantage (0,
    or its advantage against the roots of the group's other tries)."""
    children = tree.num_children()
    relative = np.zeros(tree.n_nodes)
    for parent in np.flatnonzero(children >= 2):
        siblings = np.flatnonzero(tree.node_parent == parent)
        relative[siblings] = _relative(value[siblings], normalise)
    branch = np.full(tree.n_nodes, root)
    for node in range(1, tree.n_nodes):  # pre-order: a lone child continues its parent's branch
        parent = tree.node_parent[node]
        branch[node] = relative[node] if children[parent] >= 2 else branch[parent]
    return branch


def _relative(values: np.ndarray, normalise: bool) -> np.ndarray:
    """``values`` minus their mean (``/`` their sample std when ``normalise``); exactly 0 when they are equal."""
    if np.all(values == values[0]):
        return np.zeros(values.size)
    centred = values - values.mean()
    return centred / values.std(ddof=1) if normalise else centred


@estimator(normalise="group")
def sibling(group: GroupTrie, settings: EstimatorSettings) -> list[np.ndarray]:
    """Each branch against its siblings at every branch point of the group's tries (Sibling-GRPO; module doc)."""
    statistics = [node_statistics(tree, rewards) for tree, rewards in group.per_tree(group.rewards)]
    roots = np.array([statistic.mean[0] for statistic in statistics])
    per_tree = []
    for statistic, root in zip(statistics, _relative(roots, settings.normalise), strict=True):
        tree = statistic.tree
        branch = _branch_advantages(tree, statistic.mean, root, settings.normalise)
        token_node = np.repeat(np.arange(tree.n_nodes), tree.node_end - tree.node_start)
        per_tree.append([branch[token_node[path]] for path in tree.paths])
    return group.in_group_order(per_tree)


@estimator(normalise="token", needs_peers=False)
def gae(group: GroupTrie, settings: EstimatorSettings) -> list[np.ndarray]:
    """GAE along each trajectory from the critic's values (module docstring; :func:`ds_tree.losses.values.gae`)."""
    if settings.values is None:
        raise ValueError("the gae advantage estimator needs the critic's values (objective.critic)")
    return [
        path_gae(settings.values[id(t)], t.loss_mask, reward, settings.gamma, settings.lam)[0]
        for t, reward in zip(group.trajectories, group.rewards, strict=True)
    ]


@estimator(normalise=None, needs_rewards=False, needs_peers=False)
def given(group: GroupTrie, settings: EstimatorSettings) -> list[np.ndarray]:
    """The per-token ``advantages`` each trajectory carries (same length as its ``input_ids``), as float64."""
    values = []
    for trajectory in group.trajectories:
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
    return values


def estimate(
    trajectories: Sequence[Trajectory],
    estimator: str,
    normalise: bool = False,
    *,
    tempo_coef: float = 1.0,
    values: Mapping[int, np.ndarray] | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> Advantages:
    """The advantages of ``trajectories`` by the estimator registered as ``estimator``
    (:data:`ds_tree.registries.ESTIMATORS`; an unknown name is a ValueError listing the registered ones): the
    one dispatch the trainer, ``verify`` and ``bench`` share. ``values``, ``gamma``, ``lam``: ``gae``'s
    (:class:`EstimatorSettings`)."""
    computed = ESTIMATORS.get(estimator)(
        trajectories, normalise=normalise, tempo_coef=tempo_coef, values=values, gamma=gamma, lam=lam
    )
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
