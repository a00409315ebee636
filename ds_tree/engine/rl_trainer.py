"""The trainer's RL step (docs/RL.md): rollouts with advantages and old log-probs, then the updates.

A mixin of :class:`ds_tree.engine.trainer.Trainer`, which provides the engine, the plans of rows
(``plan_rows``), the backward function and the optimizer update; the computation itself is
:mod:`ds_tree.engine.rl_step`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.config import ConfigError
from ds_tree.engine.rl_step import (
    RLOutput,
    RLRow,
    StepNormalisers,
    check_shared_logprobs,
    prepare_rl_rows,
    rl_scalars,
    run_rl_rows,
)
from ds_tree.engine.runners import add_metrics
from ds_tree.errors import DataError
from ds_tree.losses.advantages import check_finite_statistics, estimate, non_finite_statistics
from ds_tree.losses.rl import SUMMED_METRICS
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.packing.plan import RankPlan
from ds_tree.trees.trajectory import Trajectory, group_trajectories
from ds_tree.trees.trie import build_forest


@dataclass
class RLRollouts:
    """One RL step's data, ready for its updates (:meth:`Trainer.rl_rollouts`)."""

    trajectories: list[Trajectory]
    advantages: list[np.ndarray]
    """Per trajectory (``trajectories`` order), per token."""
    singletons: int
    """Trajectories alone in their group (advantage 0)."""
    batches: list[list[Trajectory]]
    """Mini-batches: whole groups each."""
    plans: list[RankPlan]
    """This rank's rows of each mini-batch."""
    prepared: list[list[RLRow]]
    """Those rows with targets, per-token sums, old and reference log-probs."""


class RLSteps:
    """RL methods of the trainer (module docstring)."""

    def check_rl_data(self) -> None:
        """What the RL objective needs from the data, checked before any rank builds a model."""
        objective = self.config.objective
        if objective.mini_batches > self.config.data.groups_per_step:
            raise ConfigError(
                f"objective.mini_batches ({objective.mini_batches}) is more than data.groups_per_step "
                f"({self.config.data.groups_per_step}): a mini-batch is a set of whole groups"
            )
        try:
            computed = estimate(
                self.trajectories, objective.estimator, objective.normalise_advantages, tempo_coef=objective.tempo_coef
            )
            check_finite_statistics(self.trajectories, computed.values)
            if objective.old_logprobs == "data" or objective.importance_truncation:
                missing = next((t for t in self.trajectories if getattr(t, "logprobs", None) is None), None)
                if missing is not None:
                    raise DataError(
                        f"{missing.source or missing.group_id}: objective.old_logprobs=data and "
                        "objective.importance_truncation need the sampler's per-token 'logprobs'"
                    )
            if objective.old_logprobs == "data":
                for tree in build_forest(self.trajectories, merge=self.config.data.merge):
                    check_shared_logprobs(tree)
        except DataError as error:
            raise ConfigError(f"data.path: {error}") from None

    def rl_rollouts(self, step: int) -> RLRollouts:
        """``step``'s trajectories, advantages and mini-batches, with old (and reference) log-probs.

        Every rank computes the same advantages and mini-batches (whole groups, in the sampler's
        order) and plans its rows of each; the old policy is the model before the step's updates.
        """
        objective = self.config.objective
        settings = objective.rl_settings()
        trajectories = self.step_trajectories(step)
        computed = estimate(
            trajectories, objective.estimator, objective.normalise_advantages, tempo_coef=objective.tempo_coef
        )
        advantages = computed.by_trajectory()
        groups = group_trajectories(trajectories)
        batches = [
            [t for g in chunk for t in groups[g]]
            for chunk in np.array_split(np.arange(len(groups)), objective.mini_batches)
        ]
        plans = [self.plan_rows(batch) for batch in batches]
        prepared = [
            prepare_rl_rows(
                self.engine,
                plan.rows,
                advantages,
                settings,
                StepNormalisers.of(batch),
                reference=self.reference,
                device=self.engine.device,
                head_chunk=self.config.model.head_chunk,
                dfs=self.dfs_settings,
            )
            for plan, batch in zip(plans, batches, strict=True)
        ]
        return RLRollouts(trajectories, computed.values, computed.singletons, batches, plans, prepared)

    def rl_backward(self, rows: list[RLRow], plan: RankPlan) -> RLOutput:
        """Forward and backward of one mini-batch's items (one optimizer update's gradient); an MoE model's
        router load-balancing loss over the mini-batch's trajectories (``plan``'s, all ranks) included."""
        router_aux = RouterAuxLoss.of_model(self.engine, self.config.model.router_aux_loss_coef, plan.flat_tokens)
        return run_rl_rows(
            self.engine,
            rows,
            self.config.objective.rl_settings(),
            backward_for=self.backward_function,
            dfs=self.dfs_settings,
            device=self.engine.device,
            head_chunk=self.config.model.head_chunk,
            router_aux=router_aux,
        )

    def rl_step(self, step: int) -> tuple[list[RankPlan], float, float | None, dict[str, float]]:
        """One RL step: rollouts prepared, then ``ppo_epochs`` x ``mini_batches`` updates (docs/RL.md).
        Returns the plans, the mean loss over the updates, the last gradient norm and ``rl/`` scalars."""
        if self.online is not None:  # a weight sync when a sampled step needs this one's weights (a collective)
            self.online.begin_step(step, self.engine.module)
        if self.online is not None and getattr(self.online, "warming_up", lambda _: False)(step):
            plans, loss, grad_norm, scalars = self.warmup_step(step)
            if self.online.ahead is not None:  # sampling ahead: the next RL step's weights were synced here
                scalars.update({"rollout/sync_s": self.online.sync_s, "rollout/wait_s": self.online.wait_s})
            return plans, loss, grad_norm, scalars
        rollouts = self.rl_rollouts(step)
        self.prepare_rl_self_check(step, rollouts.trajectories, rollouts.advantages)  # before the updates
        problem = non_finite_statistics(rollouts.trajectories, rollouts.advantages)  # every rank alike
        if problem is not None:  # as a non-finite loss: stop, or discard the step (no update)
            self.discard_step(step + 1, problem)
            return rollouts.plans, float("nan"), None, {}
        if StepNormalisers.of(rollouts.trajectories).total_tokens == 0:
            self.count_untrained(step + 1)
        losses, metrics, grad_norm, router_aux = [], None, None, []
        for _ in range(self.config.objective.ppo_epochs):
            for rows, plan in zip(rollouts.prepared, rollouts.plans, strict=True):
                output = self.rl_backward(rows, plan)
                if output.metrics is not None:
                    metrics = add_metrics(metrics, output.metrics)
                if output.router_aux is not None:
                    router_aux.append(output.router_aux)
                loss, grad_norm = self.apply_update(step + 1, output.loss)
                losses.append(loss)
        scalars = rl_scalars(rollouts.trajectories, rollouts.advantages, self.global_metrics(metrics))
        if router_aux:  # every rank alike (MoE or not is the model's): the mean over the updates, all ranks
            share = torch.tensor([float(np.mean(router_aux))], dtype=torch.float64)
            dist.all_reduce(share)
            scalars["loss/router_aux"] = float(share.item())
        scalars["rl/singleton_trajectories"] = float(rollouts.singletons)
        if self.online is not None:
            scalars.update(self.online.scalars)
            fresh = not self.online.scalars.get("rollout/staleness_max")  # sampled with the weights that train
            if self.config.objective.old_logprobs != "data" and fresh:  # logp_old: the trainer's, same weights
                from ds_tree.engine.sampler_mismatch import mismatch_scalars

                scalars.update(mismatch_scalars(rollouts.prepared))
        return rollouts.plans, float(np.mean(losses)), grad_norm, scalars

    def warmup_step(self, step: int) -> tuple[list[RankPlan], float, float | None, dict[str, float]]:
        """A step of ``rollout.env.warmup_steps``: as many SFT updates as an RL step has (the schedule
        counts them alike), each on the environment's demonstrations (docs/ENVIRONMENTS.md), an MoE model's
        router load-balancing loss included as in an SFT run."""
        plans, losses, grad_norm = [], [], None
        for update in range(self.config.objective.updates_per_step):
            trajectories = self.online.demonstrations(step, update)
            self.last_trajectories = trajectories
            plan = self.plan_rows(trajectories)
            router_aux = RouterAuxLoss.of_model(self.engine, self.config.model.router_aux_loss_coef, plan.flat_tokens)
            output = self.forward_backward(plan.rows, router_aux=router_aux)  # the SFT objective, router loss included
            loss, grad_norm = self.apply_update(step + 1, output.loss)
            plans.append(plan)
            losses.append(loss)
        return plans, float(np.mean(losses)), grad_norm, {"warmup/sft_loss": float(np.mean(losses))}

    def global_metrics(self, metrics: dict[str, float] | None) -> dict[str, float]:
        """The RL metric sums of every rank (``ratio_max`` by max)."""
        metrics = metrics or {}
        sums = torch.tensor([metrics.get(name, 0.0) for name in SUMMED_METRICS], dtype=torch.float64)
        dist.all_reduce(sums)
        top = torch.tensor([metrics.get("ratio_max", 0.0)], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return {**dict(zip(SUMMED_METRICS, sums.tolist(), strict=True)), "ratio_max": float(top.item())}
