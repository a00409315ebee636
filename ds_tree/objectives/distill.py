"""On-policy distillation (``objective.kind: distill``; docs/RL.md, "On-policy distillation").

The student learns a frozen teacher's distribution (``objective.teacher``, same tokenizer) on the step's
trajectories: the student's own rollouts in online RL (``rollout.enabled``: single-turn or multi-turn, whose
warm-up steps train SFT on demonstrations as RL's do; the reward is only logged), or a dataset's. A step is
the policy-gradient objective's shape: mini-batches of whole groups, each planned, prepared without gradient,
then ``ppo_epochs`` passes of one optimizer update per mini-batch. Preparing a mini-batch's rows
(:func:`prepare_distill_rows`) forwards the teacher once per work item (a packed row, a walked tree, a
sequence-parallel shard), with no gradient, at the targets the loss needs (every token with a non-zero
coefficient ``c``, the aggregation's):

- ``distill.loss: reverse_kl_sampled``: the teacher's log-prob and the student's (before the step's updates)
  of each target give its advantage ``log p - log q_old`` (:mod:`ds_tree.losses.distill`), shared by every
  trajectory through the token; the update is the clipped objective with it
  (:func:`~ds_tree.objectives.rl_rows.rl_terms`);
- ``kl``, ``jsd``, ``reverse_kl``: the teacher's final hidden states at the targets' predicting positions are
  kept; the student's chunked head applies the teacher's head (:func:`~ds_tree.model_roles.teacher.head_of`) to
  the same chunk of them and adds each target's divergence, weighed by its restoration weight ``sum_i c_i``
  (a fork position predicts several targets: each with its own weight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.config import ConfigError
from ds_tree.engine.calls import in_process_group
from ds_tree.engine.runners import RunContext, StepOutput, run_items, runner_of
from ds_tree.losses.distill import FULL_VOCABULARY, divergence
from ds_tree.losses.rl import RLSettings, TokenSums
from ds_tree.losses.terms import RowTerms
from ds_tree.model_roles.teacher import check_teacher, head_of
from ds_tree.models.logprobs import HeadOf
from ds_tree.objectives.base import Components, Objective, Prepared, StepContext, Update, router_scalars
from ds_tree.objectives.policy_gradient import rl_host_work
from ds_tree.objectives.reference import frozen_model
from ds_tree.objectives.rl_rows import (
    RLRow,
    StepNormalisers,
    even_out_forwards,
    gathers_collectively,
    prepare_rl_rows,
    rl_terms,
    row_sums,
    trajectory_copies,
)
from ds_tree.objectives.rl_statistics import StepStatistics
from ds_tree.objectives.sft import Demonstrations
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.trajectory import Trajectory

DISTILL_METRICS = ("tokens", "divergence")
"""The metric sums of a distillation pass over trained tokens (``divergence``: the loss's per token; the
sampled reverse KL's: ``log q_old - log p``, its estimate on the sampled tokens)."""


@dataclass(frozen=True)
class DistillSettings:
    """What the rows of a distillation pass need (``objective`` and ``objective.distill``)."""

    loss: str = "reverse_kl_sampled"
    beta: float = 0.5
    rl: RLSettings = field(default_factory=RLSettings)
    """The aggregation (the coefficients ``c``) and, for ``reverse_kl_sampled``, the clip."""

    @classmethod
    def of(cls, objective) -> DistillSettings:
        """From the config's ``objective`` section."""
        return cls(objective.distill.loss, objective.distill.beta, objective.rl_settings())

    @property
    def full_vocabulary(self) -> bool:
        return self.loss in FULL_VOCABULARY


@dataclass
class TeacherDivergence:
    """The head :data:`~ds_tree.models.logprobs.Statistic` of one forward's targets: each target's divergence
    from the teacher, whose log-probs the teacher's head gives on the same chunk of its hidden states."""

    head: HeadOf
    hidden: torch.Tensor
    """``[targets of the forward, hidden]``: the teacher's hidden states predicting them."""
    settings: DistillSettings

    def __call__(self, log_softmax: torch.Tensor, rows: slice) -> torch.Tensor:
        teacher = self.head.log_softmax(self.hidden[rows])
        return divergence(log_softmax, teacher, self.settings.loss, self.settings.beta)


@dataclass
class DistillRow:
    """A row ready for a full-vocabulary update: its targets, their weights and the teacher's hidden states."""

    row: PackedRow
    targets: np.ndarray
    weight: np.ndarray
    """``sum_i c_i`` per target: the restoration weight of its divergence."""
    tokens: np.ndarray
    """``sum_i m_i`` per target (metrics: the flat batch's trained-token count)."""
    hidden: torch.Tensor


def coefficient_sums(row: PackedRow, settings: RLSettings, normalisers: StepNormalisers) -> TokenSums:
    """The per-token sums of ``row`` with every advantage 0: ``weight`` (``sum_i c_i``) and ``tokens``."""
    copies = trajectory_copies(row)
    zero = {id(t): np.zeros(len(t)) for t, _ in copies}
    return row_sums(row, copies, zero, settings, normalisers)


def prepare_distill_rows(
    model,
    teacher,
    rows: Sequence[PackedRow],
    settings: DistillSettings,
    normalisers: StepNormalisers,
    run: RunContext,
    head: HeadOf | None = None,
) -> list[RLRow] | list[DistillRow]:
    """Every row of a distillation pass ready for its updates (no gradient; module docstring): ``model`` the
    student before the updates, ``teacher`` the frozen teacher, ``head`` its head (full-vocabulary losses).
    One teacher forward per row (per chunk of a walked one), evened out over the ranks when its forwards
    gather collectively (a ZeRO-3 teacher walking trees), as the KL reference's are."""
    if not settings.full_vocabulary:
        return _sampled_rows(model, teacher, rows, settings, normalisers, run)
    lockstep = run.dfs is not None and run.dfs.lockstep and in_process_group()
    if lockstep and gathers_collectively(teacher):
        even_out_forwards(teacher, rows, run)
    prepared = []
    for row in rows:
        sums = coefficient_sums(row, settings.rl, normalisers)
        targets = sums.active()
        hidden = runner_of(row).hidden_states(teacher, row, targets, run)
        prepared.append(DistillRow(row, targets, sums.weight[targets], sums.tokens[targets], hidden))
    return prepared


def _sampled_rows(model, teacher, rows, settings: DistillSettings, normalisers, run: RunContext) -> list[RLRow]:
    """``reverse_kl_sampled``: the clipped objective's rows, the teacher as the reference whose log-probs give
    each target's advantage ``log p - log q_old`` (its sums: those of every trajectory through the token
    having that advantage)."""
    copies = {id(t): np.zeros(len(t)) for row in rows for t, _ in trajectory_copies(row)}
    prepared = prepare_rl_rows(
        model,
        rows,
        copies,
        settings.rl,
        normalisers,
        reference=teacher,
        device=run.device,
        head_chunk=run.head_chunk,
        dfs=run.dfs,
    )
    for item in prepared:
        advantage = item.logp_ref - item.logp_old
        sums = item.sums
        scaled = sums.weight * advantage
        item.sums = TokenSums(
            positive=np.where(advantage >= 0, scaled, 0.0),
            negative=np.where(advantage < 0, scaled, 0.0),
            weight=sums.weight,
            tokens=sums.tokens,
            positive_tokens=np.where(advantage > 0, sums.tokens, 0.0),
            negative_tokens=np.where(advantage < 0, sums.tokens, 0.0),
        )
    return prepared


def sampled_divergence(item: RLRow) -> float:
    """``sum_t tokens_t (log q_old - log p)`` over a prepared ``reverse_kl_sampled`` row's targets."""
    return float(np.sum(item.sums.tokens * (item.logp_old - item.logp_ref)))


def distill_terms(item: RLRow | DistillRow, settings: DistillSettings, head: HeadOf | None = None) -> RowTerms:
    """A prepared row's share of the loss (:class:`~ds_tree.losses.terms.RowTerms`)."""
    if isinstance(item, RLRow):
        return rl_terms(_without_reference(item), settings.rl)

    def loss(logp: torch.Tensor, values: torch.Tensor, select: np.ndarray) -> tuple[torch.Tensor, dict]:
        weight = torch.as_tensor(item.weight[select], dtype=values.dtype, device=values.device)
        tokens = torch.as_tensor(item.tokens[select], dtype=values.dtype, device=values.device)
        metrics = {"tokens": float(tokens.sum()), "divergence": float((tokens * values.detach()).sum())}
        return (weight * values).sum(), metrics

    def statistic(select: np.ndarray) -> TeacherDivergence:
        return TeacherDivergence(head, item.hidden[torch.as_tensor(select, device=item.hidden.device)], settings)

    return RowTerms(item.targets, loss, statistic=statistic)


def _without_reference(item: RLRow) -> RLRow:
    """The row as the clipped objective takes it: the teacher's log-probs gave the advantages, no KL term."""
    return RLRow(item.row, item.targets, item.sums, item.logp_old, None)


def run_distill_rows(model, prepared, settings: DistillSettings, run: RunContext, backward_for, head=None):
    """Forward and backward of every prepared row (:func:`~ds_tree.engine.runners.run_items`)."""
    terms = [distill_terms(item, settings, head) for item in prepared]
    return run_items(model, [item.row for item in prepared], terms, run, backward_for)


def summed_metrics(prepared, outputs: Sequence[StepOutput], settings: DistillSettings) -> dict[str, float]:
    """``tokens`` and ``divergence`` over the ranks: a full-vocabulary pass's from its updates' outputs (the
    first epoch's: the divergence at the start of the updates), a sampled one's from the prepared rows."""
    local = np.zeros(len(DISTILL_METRICS))
    if settings.full_vocabulary:
        for output in outputs[: len(prepared)]:
            local += [(output.metrics or {}).get(name, 0.0) for name in DISTILL_METRICS]
    else:
        for item in (item for items in prepared for item in items):
            local += [item.sums.tokens.sum(), sampled_divergence(item)]
    values = torch.as_tensor(local, dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(DISTILL_METRICS, values.tolist(), strict=True))


@dataclass
class DistillStep(Prepared):
    """One distillation step's trajectories, ready for its updates."""

    rows: list[list] = field(default_factory=list)
    """This rank's prepared rows of each mini-batch."""
    statistics: StepStatistics | None = None
    """The step's reward statistics over every rank's groups (``reward_mean`` NaN: no rewards)."""


class Distill(Objective):
    """``objective.kind: distill`` (module docstring). The teacher is checked when the objective is made,
    before any model is built (:func:`~ds_tree.model_roles.teacher.check_teacher`)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        check_teacher(config)
        self.settings = DistillSettings.of(config.objective)
        self.teacher = None
        """The frozen teacher (a model, or a ZeRO-3 engine), once built."""
        self.head: HeadOf | None = None
        """Its LM head, whole, for the full-vocabulary losses."""
        self.warmup = Demonstrations(config)

    def check_data(self, trajectories: list[Trajectory]) -> None:
        mini_batches = self.config.objective.mini_batches
        if mini_batches > self.config.data.groups_per_step:
            raise ConfigError(
                f"objective.mini_batches ({mini_batches}) is more than data.groups_per_step "
                f"({self.config.data.groups_per_step}): a mini-batch is a set of whole groups"
            )

    def build(self, components: Components) -> None:
        config = self.config
        self.teacher = frozen_model(
            config,
            components.policy,
            components.ds_config,
            components.hf_deepspeed_config,
            source=config.objective.teacher,
        )
        if self.settings.full_vocabulary:
            self.head = head_of(self.teacher)

    def objective_of(self, step: int, context: StepContext) -> Objective:
        """A multi-turn run's warm-up and refresh steps sample nothing: SFT on demonstrations trains them."""
        online = context.online
        return self.warmup if online is not None and not online.samples(step) else self

    def prepare_step(self, step: int, context: StepContext) -> DistillStep:
        """``step``'s host work, the RL step's without advantages (:func:`rl_host_work`: mini-batches of whole
        groups, this rank's items of each, their normalisers and the reward statistics over the ranks; offline
        data planned one step ahead, online this rank's own rollouts), then this rank's rows of each mini-batch
        scored by the teacher and the student as the step starts."""
        objective = self.config.objective
        settings = context.layout.plan_settings()
        host = context.host_step(
            step, lambda at: rl_host_work(settings, None, objective.mini_batches, context.wants_check(at))
        )
        done = host.result
        run = RunContext(context.policy.device, self.config.model.head_chunk, context.layout.dfs_settings())
        rows = [
            prepare_distill_rows(context.policy, self.teacher, plan.rows, self.settings, normalisers, run, self.head)
            for plan, normalisers in zip(done.plans, done.normalisers, strict=True)
        ]
        updates = [
            Update(plan, [distill_terms(item, self.settings, self.head) for item in items])
            for plan, items in zip(done.plans, rows, strict=True)
        ]
        return DistillStep(
            done.trajectories,
            updates,
            epochs=objective.ppo_epochs,
            untrained=sum(n.total_tokens for n in done.normalisers) == 0,
            check_sample=done.sample,
            planning=host.scalars(),
            rows=rows,
            statistics=done.statistics,
        )

    def check_inputs(self, prepared: DistillStep, context: StepContext) -> DistillCheck:
        return DistillCheck(prepared.check_sample, self.settings, self.teacher, self.head)

    def step_metrics(
        self, prepared: DistillStep, outputs: list[StepOutput], losses: list[float], context: StepContext
    ) -> dict[str, float]:
        """``distill/divergence`` per trained token (the step's start), rewards where the trajectories have them
        (online: the student's), the router loss's and online RL's ``rollout/`` scalars."""
        sums = summed_metrics(prepared.rows, outputs, self.settings)
        scalars = {"distill/divergence": sums["divergence"] / sums["tokens"] if sums["tokens"] else float("nan")}
        statistics = prepared.statistics
        if not np.isnan(statistics.reward_mean):  # NaN: no trajectory of the step has a reward
            scalars |= {"distill/reward_mean": statistics.reward_mean, "distill/reward_std": statistics.reward_std}
        scalars.update(router_scalars(outputs))
        if context.online is not None:
            scalars.update(context.online.scalars)
        return scalars


@dataclass
class DistillCheck:
    """Distillation on the self-check's sample (:class:`~ds_tree.engine.self_check.CheckedObjective`): each
    side prepares its items with the model as it is after the step (the student's old log-probs: its own)."""

    sample: list[Trajectory]
    settings: DistillSettings
    teacher: object
    head: HeadOf | None
    targets_only = True

    def run(self, model, items, group_items, backward, run: RunContext) -> StepOutput:
        prepared = prepare_distill_rows(
            model, self.teacher, items, self.settings, StepNormalisers.of(self.sample), run, self.head
        )
        return run_distill_rows(model, prepared, self.settings, run, lambda _: backward, self.head)
