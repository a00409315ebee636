"""One runner per execution kind, one entry point for every objective (docs/DESIGN.md, "Architecture").

The step plan (:mod:`ds_tree.packing.plan`) gives each rank a list of work items whose class names
their kind (``packed``, ``walked``, ``shard``, ``walked_shard``). :func:`run_items` runs them as one gradient
accumulation: each item's :class:`Runner`, looked up in :data:`ds_tree.registries.RUNNERS` by kind, turns it and its
share of the objective (:class:`~ds_tree.losses.terms.RowTerms`) into a task of model calls
(:mod:`ds_tree.engine.calls`). The objective never sees the kind, and a runner never sees the
objective: a new kind is one runner and its registration (``RUNNERS.register(kind, runner)``).

- :class:`PackedRunner` (``packed``, and ``shard``: a sequence-parallel shard is a packed row whose
  inputs are cut to the shard, :class:`~ds_tree.packing.sequence_parallel.RowShard`): one forward
  of the row, the log-probs of all its targets, one backward.
- :class:`WalkedRunner` (``walked``): the dfs walk (:mod:`ds_tree.engine.dfs`), one forward and
  backward per chunk, each chunk scoring the targets it predicts.
- ``walked_shard`` (:mod:`ds_tree.engine.dfs_sequence_parallel`): the walk of a tree by its
  sequence-parallel group, each rank forwarding one shard of every chunk.

Every runner also gives no-grad log-probs of chosen targets (the RL objective's old and reference
policies) and no-grad hidden states predicting them (on-policy distillation's teacher, whose head is
applied beside the student's), and with :attr:`RunContext.collect_logprobs` the log-probs its forwards
computed. What a forward gives per target is :attr:`RunContext.head`'s: a causal LM's log-probs (and
entropies), or a value model's values (:func:`~ds_tree.model_roles.values.values_at`, PPO's critic), whatever the kind.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ds_tree.engine.calls import UPDATE, DeferredBackward, Task, run_to_end
from ds_tree.engine.dfs import (
    ChunkInputs,
    DfsSettings,
    WalkedRouterLoss,
    WalkStats,
    row_chunks,
    run_calls,
    walk,
    walk_events,
    walk_hidden_states,
    walk_logprobs,
)
from ds_tree.losses.sft import weighted_nll
from ds_tree.losses.terms import RowTerms
from ds_tree.models.logprobs import hidden_states_at, logprobs_and_entropy_at
from ds_tree.models.moe import RouterAuxLoss, captured_router_logits
from ds_tree.packing.rows import PackedRow
from ds_tree.registries import RUNNERS


@dataclass
class StepOutput:
    """What one accumulation's items add up to (this rank's share)."""

    loss: float = 0.0
    """Sum over items of the (unscaled) loss, the router loss's term included."""
    router_aux: float | None = None
    """The items' share of the router load-balancing loss, before its coefficient (MoE models only)."""
    metrics: dict[str, float] | None = None
    """Sums of the objective's metrics over targets (``ratio_max`` by max); None when it has none."""
    trajectory_logprobs: dict[int, np.ndarray] = field(default_factory=dict)
    """``id(trajectory) -> log p`` of its tokens 1.. where an item scored them, NaN elsewhere
    (:attr:`RunContext.collect_logprobs`)."""

    def add_metrics(self, new: dict[str, float] | None) -> None:
        if new is not None:
            self.metrics = add_metrics(self.metrics, new)


def add_metrics(total: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
    """Metric sums added up (``ratio_max`` by max)."""
    if total is None:
        return dict(new)
    return {name: max(total[name], v) if name == "ratio_max" else total[name] + v for name, v in new.items()}


@dataclass
class RunContext:
    """How this accumulation's items run, whatever the objective."""

    device: torch.device | str = "cpu"
    head_chunk: int = 0
    """See :mod:`ds_tree.models.logprobs`."""
    dfs: DfsSettings | None = None
    """How walked items are walked; None when no item is (then every rank runs as many packed rows)."""
    router_aux: RouterAuxLoss | None = None
    """An MoE model's load-balancing loss, added to each item's loss."""
    collect_logprobs: bool = False
    """Record every trajectory's log-probs at the items' targets in :attr:`StepOutput.trajectory_logprobs`
    (:func:`record_logprobs`), from the forwards with gradients: no extra forward, whatever the kind."""
    stats: WalkStats | None = None
    head: Callable = logprobs_and_entropy_at
    """What a forward gives per target: ``head(model, inputs, predictors, labels, device, entropy=, head_chunk=)
    -> (per-target values, entropies or None)``; the LM's log-probs, or a value model's values
    (:func:`~ds_tree.model_roles.values.values_at`)."""


class Runner(Protocol):
    def task(self, model, row: PackedRow, terms: RowTerms, run: RunContext, backward, output: StepOutput) -> Task:
        """The calls that forward ``row``, add its loss (``terms``) to ``output`` and hand it to ``backward``."""

    def logprobs(self, model, row: PackedRow, targets: np.ndarray, run: RunContext) -> np.ndarray:
        """``log p`` of ``targets`` (row indices) without gradients."""

    def hidden_states(self, model, row: PackedRow, targets: np.ndarray, run: RunContext) -> torch.Tensor:
        """``[len(targets), hidden]``: the final hidden states predicting ``targets`` (row indices), without
        gradients, in as many forwards as :meth:`logprobs` (a teacher's, whose head is applied later)."""

    def forwards(self, row: PackedRow, run: RunContext) -> int:
        """The model forwards :meth:`logprobs` (or :meth:`hidden_states`) makes."""


def record_logprobs(output: StepOutput, row: PackedRow, by_token: np.ndarray) -> None:
    """Every trajectory laid out in ``row`` gets ``by_token`` at its tokens 1.. in
    :attr:`StepOutput.trajectory_logprobs` (NaN where this item scored none: a shard's targets predicted
    from other shards). The row's layout parts, so every shard of a row reports its own targets."""
    offset = 0
    for part in row.layout_parts:
        for trajectory_id, path in zip(part.trajectory_ids, part.paths, strict=True):
            output.trajectory_logprobs[id(part.tree.trajectories[trajectory_id])] = by_token[path[1:] + offset]
        offset += part.n_tokens


def _zero_loss(model, inputs, run: RunContext) -> torch.Tensor:
    """A forward scoring one position with weight 0 (label 0: any model's head has one): an item (or chunk) with
    nothing to train still runs forward and backward through every parameter, as ZeRO-3's collective gathers
    need."""
    one = np.zeros(1, np.int64)
    outputs, _ = run.head(model, inputs, one, one, run.device, entropy=None, head_chunk=run.head_chunk)
    return weighted_nll(outputs, np.zeros(1))


class PackedRunner:
    """A row forwarded and backwarded at once (module docstring)."""

    def task(self, model, row, terms, run, backward, output) -> Task:
        def call() -> None:
            targets = terms.targets
            with captured_router_logits(model, enabled=run.router_aux is not None) as router_logits:
                if targets.size == 0:
                    loss, logp = _zero_loss(model, row, run), None
                else:
                    if np.any(row.pred_pos[targets] < 0):
                        raise ValueError("a target token has no prediction (a root's first token or padding)")
                    logp, entropy = run.head(
                        model,
                        row,
                        row.pred_pos[targets],
                        row.input_ids[targets],
                        run.device,
                        entropy=terms.head_statistic(np.arange(targets.size)),
                        head_chunk=run.head_chunk,
                    )
                    loss, metrics = terms.loss(logp, entropy, np.arange(targets.size))
                    output.add_metrics(metrics)
            if run.router_aux is not None:
                aux = run.router_aux.row_share(router_logits, row)
                loss = loss + run.router_aux.coefficient * aux.to(loss.dtype)
                output.router_aux += float(aux.detach())
            backward(loss)
            output.loss += float(loss.detach())
            if run.collect_logprobs:  # every trajectory, even a 1-token one with nothing to predict
                by_token = np.full(row.n_tokens, np.nan)
                if logp is not None:
                    by_token[targets] = logp.detach().double().cpu().numpy()
                record_logprobs(output, row, by_token)

        def calls() -> Generator[None, None, None]:
            call()
            yield

        return Task([UPDATE], calls())

    @torch.no_grad()
    def logprobs(self, model, row, targets, run) -> np.ndarray:
        if targets.size == 0:
            _zero_loss(model, row, run)
            return np.zeros(0)
        predictors, labels = row.pred_pos[targets], row.input_ids[targets]
        logprobs, _ = run.head(model, row, predictors, labels, run.device, entropy=None, head_chunk=run.head_chunk)
        return logprobs.double().cpu().numpy()

    @torch.no_grad()
    def hidden_states(self, model, row, targets, run) -> torch.Tensor:
        if targets.size == 0:
            _zero_loss(model, row, run)  # the forward every rank makes
            return torch.zeros(0, device=run.device)
        return hidden_states_at(model, row, row.pred_pos[targets], run.device)

    def forwards(self, row, run) -> int:
        return 1


class WalkedRunner:
    """A tree walked depth-first in chunks (:mod:`ds_tree.engine.dfs`)."""

    @staticmethod
    def chunks(row: PackedRow, run: RunContext):
        if run.dfs is None:
            raise ValueError("a walked (dfs) item needs the dfs settings")
        return row_chunks(row, run.dfs.chunk)

    def task(self, model, row, terms, run, backward, output) -> Task:
        chunks = self.chunks(row, run)
        target_chunk = chunks.of_tokens(row.pred_pos[terms.targets])
        by_token = np.full(row.n_tokens, np.nan) if run.collect_logprobs else None

        def chunk_loss(index: int, inputs: ChunkInputs) -> torch.Tensor:
            mine = np.flatnonzero(target_chunk == index)
            if mine.size == 0:
                return _zero_loss(model, inputs, run)
            targets = terms.targets[mine]
            logp, entropy = run.head(
                model,
                inputs,
                chunks.local(row.pred_pos[targets]),
                row.input_ids[targets],
                run.device,
                entropy=terms.head_statistic(mine),
                head_chunk=run.head_chunk,
            )
            loss, metrics = terms.loss(logp, entropy, mine)
            output.add_metrics(metrics)
            if by_token is not None:  # each target is scored in the one chunk (and shard) predicting it
                by_token[targets] = logp.detach().double().cpu().numpy()
            return loss

        router = WalkedRouterLoss(run.router_aux, row, chunks) if run.router_aux is not None else None

        def calls() -> Generator[None, None, None]:
            output.loss += yield from walk(
                model, row, chunks, chunk_loss, run.dfs, backward, run.stats, run.device, router
            )
            if router is not None:
                output.router_aux += router.total
            if by_token is not None:
                record_logprobs(output, row, by_token)

        return Task(walk_events(chunks, run.dfs.recompute), calls())

    def logprobs(self, model, row, targets, run) -> np.ndarray:
        chunks = self.chunks(row, run)
        walked = walk_logprobs(model, row, chunks, targets, device=run.device, head_chunk=run.head_chunk, head=run.head)
        return run_to_end(walked)

    def hidden_states(self, model, row, targets, run) -> torch.Tensor:
        chunks = self.chunks(row, run)
        return run_to_end(walk_hidden_states(model, row, chunks, targets, device=run.device))

    def forwards(self, row, run) -> int:
        return len(self.chunks(row, run))


PACKED = PackedRunner()
"""The runner of ``packed`` rows and ``shard`` s (:data:`ds_tree.registries.RUNNERS`)."""
WALKED = WalkedRunner()
"""The runner of ``walked`` trees."""


def runner_of(row: PackedRow) -> Runner:
    """The runner registered for ``row``'s kind (:data:`ds_tree.registries.RUNNERS`)."""
    return RUNNERS.get(row.kind)


def run_items(
    model,
    rows: Sequence[PackedRow],
    terms: Sequence[RowTerms],
    run: RunContext,
    backward_for: Callable[[int], Callable[[torch.Tensor], None]],
) -> StepOutput:
    """Every item's forward and backward as one accumulation (module docstring).

    ``backward_for(n)`` gives the ``backward`` of ``n`` calls. Without walked items every rank
    runs as many packed rows, each one call; with them the calls are counted first and evened out
    over ranks, and under ZeRO-3 made in lockstep (:func:`ds_tree.engine.dfs.run_calls`).
    """
    output = StepOutput(router_aux=None if run.router_aux is None else 0.0)
    backward = DeferredBackward()
    tasks = [runner_of(row).task(model, row, t, run, backward, output) for row, t in zip(rows, terms, strict=True)]
    if run.dfs is None:
        backward.function = backward_for(len(tasks))
        for task in tasks:
            task.finish()
    else:
        run_calls(model, tasks, run.dfs, backward, backward_for, run.device)
    return output
