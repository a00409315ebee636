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
from ds_tree.engine.runners import RunContext, StepOutput, run_items
from ds_tree.engine.self_check import sample_groups
from ds_tree.losses.sft import Normalisers, restoration_weights
from ds_tree.losses.terms import RowTerms, sft_terms
from ds_tree.models.logprobs import predicted_tokens
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.objectives.base import Objective, Prepared, StepContext, Update
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.trajectory import Trajectory


def global_normalisers(rows: Sequence[PackedRow]) -> Normalisers:
    """This rank's :meth:`~ds_tree.losses.sft.Normalisers.from_rows` summed over all ranks (one all-reduce of
    three float64 scalars, before the step's first forward): every row's loss is then a term of the global
    objective."""
    values = Normalisers.from_rows(rows).as_tensor()
    dist.all_reduce(values)
    return Normalisers.from_tensor(values)


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
        return self.prepared([context.trajectories(step)], context)

    def prepared(self, batches: list[list[Trajectory]], context: StepContext) -> Prepared:
        """One update per batch of trajectories: this rank's plan, its normalisers summed over the ranks,
        each row's restoration-weighted NLL."""
        objective = self.config.objective
        updates, trained = [], False
        for trajectories in batches:
            plan = context.plan(trajectories)
            normalisers = global_normalisers(plan.rows)
            trained = trained or normalisers.target_tokens != 0
            updates.append(Update(plan, row_terms(plan.rows, normalisers, objective.normalisation, objective.policy)))
        return Prepared([t for batch in batches for t in batch], updates, untrained=not trained)

    def check_inputs(self, prepared: Prepared, context: StepContext) -> SFTCheck:
        return SFTCheck(sample_groups(prepared.trajectories), self.config.objective.normalisation)


class Demonstrations(SFT):
    """A warm-up (or refresh) step of a multi-turn RL run (``rollout.env.warmup_steps``, ``refresh_every``):
    as many SFT updates as an RL step has (the learning-rate schedule counts them alike), each on the
    environment's demonstrations (docs/ENVIRONMENTS.md), an MoE model's router loss included."""

    def prepare_step(self, step: int, context: StepContext) -> Prepared:
        updates = range(self.config.objective.updates_per_step)
        return self.prepared([context.online.demonstrations(step, update) for update in updates], context)

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
