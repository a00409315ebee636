"""A step's advantages, normalisers and statistics when each rank holds only some of its groups (docs/RL.md).

The per-rank planner (:mod:`ds_tree.packing.step_units`) gives a rank the groups of its own items, whole, and
each group of the step is *counted* by exactly one rank (the rank that summarised it), under a key that orders
the step's groups (mini-batch, then group). So:

- every advantage estimator works per group (:meth:`~ds_tree.losses.advantages.Estimator.per_group`): a rank
  estimates the groups it holds, exactly as the whole step's estimate does;
- a ``batch`` normalisation (``treepo`` with ``normalise_advantages``) divides by the standard deviation of
  the per-trajectory advantages over the step: the ranks gather each counted trajectory's advantage (one
  number a trajectory) and every rank computes :func:`~ds_tree.losses.advantages.batch_std` of the step's, in
  step order;
- ``gae`` with ``normalise_advantages`` whitens its per-token advantages by the step's mean and standard deviation
  over trained (trajectory, token) pairs: the ranks gather each counted trajectory's two sums
  (:func:`~ds_tree.losses.advantages.token_sums`), then its squared deviations from the step's mean, as the
  statistics below do;
- the mini-batches' normalisers (:class:`~ds_tree.objectives.rl_rows.StepNormalisers`) and the reward and
  advantage statistics the step reports and checks (``rl/reward_*``, ``rl/advantage_*``, the non-finite check
  of :func:`~ds_tree.losses.advantages.non_finite_statistics`) are sums over trajectories: the ranks gather
  each counted trajectory's terms (its reward, trained tokens, advantage-weighted sum; then its squared
  deviation from the step's mean) and every rank sums them in step order, as the whole step does.

What crosses ranks is a few numbers per trajectory (no tokens), and the values are the whole step's to the
bit: the same terms summed in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ds_tree.losses.advantages import (
    Advantages,
    batch_std,
    token_deviations,
    token_moments,
    token_sums,
    trajectory_scalars,
    whitened,
    whitening,
)
from ds_tree.objectives.rl_rows import StepNormalisers
from ds_tree.packing.exchange import Collectives
from ds_tree.registries import ESTIMATORS
from ds_tree.trees.trajectory import Trajectory

Key = tuple[int, int]
"""A group's place in the step: (mini-batch, group in it); the step's groups in key order are its order."""


@dataclass(frozen=True)
class AdvantageRule:
    """How a group's advantages are computed this step: the estimator on the group, then the batch scale."""

    estimator: str
    normalise: bool
    tempo_coef: float
    scale: float | None = None
    """The step's batch standard deviation the advantages are divided by (None: none)."""
    moments: tuple[float, float] | None = None
    """``gae`` whitened: the step's per-token advantage ``(mean, std)`` (None: none)."""
    values: Mapping[int, np.ndarray] | None = field(default=None, compare=False)
    """``gae``: ``id(trajectory) -> the critic's values`` (:meth:`~ds_tree.objectives.critic.Critic.estimate`)."""
    gamma: float = 1.0
    lam: float = 0.95

    def raw(self, group: Sequence[Trajectory]) -> Advantages:
        """The estimator on ``group`` (one unit's trajectories) without the batch normalisation."""
        return ESTIMATORS.get(self.estimator).per_group(
            group,
            normalise=self.normalise,
            tempo_coef=self.tempo_coef,
            values=self.values,
            gamma=self.gamma,
            lam=self.lam,
        )

    @property
    def needs_values(self) -> bool:
        """The estimator reads a critic's values (``gae``): its advantages wait for the step's forward."""
        return self.estimator == "gae" and self.values is None

    def scaled(self, trajectories: Sequence[Trajectory], values: list[np.ndarray]) -> list[np.ndarray]:
        """``values`` (the estimator's, of ``trajectories``) with the step's batch scale or whitening applied."""
        if self.moments is not None:
            return whitened([t.loss_mask for t in trajectories], values, self.moments)
        return values if self.scale is None else [v / self.scale for v in values]

    def of(self, group: Sequence[Trajectory]) -> list[np.ndarray]:
        """The step's advantages of ``group``'s trajectories (its order)."""
        return self.scaled(group, self.raw(group).values)

    @property
    def batch(self) -> bool:
        return self.normalise and ESTIMATORS.get(self.estimator).normalise == "batch"

    @property
    def per_token(self) -> bool:
        """The advantages are whitened over the step's trained tokens (``gae`` with ``normalise``)."""
        return self.normalise and ESTIMATORS.get(self.estimator).normalise == "token"


@dataclass
class HeldGroup:
    """A group this rank holds: its trajectories, its key, whether this rank counts it."""

    key: Key
    trajectories: list[Trajectory]
    counted: bool


@dataclass
class HeldAdvantages:
    """This rank's groups' advantages (:func:`held_advantages`)."""

    rule: AdvantageRule
    by_trajectory: dict[int, np.ndarray]
    """``id(trajectory) -> per-token advantages`` of every trajectory this rank holds."""
    counted: list[tuple[Key, list[Trajectory], list[np.ndarray]]]
    """The counted groups with their advantages (the statistics' terms)."""
    singletons: int
    """Trajectories alone in their group, over the counted groups (this rank's share)."""
    unscaled: dict[int, np.ndarray] = field(default_factory=dict)
    """The estimator's advantages before the batch scale or whitening (``gae``'s returns are ``A + V`` of these)."""


def in_step_order(comm: Collectives, mine: dict[Key, object]) -> list[tuple[Key, object]]:
    """Every rank's ``{key: value}`` gathered, in key order (the step's)."""
    merged = {}
    for values in comm.all_gather(mine):
        merged.update(values)
    return sorted(merged.items())


def held_advantages(groups: Sequence[HeldGroup], rule: AdvantageRule, comm: Collectives) -> HeldAdvantages:
    """The step's advantages of the groups this rank holds (a collective when the estimator normalises by the
    batch: the counted groups' per-trajectory advantages gathered)."""
    raw = [rule.raw(group.trajectories) for group in groups]
    if rule.batch:
        mine = {
            group.key: (trajectory_scalars(computed.values), computed.with_peers)
            for group, computed in zip(groups, raw, strict=True)
            if group.counted
        }
        step = [value for _, value in in_step_order(comm, mine)]
        scalars = np.concatenate([s for s, _ in step] or [np.zeros(0)])
        with_peers = np.concatenate([p for _, p in step] or [np.zeros(0, dtype=bool)])
        rule = replace(rule, scale=batch_std(scalars, with_peers))
    if rule.per_token:
        rule = replace(rule, moments=step_whitening(groups, raw, comm))
    by_trajectory, unscaled, counted = {}, {}, []
    for group, computed in zip(groups, raw, strict=True):
        values = rule.scaled(group.trajectories, computed.values)
        by_trajectory.update({id(t): v for t, v in zip(group.trajectories, values, strict=True)})
        unscaled.update({id(t): v for t, v in zip(group.trajectories, computed.values, strict=True)})
        if group.counted:
            counted.append((group.key, group.trajectories, values))
    singletons = sum(computed.singletons for group, computed in zip(groups, raw, strict=True) if group.counted)
    return HeldAdvantages(rule, by_trajectory, counted, singletons, unscaled)


def step_whitening(
    groups: Sequence[HeldGroup], raw: Sequence[Advantages], comm: Collectives
) -> tuple[float, float] | None:
    """The step's per-token advantage ``(mean, std)`` over every rank's counted groups
    (:func:`~ds_tree.losses.advantages.whitening`): each counted trajectory's sums, then its squared deviations from
    the mean, gathered in step order (two gathers of a number or two a trajectory)."""
    counted = [(g, computed.values) for g, computed in zip(groups, raw, strict=True) if g.counted]
    sums = {g.key: [token_sums(t.loss_mask, a) for t, a in zip(g.trajectories, v, strict=True)] for g, v in counted}
    moments = token_moments([x for _, group in in_step_order(comm, sums) for x in group])
    if moments is None:
        return None
    deviations = {
        g.key: [token_deviations(t.loss_mask, a, moments[0]) for t, a in zip(g.trajectories, v, strict=True)]
        for g, v in counted
    }
    return whitening(moments, [x for _, group in in_step_order(comm, deviations) for x in group])


def unestimated(groups: Sequence[HeldGroup], rule: AdvantageRule) -> HeldAdvantages:
    """Zero advantages of the groups this rank holds, for an estimator that waits for the step's critic values
    (:attr:`AdvantageRule.needs_values`): what :func:`step_sums` reads of them ahead (the normalisers) is exact;
    the statistics are the step's own once the advantages are (:func:`held_advantages` again)."""
    by_trajectory, counted = {}, []
    for group in groups:
        values = [np.zeros(len(t)) for t in group.trajectories]
        by_trajectory.update({id(t): v for t, v in zip(group.trajectories, values, strict=True)})
        if group.counted:
            counted.append((group.key, group.trajectories, values))
    return HeldAdvantages(rule, by_trajectory, counted, 0)


@dataclass
class StepStatistics:
    """The step's reward and advantage statistics over every rank's counted groups (module docstring)."""

    trajectories: int
    reward_mean: float
    """NaN when no trajectory has a reward."""
    reward_std: float
    advantage_mean: float
    """Per trained (trajectory, token)."""
    advantage_std: float
    singletons: int
    problem: str | None
    """What is not finite (:func:`~ds_tree.losses.advantages.non_finite_statistics`'s message), or None."""

    def scalars(self) -> dict[str, float]:
        return {
            "rl/reward_mean": self.reward_mean,
            "rl/reward_std": self.reward_std,
            "rl/advantage_mean": self.advantage_mean,
            "rl/advantage_std": self.advantage_std,
        }


@dataclass
class _Terms:
    """One counted group's per-trajectory terms of the sums (what a rank sends of it)."""

    rewards: list[float | None]
    trained: list[float]
    """``trained_tokens`` (the normalisers')."""
    weights: list[float]
    """``loss_mask[1:].sum()`` (:func:`~ds_tree.losses.advantages.token_sums`)."""
    weighted: list[float]
    """``(loss_mask[1:] * advantages[1:]).sum()`` (:func:`~ds_tree.losses.advantages.token_sums`)."""
    finite: bool


def step_sums(
    held: HeldAdvantages, mini_batches: int, comm: Collectives
) -> tuple[list[StepNormalisers], StepStatistics]:
    """Each mini-batch's :class:`StepNormalisers` and the step's :class:`StepStatistics`, from every rank's
    counted groups (two gathers of a few numbers per trajectory; module docstring)."""
    mine = {}
    for key, trajectories, values in held.counted:
        with np.errstate(over="ignore", invalid="ignore"):
            sums = [token_sums(t.loss_mask, a) for t, a in zip(trajectories, values, strict=True)]
        mine[key] = _Terms(
            [t.reward for t in trajectories],
            [t.trained_tokens for t in trajectories],
            [w for _, w in sums],
            [x for x, _ in sums],
            all(np.all(np.isfinite(a)) for a in values),
        )
    keyed = in_step_order(comm, mine)
    step = [terms for _, terms in keyed]
    normalisers = []
    for batch in range(mini_batches):
        trained = [t for key, terms in keyed if key[0] == batch for t in terms.trained]
        normalisers.append(StepNormalisers(float(sum(trained)), float(sum(count > 0 for count in trained))))
    rewards = np.array([r for terms in step for r in terms.rewards if r is not None], dtype=np.float64)
    weight = float(sum(w for terms in step for w in terms.weights))
    with np.errstate(over="ignore", invalid="ignore"):
        mean = sum(x for terms in step for x in terms.weighted) / weight if weight else 0.0
        deviations = {
            key: [token_deviations(t.loss_mask, a, mean) for t, a in zip(group, values, strict=True)]
            for key, group, values in held.counted
        }
        spread = sum(x for _, values in in_step_order(comm, deviations) for x in values)
        statistics = {
            "the reward mean": float(rewards.mean()) if rewards.size else 0.0,
            "the reward standard deviation": float(rewards.std()) if rewards.size else 0.0,
            "an advantage": 0.0 if all(terms.finite for terms in step) else np.nan,
            "the advantage mean": mean,
            "the advantage standard deviation": spread,
        }
    count = sum(len(terms.rewards) for terms in step)
    bad = [name for name, value in statistics.items() if not np.isfinite(value)]
    problem = f"not finite over {count} trajectories: {', '.join(bad)} (rewards overflow float64)" if bad else None
    singletons = int(comm.all_reduce([held.singletons])[0])
    return normalisers, StepStatistics(
        trajectories=count,
        reward_mean=float(rewards.mean()) if rewards.size else float("nan"),
        reward_std=float(rewards.std()) if rewards.size else float("nan"),
        advantage_mean=float(mean),
        advantage_std=(spread / weight if weight else 0.0) ** 0.5,
        singletons=singletons,
        problem=problem,
    )
