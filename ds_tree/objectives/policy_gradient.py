"""The clipped policy-gradient objective (``objective.kind: grpo`` or ``ppo``; docs/RL.md).

A step: the step's trajectories (online RL: sampled now; a multi-turn run's warm-up and refresh steps train
the environment's demonstrations instead, :class:`~ds_tree.objectives.sft.Demonstrations`), their advantages
(:func:`~ds_tree.losses.advantages.estimate`), mini-batches of whole groups in the sampler's order, each
planned and prepared (:func:`~ds_tree.objectives.rl_rows.prepare_rl_rows`: per-token sums, old and reference
log-probs, the model before the step's updates being the old policy), then ``ppo_epochs`` passes of one
optimizer update per mini-batch. ``grpo`` and ``ppo`` are this one objective; they differ only in the
default advantage estimator, which the config resolves (``grpo``: group-relative; ``ppo``: ``given``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.config import ConfigError
from ds_tree.engine.runners import RunContext, StepOutput, add_metrics
from ds_tree.engine.self_check import CheckSettings, merge_over_group, sample_groups, tree_items
from ds_tree.errors import DataError
from ds_tree.losses.advantages import check_finite_statistics, estimate, non_finite_statistics
from ds_tree.losses.rl import SUMMED_METRICS, RLSettings
from ds_tree.objectives.base import Components, Objective, Prepared, StepContext, Update, router_scalars
from ds_tree.objectives.critic import Critic, CriticUpdate, returns_of, value_statistics
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
)
from ds_tree.objectives.sampler_mismatch import mismatch_scalars
from ds_tree.objectives.sft import Demonstrations
from ds_tree.trees.trajectory import Trajectory, group_trajectories
from ds_tree.trees.trie import build_forest


@dataclass
class PolicyGradientStep(Prepared):
    """One RL step's rollouts, ready for its updates."""

    advantages: list[np.ndarray] = field(default_factory=list)
    """Per trajectory (``trajectories`` order), per token."""
    singletons: int = 0
    """Trajectories alone in their group (advantage 0)."""
    batches: list[list[Trajectory]] = field(default_factory=list)
    """Mini-batches: whole groups each."""
    rows: list[list[RLRow]] = field(default_factory=list)
    """This rank's rows of each mini-batch with targets, per-token sums, old and reference log-probs."""
    critic: dict[str, float] = field(default_factory=dict)
    """``estimator: gae``: the critic's value statistics of the step (``critic/value_mean``, ...)."""


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

    def prepare_step(self, step: int, context: StepContext) -> PolicyGradientStep:
        """``step``'s trajectories, advantages and mini-batches, with old (and reference) log-probs. Every rank
        computes the same advantages and mini-batches (whole groups, in the sampler's order) and plans its
        rows of each."""
        objective = self.config.objective
        settings = objective.rl_settings()
        trajectories = context.trajectories(step)
        groups = group_trajectories(trajectories)
        batches = [
            [t for g in chunk for t in groups[g]]
            for chunk in np.array_split(np.arange(len(groups)), objective.mini_batches)
        ]
        plans = [context.plan(batch) for batch in batches]
        values = None
        if self.critic.enabled:  # the critic's values before the step's updates: GAE's baseline
            values = self.critic.values(trajectories, plans, self.critic.run_context(context))
        computed = estimate(
            trajectories,
            objective.estimator,
            objective.normalise_advantages,
            tempo_coef=objective.tempo_coef,
            values=values,
            gamma=objective.gamma,
            lam=objective.lam,
        )
        advantages = computed.by_trajectory()
        rows = [
            prepare_rl_rows(
                context.policy,
                plan.rows,
                advantages,
                settings,
                StepNormalisers.of(batch),
                reference=self.reference.model,
                device=context.policy.device,
                head_chunk=self.config.model.head_chunk,
                dfs=context.layout.dfs_settings(),
            )
            for plan, batch in zip(plans, batches, strict=True)
        ]
        updates = [
            Update(plan, [rl_terms(item, settings) for item in items]) for plan, items in zip(plans, rows, strict=True)
        ]
        critic = {}
        if values is not None:  # each update also trains the critic on the same items
            returns = returns_of(trajectories, advantages, values)
            updates = [
                CriticUpdate(u.plan, u.terms, self.critic.terms(u.plan, batch, returns, values, settings), step + 1)
                for u, batch in zip(updates, batches, strict=True)
            ]
            critic = value_statistics(trajectories, values, returns)
        return PolicyGradientStep(
            trajectories,
            updates,
            epochs=objective.ppo_epochs,
            problem=non_finite_statistics(trajectories, computed.values),  # every rank alike
            untrained=StepNormalisers.of(trajectories).total_tokens == 0,
            advantages=computed.values,
            singletons=computed.singletons,
            batches=batches,
            rows=rows,
            critic=critic,
        )

    def check_inputs(self, prepared: PolicyGradientStep, context: StepContext) -> PolicyGradientCheck:
        by_id = {id(t): a for t, a in zip(prepared.trajectories, prepared.advantages, strict=True)}
        return PolicyGradientCheck.of(
            context.policy.module,
            prepared.trajectories,
            by_id,
            self.config.objective.rl_settings(),
            context.self_check.settings(),
            reference=self.reference.model,
        )

    def run_update(self, update: Update, context: StepContext) -> StepOutput:
        """The policy's forward and backward of ``update``'s items; with a critic, then the critic's, and its
        optimizer update (:meth:`~ds_tree.objectives.critic.Critic.run_update`)."""
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
        scalars = rl_scalars(prepared.trajectories, prepared.advantages, global_metrics(metrics))
        scalars.update(router_scalars(outputs))
        scalars["rl/singleton_trajectories"] = float(prepared.singletons)
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
