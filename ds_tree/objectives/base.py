"""What every objective implements, and what a training step gives it (docs/DESIGN.md, "Architecture").

An objective is a class registered by its ``objective.kind`` in :data:`ds_tree.registries.OBJECTIVES`
(``OBJECTIVES.register("mine", Mine)``) and built once per run with the config. The trainer calls the same
hooks of every objective, and nothing else:

- :meth:`Objective.check_data` (offline data, before any model is built) and :meth:`Objective.check_resume`
  (the checkpoint a run would resume from);
- :meth:`Objective.build`, once the policy's engine exists: the objective's own models (a frozen reference);
- :meth:`Objective.run_step` for every step, the trainer's one step function, then :meth:`Objective.end_step`;
- :meth:`Objective.save_state` / :meth:`Objective.load_state` with every checkpoint.

:meth:`Objective.run_step` is one loop for every objective: :meth:`~Objective.prepare_step` gives what the
step needs before its first update (its trajectories; per optimizer update this rank's plan of rows and each
row's loss terms, :class:`~ds_tree.losses.terms.RowTerms`, with what they need: normalisers, old and reference
log-probs), the self-check records its inputs (:meth:`~Objective.check_inputs`), then every update runs its
rows, each with the runner of its execution kind (:meth:`~Objective.run_update`,
:func:`~ds_tree.engine.runners.run_items`: the objective never sees the kind), and applies the optimizer
update (:class:`~ds_tree.engine.updates.Updates`); :meth:`~Objective.step_metrics` reports the step.
:meth:`~Objective.objective_of` may hand a step to another objective (a multi-turn RL run's warm-up).

A new objective is one module: a subclass and its registration. The shapes the next ones take:

- PPO with a learned critic: :meth:`~Objective.build` makes the critic's DeepSpeed engine with its own
  optimizer; :meth:`~Objective.prepare_step` scores the values with it (no gradient) for GAE advantages;
  :meth:`~Objective.run_update` also runs and steps the critic; the state hooks carry its checkpoint.
- On-policy distillation: :meth:`~Objective.build` loads the frozen teacher as the KL reference is loaded
  (:func:`ds_tree.engine.reference.build_reference`); :meth:`~Objective.prepare_step` scores the teacher's
  log-probs at the targets (a runner's no-grad ``logprobs``); the terms are the per-token reverse KL.
- DPO: :meth:`~Objective.prepare_step` plans the pairs and sums each sequence's log-probs under the reference and
  the policy (no gradient), giving per-pair coefficients; the terms are the linear surrogate whose gradient
  is DPO's (the loss reported from the sums).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.config import Config, config_to_dict
from ds_tree.data.dataset_reader import DatasetGroups, LoadedGroups, TreeDatasetReader
from ds_tree.data.sampler import StepSampler
from ds_tree.engine.layout import StepLayout
from ds_tree.engine.plan_ahead import Planning, Timed
from ds_tree.engine.runners import RunContext, StepOutput, run_items
from ds_tree.engine.self_check import CheckedObjective, SelfCheck, sample_groups, sample_units
from ds_tree.engine.updates import Updates
from ds_tree.losses.terms import RowTerms
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.packing.distributed import GroupUnits
from ds_tree.packing.exchange import Collectives
from ds_tree.packing.plan import RankPlan
from ds_tree.packing.step_units import StepData, gather_units, plan_units
from ds_tree.trees.trajectory import Trajectory

T = TypeVar("T")

HostWork = Callable[[StepData, Collectives], T]
"""A step's host work on its data (the plan, and what the objective computes from the data alone): runs on the
plan-ahead thread for offline data (:mod:`ds_tree.engine.plan_ahead`), so it reads nothing that changes
during a step (its settings are taken when it is made) and makes collectives only through ``Collectives``."""


class Rollouts(Protocol):
    """Online RL (``rollout.enabled``): what the trainer and the objectives call on the rollouts
    (:class:`~ds_tree.rollout.online.OnlineRollouts`, :class:`~ds_tree.rollout.multiturn.MultiTurnRollouts`)."""

    sampler: StepSampler
    """Which prompts (tasks) each step samples."""
    scalars: dict[str, float]
    """The ``rollout/`` metrics of the last step sampled."""
    ahead: object | None
    """The background sampler (``rollout.max_staleness > 0``), or None."""
    sync_s: float
    """This step's weight sync time."""
    wait_s: float
    """This step's wait for the background sampler before its sync."""

    def build_model(self) -> None:
        """The generation model, before the policy is built (outside any ZeRO-3 ``zero.Init``)."""

    def begin_step(self, step: int, policy: torch.nn.Module) -> None:
        """``step`` starts: the weight sync when one is due (a collective)."""

    def samples(self, step: int) -> bool:
        """Whether ``step`` samples; a multi-turn run's warm-up and refresh steps do not (SFT steps)."""

    def step_units(self, step: int, policy: torch.nn.Module) -> StepData:
        """``step``'s sampled, scored groups: each rank holds its own slots' (a collective of their summaries)."""

    def demonstrations(self, step: int, update: int) -> list[Trajectory]:
        """On a step that does not sample: the environment's demonstrations of one of its updates."""

    def close(self) -> None:
        """Stop the background sampler and a managed engine."""


@dataclass
class Update:
    """One optimizer update's work on this rank."""

    plan: RankPlan
    """This rank's items (and the update's token counts, every rank's)."""
    terms: list[RowTerms]
    """Each item's share of the objective, in ``plan.rows`` order."""
    items: list = field(default_factory=list)
    """The objective's prepared items behind ``terms``, in ``plan.rows`` order, where its hooks need them before
    the update's forwards (RL: :class:`~ds_tree.objectives.rl_rows.RLRow`, for CPPO's mask on walked rows)."""


@dataclass
class Prepared:
    """What a step needs before its first update (:meth:`Objective.prepare_step`; every rank alike)."""

    trajectories: list[Trajectory]
    """The trajectories of the step this rank holds (those of its items' groups, and of the groups it
    summarised; with one rank every trajectory of the step)."""
    updates: list[Update]
    epochs: int = 1
    """Passes over :attr:`updates` (PPO epochs)."""
    problem: str | None = None
    """Why the step cannot train (non-finite statistics): it is discarded as a non-finite loss is."""
    untrained: bool = False
    """No token of the step is trained (every loss weight 0): counted, warned about once."""
    check_sample: list[Trajectory] = field(default_factory=list)
    """The self-check's sample of the step (every rank alike) when the check wants the step."""
    planning: dict[str, float] = field(default_factory=dict)
    """``time/plan_s`` and ``time/plan_wait_s`` of the step's host work."""


@dataclass
class StepResult:
    """What a step reports to the trainer."""

    plans: list[RankPlan]
    """This rank's plan of each update (the tree and throughput scalars)."""
    loss: float
    """The mean global loss over the step's updates (NaN: a discarded step)."""
    grad_norm: float | None
    """The last update's gradient norm."""
    scalars: dict[str, float] = field(default_factory=dict)
    """The objective's own metrics (``rl/``, ``loss/router_aux``, ``rollout/``, ``warmup/``)."""


@dataclass
class Components:
    """What :meth:`Objective.build` may build on: the policy and how it was built."""

    policy: object
    """The policy's DeepSpeed engine."""
    ds_config: dict
    hf_deepspeed_config: object | None = None
    """The policy's ``HfDeepSpeedConfig`` under ``model.zero_init`` (transformers keeps one process-wide)."""


@dataclass
class StepContext:
    """What a step needs from the trainer (built by it once the policy's engine exists)."""

    config: Config
    policy: object
    """The policy's DeepSpeed engine: forwards with gradients (its ``module``: the old policy's no-grad ones)."""
    updates: Updates
    layout: StepLayout
    self_check: SelfCheck
    rank: int
    groups: LoadedGroups | TreeDatasetReader
    """The offline data's groups, by group index (``data.path``: a converted dataset read lazily, or tokens
    JSONL held in memory; no group in online RL)."""
    sampler: StepSampler
    """Which groups (prompts) each step takes."""
    online: Rollouts | None = None
    planning: Planning | None = None
    """Where each step's host work runs (offline data: one step ahead on a thread); None: on this thread."""

    def units(self, step: int) -> StepData:
        """``step``'s groups as this rank reaches them: sampled now from the current policy in online RL (a
        collective; each rank holds its own slots'), else the data's groups in the sampler's order."""
        if self.online is not None:
            return self.online.step_units(step, self.policy.module)
        return StepData(DatasetGroups(self.groups, self.sampler.groups_for_step(step)))

    def trajectories(self, step: int) -> list[Trajectory]:
        """Offline data: every trajectory of ``step``'s groups, in unit order, on every rank (checks that
        compare a step with its flat baseline; the trainer plans from :meth:`units`)."""
        if self.online is not None:
            raise RuntimeError("online RL: each rank holds only its own slots' trajectories (use units)")
        data = self.units(step)
        return [t for group in data.units.read(range(len(data))) for t in group]

    def plan(self, trajectories: list[Trajectory]) -> RankPlan:
        """This rank's items for ``trajectories`` (every rank passes the same; a collective): the per-rank
        planner on their groups."""
        return plan_units(StepData(GroupUnits.of_step(trajectories)), self.layout.plan_settings(), Collectives())[0]

    def host_step(self, step: int, work_for: Callable[[int], HostWork]) -> Timed:
        """The host work ``work_for(step)`` makes for ``step``'s data: offline, the one begun ahead during the
        last step (or done now), and the next step's begun; online, done now on this rank's rollouts."""
        planning = self.planning or Planning()
        if self.online is not None:
            data = self.units(step)  # sampling: not the host work's time
            work = work_for(step)
            return planning.run(None, lambda comm: work(data, comm))
        outcome = planning.run(self.step_key(step), self.bound_work(step, work_for))
        if step + 1 < self.config.max_steps:
            planning.ahead(self.step_key(step + 1), self.bound_work(step + 1, work_for))
        return outcome

    def host_now(self, work: Callable[[Collectives], T]) -> Timed:
        """``work`` on this thread, on the default group (data the step makes itself: demonstrations)."""
        return Planning().run(None, work)

    def bound_work(self, step: int, work_for: Callable[[int], HostWork]) -> Callable[[Collectives], object]:
        data, work = self.units(step), work_for(step)
        return lambda comm: work(data, comm)

    def step_key(self, step: int) -> tuple:
        """What a step's host work depends on: the step, the config (a check may edit it between steps) and
        whether the self-check wants the step (a deferred check moves to it after the work began)."""
        return step, config_to_dict(self.config), self.wants_check(step)

    def wants_check(self, step: int) -> bool:
        return self.self_check is not None and self.self_check.wanted(step)

    def run(self, router_aux: RouterAuxLoss | None = None) -> RunContext:
        """How this rank runs its items now (device, LM-head chunk, dfs walks)."""
        return RunContext(self.policy.device, self.config.model.head_chunk, self.layout.dfs_settings(), router_aux)

    def router_aux(self, plan: RankPlan) -> RouterAuxLoss | None:
        """An MoE policy's router load-balancing loss over the trajectories of ``plan`` (all ranks), else None."""
        return RouterAuxLoss.of_model(self.policy, self.config.model.router_aux_loss_coef, plan.flat_tokens)


def check_sample(data: StepData, comm: Collectives) -> tuple[list[Trajectory], list[list[Trajectory]]]:
    """The self-check's sample of the step of ``data`` (:func:`~ds_tree.engine.self_check.sample_groups` of its
    trajectories) on every rank alike, and the whole groups that hold it (rollouts: sent by their holders; a
    collective)."""
    groups = gather_units(data, sample_units(data.units.sizes()), comm)
    return sample_groups([t for group in groups for t in group]), groups


def router_scalars(outputs: list[StepOutput]) -> dict[str, float]:
    """``loss/router_aux``: the mean over the updates of the router loss's share, summed over ranks (every rank
    alike: MoE or not is the model's); nothing for a model without one."""
    shares = [output.router_aux for output in outputs if output.router_aux is not None]
    if not shares:
        return {}
    total = torch.tensor([float(np.mean(shares))], dtype=torch.float64)
    dist.all_reduce(total)
    return {"loss/router_aux": float(total.item())}


class Objective:
    """One ``objective.kind`` (module docstring). Subclasses implement :meth:`prepare_step`; the other hooks
    have defaults."""

    def __init__(self, config: Config) -> None:
        self.config = config

    # ------------------------------------------------------------------ before the run
    def check_data(self, trajectories: list[Trajectory]) -> None:
        """What the objective needs of ``data.path``'s trajectories, checked before any rank builds a model
        (a :class:`~ds_tree.config.ConfigError` naming the field)."""

    def check_resume(self, path: Path, step: int) -> None:
        """Whether checkpoint ``path`` (of ``step``) holds the objective's state (a
        :class:`~ds_tree.run.checkpoint.CheckpointError` naming what is missing; checked at the dry run)."""

    def build(self, components: Components) -> None:
        """The objective's own models, once the policy's engine exists (every rank)."""

    # ------------------------------------------------------------------ a step
    def run_step(self, step: int, context: StepContext) -> StepResult:
        """One training step (0-based ``step``), the trainer's one step function for every objective: online
        RL's weight sync when due, then the step's objective (:meth:`objective_of`) prepares it, records the
        self-check's inputs, runs ``epochs`` passes of its updates, each applied, and reports it."""
        if context.online is not None:  # a weight sync when a sampled step needs this one's weights (a collective)
            context.online.begin_step(step, context.policy.module)
        objective = self.objective_of(step, context)
        prepared = objective.prepare_step(step, context)
        if context.self_check.wanted(step):  # before the updates: the old policy is the step's start
            context.self_check.record(objective.check_inputs(prepared, context))
        plans = [update.plan for update in prepared.updates]
        if prepared.problem is not None:  # as a non-finite loss: stop, or discard the step (no update)
            context.updates.discard(step + 1, prepared.problem)
            return StepResult(plans, float("nan"), None, dict(prepared.planning))
        if prepared.untrained:
            context.updates.count_untrained(step + 1)
        outputs, losses, grad_norm = [], [], None
        for _ in range(prepared.epochs):
            for update in prepared.updates:
                output = objective.run_update(update, context)
                loss, grad_norm = context.updates.apply(step + 1, output.loss)
                outputs.append(output)
                losses.append(loss)
        metrics = {**objective.step_metrics(prepared, outputs, losses, context), **prepared.planning}
        return StepResult(plans, float(np.mean(losses)), grad_norm, metrics)

    def objective_of(self, step: int, context: StepContext) -> Objective:
        """The objective that trains ``step``: this one, or another on some steps (a multi-turn RL run's
        warm-up trains SFT on the environment's demonstrations)."""
        return self

    def prepare_step(self, step: int, context: StepContext) -> Prepared:
        """``step``'s trajectories, updates and what their terms need (module docstring)."""
        raise NotImplementedError

    def check_inputs(self, prepared: Prepared, context: StepContext) -> CheckedObjective | None:
        """The objective's loss on a sample of ``prepared`` for the self-check (None: nothing checked on this
        step; the next step is), made before the step's updates."""
        return None

    def run_update(self, update: Update, context: StepContext) -> StepOutput:
        """Forward and backward of ``update``'s items, each by its kind's runner, an MoE model's router loss
        included: one optimizer update's gradient."""
        run = context.run(context.router_aux(update.plan))
        return run_items(context.policy, update.plan.rows, update.terms, run, context.updates.backward_for)

    def step_metrics(
        self, prepared: Prepared, outputs: list[StepOutput], losses: list[float], context: StepContext
    ) -> dict[str, float]:
        """The step's metrics from its updates' outputs and global losses (every rank alike: collectives
        allowed)."""
        return router_scalars(outputs)

    def end_step(self, done: int, context: StepContext) -> None:
        """After ``done`` steps, on every rank (collectives allowed)."""

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, path: Path, step: int) -> None:
        """The objective's own files into checkpoint directory ``path`` of ``step`` (every rank)."""

    def load_state(self, path: Path, step: int) -> None:
        """Its files back from checkpoint ``path`` of ``step`` (every rank), after the policy's."""
