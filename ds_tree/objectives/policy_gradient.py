"""The clipped policy-gradient objective (``objective.kind: grpo`` or ``ppo``; docs/RL.md).

A step: the step's groups (online RL: sampled now, each rank holding its own slots'; a multi-turn run's
warm-up and refresh steps train the environment's demonstrations instead,
:class:`~ds_tree.objectives.sft.Demonstrations`); its host work (:func:`rl_host_work`, for offline data done
one step ahead, :mod:`ds_tree.engine.plan_ahead`): mini-batches of whole groups in the sampler's order, each
planned by the per-rank planner, the advantages of the groups this rank holds and the statistics over every
rank's (:mod:`ds_tree.objectives.rl_statistics`); then each mini-batch's rows prepared
(:func:`~ds_tree.objectives.rl_rows.prepare_rl_rows`: per-token sums, old and reference log-probs, the model
before the step's updates being the old policy), and ``ppo_epochs`` passes of one optimizer update per
mini-batch. ``estimator: gae`` needs the critic's values as the step starts: its host work plans without
advantages, and the step estimates them (:meth:`~ds_tree.objectives.critic.Critic.estimate`), each update then
training the critic too. ``grpo`` and ``ppo`` are this one objective; they differ only in the
default advantage estimator, which the config resolves (``grpo``: group-relative; ``ppo``: ``given``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.config import ConfigError
from ds_tree.engine.runners import RunContext, StepOutput, add_metrics
from ds_tree.engine.self_check import CheckSettings, merge_over_group, sample_groups, tree_items
from ds_tree.errors import DataError
from ds_tree.losses.advantages import check_finite_statistics, estimate
from ds_tree.losses.rl import SUMMED_METRICS, RLSettings
from ds_tree.objectives.base import (
    Components,
    HostWork,
    Objective,
    Prepared,
    StepContext,
    Update,
    check_sample,
    router_scalars,
)
from ds_tree.objectives.critic import Critic, CriticUpdate, returns_of, step_value_statistics
from ds_tree.objectives.reference import KLReference
from ds_tree.objectives.rl_rows import (
    RLRow,
    StepNormalisers,
    check_shared_logprobs,
    prepare_rl_rows,
    rl_scalars,
    rl_terms,
    run_rl_rows,
    trajectory_scores,
    walked_cppo_masks,
)
from ds_tree.objectives.rl_statistics import (
    AdvantageRule,
    HeldGroup,
    StepStatistics,
    held_advantages,
    step_sums,
    unestimated,
)
from ds_tree.objectives.sampler_mismatch import mismatch_scalars
from ds_tree.objectives.sft import Demonstrations
from ds_tree.packing.exchange import Collectives
from ds_tree.packing.plan import PlanSettings, RankPlan
from ds_tree.packing.step_units import StepData, plan_units
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest


@dataclass
class PolicyGradientStep(Prepared):
    """One RL step's rollouts, ready for its updates."""

    statistics: StepStatistics | None = None
    """The step's reward and advantage statistics, every rank's groups (:mod:`ds_tree.objectives.rl_statistics`)."""
    sample_advantages: dict[int, np.ndarray] = field(default_factory=dict)
    """``id(trajectory) -> per-token advantages`` of the self-check's sample."""
    rows: list[list[RLRow]] = field(default_factory=list)
    """This rank's rows of each mini-batch with targets, per-token sums, old and reference log-probs."""
    critic: dict[str, float] = field(default_factory=dict)
    """``estimator: gae``: the critic's value statistics of the step (``critic/value_mean``, ...)."""


@dataclass
class RLHost:
    """An RL step's host work (:func:`rl_host_work`): everything the step needs from its data alone."""

    plans: list[RankPlan]
    """This rank's plan of each mini-batch."""
    normalisers: list[StepNormalisers]
    """Each mini-batch's, summed over the ranks."""
    advantages: dict[int, np.ndarray]
    """``id(trajectory) -> per-token advantages`` of every trajectory this rank holds."""
    statistics: StepStatistics
    trajectories: list[Trajectory]
    sample: list[Trajectory]
    sample_advantages: dict[int, np.ndarray]
    groups: list[HeldGroup] = field(default_factory=list)
    """The groups this rank holds (``estimator: gae`` estimates them at the step, from the critic's values)."""
    sample_groups: list[list[Trajectory]] = field(default_factory=list)
    """The whole groups holding the self-check's sample."""


def rl_host_work(settings: PlanSettings, rule: AdvantageRule | None, mini_batches: int, sample: bool) -> HostWork:
    """The host work of an RL step: mini-batches of whole groups in step order, each planned by the per-rank
    planner; the advantages of the groups this rank holds; the mini-batches' normalisers and the step's
    statistics summed over the ranks; with ``sample`` the self-check's sample and its advantages. ``rule`` None:
    no advantages (zeros, as ``gae``'s ahead of its critic): on-policy distillation's come from its teacher."""

    def work(data: StepData, comm: Collectives) -> RLHost:
        plans, groups = [], []
        for batch, chunk in enumerate(np.array_split(np.arange(len(data)), mini_batches)):
            plan, planner = plan_units(data.subset(chunk), settings, comm)
            plans.append(plan)
            share = set(planner.share())  # each group counted by the rank that summarised it
            for unit, trees in planner.built.items():
                groups.append(HeldGroup((batch, unit), trees.trajectories, unit in share))
        estimated = rule is not None and not rule.needs_values
        held = held_advantages(groups, rule, comm) if estimated else unestimated(groups, rule)
        normalisers, statistics = step_sums(held, mini_batches, comm)
        chosen, chosen_advantages, whole = [], {}, []
        if sample:
            chosen, whole = check_sample(data, comm)
            for group in whole if estimated else ():
                chosen_advantages.update(zip(map(id, group), held.rule.of(group), strict=True))
        trajectories = [t for group in groups for t in group.trajectories]
        return RLHost(
            plans, normalisers, held.by_trajectory, statistics, trajectories, chosen, chosen_advantages, groups, whole
        )

    return work


class PolicyGradient(Objective):
    """The clipped objective with its KL reference (module docstring)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.reference = KLReference(config)
        self.critic = Critic(config)
        self.warmup = Demonstrations(config)

    def check_data(self, trajectories: list[Trajectory]) -> None:
        objective = self.config.objective
        if objective.mini_batches > self.config.data.groups_per_step:
            raise ConfigError(
                f"objective.mini_batches ({objective.mini_batches}) is more than data.groups_per_step "
                f"({self.config.data.groups_per_step}): a mini-batch is a set of whole groups"
            )
        try:
            zero_values = {id(t): np.zeros(len(t)) for t in trajectories}  # gae: its rewards checked, no critic yet
            computed = estimate(
                trajectories,
                objective.estimator,
                objective.normalise_advantages,
                tempo_coef=objective.tempo_coef,
                values=zero_values if self.critic.enabled else None,
            )
            check_finite_statistics(trajectories, computed.values)
            if objective.old_logprobs == "data" or objective.importance_truncation:
                missing = next((t for t in trajectories if getattr(t, "logprobs", None) is None), None)
                if missing is not None:
                    raise DataError(
                        f"{missing.source or missing.group_id}: objective.old_logprobs=data and "
                        "objective.importance_truncation need the sampler's per-token 'logprobs'"
                    )
            if objective.old_logprobs == "data":
                for tree in build_forest(trajectories, merge=self.config.data.merge):
                    check_shared_logprobs(tree)
        except DataError as error:
            raise ConfigError(f"data.path: {error}") from None

    def check_resume(self, path, step: int) -> None:
        self.reference.check_resumable(path, step)
        self.critic.check_resumable(path, step)

    def build(self, components: Components) -> None:
        self.reference.build(components.policy, components.ds_config, components.hf_deepspeed_config)
        self.critic.build(components)

    def objective_of(self, step: int, context: StepContext) -> Objective:
        """A multi-turn run's warm-up and refresh steps sample nothing: SFT on demonstrations trains them."""
        online = context.online
        return self.warmup if online is not None and not online.samples(step) else self

    def host_work(self, step: int, context: StepContext) -> HostWork:
        """``step``'s host work (:func:`rl_host_work`) with the settings of now."""
        objective = self.config.objective
        sample = context.wants_check(step)
        return rl_host_work(context.layout.plan_settings(), self.rule(), objective.mini_batches, sample)

    def rule(self) -> AdvantageRule:
        """How the step's advantages are computed (``gae``: with the critic's values, :meth:`Critic.estimate`)."""
        objective = self.config.objective
        return AdvantageRule(
            objective.estimator,
            objective.normalise_advantages,
            objective.tempo_coef,
            gamma=objective.gamma,
            lam=objective.lam,
        )

    def prepare_step(self, step: int, context: StepContext) -> PolicyGradientStep:
        """``step``'s host work (its data's plans, advantages and statistics; offline data planned one step
        ahead), then this rank's rows of each mini-batch with old (and reference) log-probs from the policy as
        the step starts."""
        settings = self.config.objective.rl_settings()
        host = context.host_step(step, lambda at: self.host_work(at, context))
        done = host.result
        values = None
        if self.critic.enabled:  # GAE's baseline: the critic's values before the step's updates, computed now
            estimated = self.critic.estimate(done.groups, done.plans, done.sample_groups, self.rule(), context)
            values, statistics = estimated.values, estimated.statistics
            done = replace(
                done,
                advantages=estimated.held.by_trajectory,
                statistics=statistics,
                sample_advantages=estimated.sample_advantages,
            )
        rows = [
            prepare_rl_rows(
                context.policy,
                plan.rows,
                done.advantages,
                settings,
                normalisers,
                reference=self.reference.model,
                device=context.policy.device,
                head_chunk=self.config.model.head_chunk,
                dfs=context.layout.dfs_settings(),
            )
            for plan, normalisers in zip(done.plans, done.normalisers, strict=True)
        ]
        updates = [
            Update(plan, [rl_terms(item, settings) for item in items], items)
            for plan, items in zip(done.plans, rows, strict=True)
        ]
        critic = {}
        if values is not None:  # each update also trains the critic on the same items
            returns = returns_of(done.trajectories, estimated.held.unscaled, values)  # not whitened
            updates = [
                CriticUpdate(
                    u.plan,
                    u.terms,
                    u.items,
                    critic_terms=self.critic.terms(u.plan, n, returns, values, settings),
                    step=step + 1,
                )
                for u, n in zip(updates, done.normalisers, strict=True)
            ]
            critic = step_value_statistics(estimated.held.counted, values, returns)
        return PolicyGradientStep(
            done.trajectories,
            updates,
            epochs=self.config.objective.ppo_epochs,
            problem=done.statistics.problem,  # every rank alike
            untrained=sum(n.total_tokens for n in done.normalisers) == 0,
            check_sample=done.sample,
            planning=host.scalars(),
            statistics=done.statistics,
            sample_advantages=done.sample_advantages,
            rows=rows,
            critic=critic,
        )

    def check_inputs(self, prepared: PolicyGradientStep, context: StepContext) -> PolicyGradientCheck:
        return PolicyGradientCheck.of(
            context.policy.module,
            prepared.check_sample,
            prepared.sample_advantages,
            self.config.objective.rl_settings(),
            context.self_check.settings(),
            reference=self.reference.model,
        )

    def run_update(self, update: Update, context: StepContext) -> StepOutput:
        """The policy's forward and backward of ``update``'s items; with a critic, then the critic's, and its
        optimizer update (:meth:`~ds_tree.objectives.critic.Critic.run_update`)."""
        settings = self.config.objective.rl_settings()
        if settings.cppo is not None:  # CPPO's mask of this update on walked rows (a no-grad walk of each first)
            walked_cppo_masks(context.policy, update.items, settings, context.run())
        output = super().run_update(update, context)
        if isinstance(update, CriticUpdate):
            self.critic.run_update(update, context)
        return output

    def step_metrics(
        self, prepared: PolicyGradientStep, outputs: list[StepOutput], losses: list[float], context: StepContext
    ) -> dict[str, float]:
        """``rl/`` scalars over the step's updates, the router loss's, and online RL's ``rollout/`` ones."""
        metrics = None
        for output in outputs:
            if output.metrics is not None:
                metrics = add_metrics(metrics, output.metrics)
        cppo = self.config.objective.cppo.enabled
        scalars = rl_scalars(prepared.statistics.scalars(), global_metrics(metrics), cppo=cppo)
        scalars.update(router_scalars(outputs))
        scalars["rl/singleton_trajectories"] = float(prepared.statistics.singletons)
        if self.critic.enabled:
            scalars.update(self.critic.step_metrics(prepared.critic))
        online = context.online
        if online is not None:
            scalars.update(online.scalars)
            fresh = not online.scalars.get("rollout/staleness_max")  # sampled with the weights that train
            if self.config.objective.old_logprobs != "data" and fresh:  # logp_old: the trainer's, same weights
                scalars.update(mismatch_scalars(prepared.rows))
        return scalars

    def end_step(self, done: int, context: StepContext) -> None:
        self.reference.end_step(done, context.policy.module)

    def save_state(self, path, step: int) -> None:
        self.reference.save(path, step)
        self.critic.save(path, step)

    def load_state(self, path, step: int) -> None:
        if self.reference.copied(step):
            self.reference.load(path, step)
        self.critic.load(path, step)


class GRPO(PolicyGradient):
    """``objective.kind: grpo``: advantages by default from the group-relative estimator ``grpo``."""


class PPO(PolicyGradient):
    """``objective.kind: ppo``: advantages by default given with the data (estimator ``given``)."""


def global_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    """The RL metric sums of every rank (``ratio_max`` by max)."""
    metrics = metrics or {}
    sums = torch.tensor([metrics.get(name, 0.0) for name in SUMMED_METRICS], dtype=torch.float64)
    dist.all_reduce(sums)
    top = torch.tensor([metrics.get("ratio_max", 0.0)], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return {**dict(zip(SUMMED_METRICS, sums.tolist(), strict=True)), "ratio_max": float(top.item())}


@dataclass
class PolicyGradientCheck:
    """The clipped objective on the self-check's sample (:class:`~ds_tree.engine.self_check.CheckedObjective`),
    with what it needs fixed before the step's updates."""

    sample: list[Trajectory]
    settings: RLSettings
    advantages: dict[int, np.ndarray]
    """``id(trajectory) -> per-token advantages`` (the step's)."""
    old_logprobs: dict[int, np.ndarray] | None
    """``id(trajectory) -> log p`` of its tokens (index 0 unused) under the policy before the step's
    updates; None with ``old_logprobs: data`` (the sampler's, read from the trajectories)."""
    reference: object | None = None
    targets_only = True

    @classmethod
    def of(
        cls,
        model,
        trajectories: list[Trajectory],
        advantages: dict[int, np.ndarray],
        settings: RLSettings,
        check: CheckSettings,
        reference=None,
    ) -> PolicyGradientCheck:
        """Before the step's updates: the sample, its advantages, and its old log-probs from the model as the
        step's rollouts saw it (the tree side's no-grad forwards, its items run by their kinds' runners, shared
        by both sides so that both compute the same objective; with ``old_logprobs: data`` the sampler's, read
        later)."""
        sample = sample_groups(trajectories)
        old = None
        if settings.old_logprobs != "data" and sample:
            items, _ = tree_items(sample, check.plan, check.sequence_parallel)
            values = trajectory_scores(model, sample, items, RunContext(check.device, check.head_chunk, check.dfs))
            if check.sequence_parallel is not None:
                values = merge_over_group(values, check.sequence_parallel.group)
            old = {id(t): v for t, v in zip(sample, values, strict=True)}
        return cls(sample, settings, {id(t): advantages[id(t)] for t in sample}, old, reference)

    def run(self, model, items, group_items, backward, run: RunContext) -> StepOutput:
        prepared = prepare_rl_rows(
            model,
            items,
            self.advantages,
            self.settings,
            StepNormalisers.of(self.sample),
            reference=self.reference,
            device=run.device,
            head_chunk=run.head_chunk,
            dfs=run.dfs,
            old_logprobs=self.old_logprobs,
        )
        return run_rl_rows(
            model,
            prepared,
            self.settings,
            backward=backward,
            dfs=run.dfs,
            device=run.device,
            head_chunk=run.head_chunk,
            collect_logprobs=run.collect_logprobs,
            router_aux=run.router_aux,
        )
