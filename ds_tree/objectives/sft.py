"""The SFT objective (``objective.kind: sft``): the restoration-weighted next-token loss (docs/DESIGN.md
section 3), and the warm-up steps of a multi-turn RL run, which train it on the environment's
demonstrations.

:func:`run_rows` is the accumulation every entry point makes (trainer, ``verify``, ``bench``): each item's
restoration-weighted NLL (:func:`~ds_tree.losses.terms.sft_terms`) run with its kind's runner
(:func:`~ds_tree.engine.runners.run_items`): packed rows and sequence-parallel shards at once, walked trees
chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from ds_tree.engine.dfs import DfsSettings, WalkStats
from ds_tree.engine.plan_ahead import Timed
from ds_tree.engine.runners import RunContext, StepOutput, run_items
from ds_tree.losses.sft import Normalisers, restoration_weights
from ds_tree.losses.terms import RowTerms, sft_terms
from ds_tree.models.logprobs import predicted_tokens
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.objectives.base import HostWork, Objective, Prepared, StepContext, Update, check_sample
from ds_tree.packing.distributed import GroupUnits
from ds_tree.packing.exchange import Collectives
from ds_tree.packing.plan import PlanSettings, RankPlan
from ds_tree.packing.rows import PackedRow
from ds_tree.packing.step_units import StepData, plan_units
from ds_tree.trees.trajectory import Trajectory


def global_normalisers(rows: Sequence[PackedRow], comm: Collectives | None = None) -> Normalisers:
    """This rank's :meth:`~ds_tree.losses.sft.Normalisers.from_rows` summed over all ranks (one all-reduce of
    three float64 scalars, before the step's first forward; ``comm`` None: the default group): every row's
    loss is then a term of the global objective."""
    if comm is not None:
        return Normalisers.from_tensor(comm.all_reduce(Normalisers.from_rows(rows).as_tensor().numpy()))
    values = Normalisers.from_rows(rows).as_tensor()
    dist.all_reduce(values)
    return Normalisers.from_tensor(values)


@dataclass
class SFTHost:
    """An SFT step's host work (:func:`sft_host_work`): per update this rank's plan and the global normalisers."""

    plans: list[RankPlan]
    normalisers: list[Normalisers]
    trajectories: list[Trajectory]
    """What this rank holds of the step (:attr:`~ds_tree.objectives.base.Prepared.trajectories`)."""
    sample: list[Trajectory]


def sft_host_work(settings: PlanSettings, sample: bool) -> Callable[[Sequence[StepData], Collectives], SFTHost]:
    """Per update's data: this rank's plan (the per-rank planner) and the normalisers summed over the ranks;
    with ``sample`` the self-check's sample of the first update's data."""

    def work(updates: Sequence[StepData], comm: Collectives) -> SFTHost:
        plans, normalisers, held = [], [], []
        for data in updates:
            plan, planner = plan_units(data, settings, comm)
            plans.append(plan)
            normalisers.append(global_normalisers(plan.rows, comm))
            held.extend(t for trees in planner.built.values() for t in trees.trajectories)
        chosen = check_sample(updates[0], comm)[0] if sample and updates else []
        return SFTHost(plans, normalisers, held, chosen)

    return work


def row_terms(
    rows: Sequence[PackedRow],
    normalisers: Normalisers,
    normalisation: str = "token_mean",
    policy: str = "exact",
    collect_logprobs: bool = False,
) -> list[RowTerms]:
    """Each row's restoration-weighted NLL; with ``collect_logprobs`` every predicted token is a target (the
    log-probs of every trajectory are wanted), else only the tokens with a non-zero weight."""
    return [
        sft_terms(
            restoration_weights(row, normalisers, normalisation, policy),
            predicted_tokens(row) if collect_logprobs else None,
        )
        for row in rows
    ]


def run_rows(
    model: PreTrainedModel,
    rows: Sequence[PackedRow],
    normalisers: Normalisers,
    normalisation: str = "token_mean",
    policy: str = "exact",
    *,
    backward: Callable[[torch.Tensor], None] | None = None,
    backward_for: Callable[[int], Callable[[torch.Tensor], None]] | None = None,
    dfs: DfsSettings | None = None,
    collect_logprobs: bool = False,
    device: torch.device | str = "cpu",
    head_chunk: int = 0,
    router_aux: RouterAuxLoss | None = None,
    stats: WalkStats | None = None,
) -> StepOutput:
    """Forward every item of ``rows`` and hand its SFT loss to ``backward``.

    Only tokens with a non-zero weight reach the LM head, unless ``collect_logprobs`` asks for
    every trajectory's log-probabilities (then every predicted token of a packed row does). An item
    with nothing to train (an empty padding row) still runs forward and backward with a zero loss:
    under ZeRO-3 every rank must take part in the same number of forwards and backwards.
    ``backward_for(n)`` gives the ``backward`` of ``n`` calls instead of one ``backward``;
    ``dfs``: how walked items (:class:`~ds_tree.packing.dfs_rows.DfsRow`) are walked.
    ``head_chunk``: see :mod:`ds_tree.models.logprobs`. ``router_aux`` adds the router
    load-balancing loss (:mod:`ds_tree.models.moe`) to each item's loss.
    """
    terms = row_terms(rows, normalisers, normalisation, policy, collect_logprobs)
    run = RunContext(device, head_chunk, dfs, router_aux, collect_logprobs, stats)
    if backward_for is None:
        backward_for = lambda _: backward or (lambda loss: None)  # noqa: E731
    return run_items(model, rows, terms, run, backward_for)


@dataclass
class SFTCheck:
    """The SFT objective on the self-check's sample (:class:`~ds_tree.engine.self_check.CheckedObjective`)."""

    sample: list[Trajectory]
    normalisation: str = "token_mean"
    targets_only = False

    def run(self, model, items, group_items, backward, run: RunContext) -> StepOutput:
        terms = row_terms(items, Normalisers.from_rows(group_items), self.normalisation, collect_logprobs=True)
        return run_items(model, items, terms, run, lambda _: backward)


class SFT(Objective):
    """``objective.kind: sft``: one update a step on the step's groups (module docstring)."""

    def prepare_step(self, step: int, context: StepContext) -> Prepared:
        return self.prepared(context.host_step(step, lambda at: self.host_work(at, context)), context)

    def host_work(self, step: int, context: StepContext) -> HostWork:
        work = sft_host_work(context.layout.plan_settings(), context.wants_check(step))
        return lambda data, comm: work([data], comm)

    def prepared(self, host: Timed, context: StepContext) -> Prepared:
        """One update per planned batch: each row's restoration-weighted NLL with the batch's normalisers."""
        objective, done = self.config.objective, host.result
        updates = [
            Update(plan, row_terms(plan.rows, normalisers, objective.normalisation, objective.policy))
            for plan, normalisers in zip(done.plans, done.normalisers, strict=True)
        ]
        untrained = all(normalisers.target_tokens == 0 for normalisers in done.normalisers)
        return Prepared(
            done.trajectories, updates, untrained=untrained, check_sample=done.sample, planning=host.scalars()
        )

    def check_inputs(self, prepared: Prepared, context: StepContext) -> SFTCheck:
        return SFTCheck(prepared.check_sample, self.config.objective.normalisation)


class Demonstrations(SFT):
    """A warm-up (or refresh) step of a multi-turn RL run (``rollout.env.warmup_steps``, ``refresh_every``):
    as many SFT updates as an RL step has (the learning-rate schedule counts them alike), each on the
    environment's demonstrations (docs/ENVIRONMENTS.md), an MoE model's router loss included."""

    def prepare_step(self, step: int, context: StepContext) -> Prepared:
        updates = range(self.config.objective.updates_per_step)
        batches = [context.online.demonstrations(step, update) for update in updates]  # the same on every rank
        data = [StepData(GroupUnits.of_step(batch)) for batch in batches]
        work = sft_host_work(context.layout.plan_settings(), sample=False)
        return self.prepared(context.host_now(lambda comm: work(data, comm)), context)

    def check_inputs(self, prepared: Prepared, context: StepContext) -> None:
        return None  # the run's objective is RL's: its next RL step is checked

    def step_metrics(
        self, prepared: Prepared, outputs: list[StepOutput], losses: list[float], context: StepContext
    ) -> dict[str, float]:
        metrics = {"warmup/sft_loss": float(np.mean(losses))}
        online = context.online
        if online.ahead is not None:  # sampling ahead: the next RL step's weights were synced here
            metrics.update({"rollout/sync_s": online.sync_s, "rollout/wait_s": online.wait_s})
        return metrics
