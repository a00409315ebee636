"""Training steps of the objectives with a frozen second model, timed per mode (``ds-tree bench --objective
distill`` or ``dpo``; :func:`~ds_tree.bench.steps.run_benchmark` interleaves them as it does RL steps).

A step is the trainer's: pack the step's groups, the no-grad pass (distillation: the teacher's forward over
the items, and the student's old log-probs for ``reverse_kl_sampled``,
:func:`~ds_tree.objectives.distill.prepare_distill_rows`; DPO: every paired sequence's summed log-prob under the
policy and the reference, :func:`~ds_tree.objectives.dpo.sequence_sums`), then the update(s): forward and
backward of every row and an AdamW step (distillation: ``--ppo-epochs`` of them). The no-grad pass is reported
as ``old_forward``, the updates as ``updates``, as an RL step's are. The frozen model is built once and shared
by the modes (it does not train): the teacher (``--teacher``, at ``seed + 1``), or DPO's reference (the model
at ``seed``).
"""

from __future__ import annotations

import resource
import time

import torch

from ds_tree.bench.clock import synchronize
from ds_tree.engine.dfs import DfsSettings, WalkStats
from ds_tree.engine.runners import RunContext, run_items
from ds_tree.losses.dpo import DPOLoss, pair_statistics
from ds_tree.model_roles.teacher import head_of
from ds_tree.models.loading import load_model
from ds_tree.objectives.distill import DistillSettings, prepare_distill_rows, run_distill_rows
from ds_tree.objectives.dpo import Pairs, linear_terms, sequence_sums
from ds_tree.objectives.rl_rows import StepNormalisers
from ds_tree.packing.modes import pack_trajectories

FROZEN_MODEL_KINDS = ("distill", "dpo")
"""``objective.kind`` s timed here."""


class FrozenModel:
    """The frozen model of a benchmark's objective, and what a step of it needs (the teacher's head)."""

    def __init__(self, objective, model_source: str, attention: str, dtype: torch.dtype, seed: int, device) -> None:
        self.objective = objective
        teacher = objective.kind == "distill"
        source = objective.teacher if teacher else model_source
        with torch.device(device):
            self.model = load_model(source, attention=attention, dtype=dtype, seed=seed + 1 if teacher else seed)
        self.model.to(device).requires_grad_(False)
        self.distill = DistillSettings.of(objective) if teacher else None
        self.head = head_of(self.model) if teacher and self.distill.full_vocabulary else None
        dpo = objective.dpo
        self.loss = DPOLoss(dpo.beta, dpo.loss, dpo.label_smoothing)

    def trained(self, trajectories: list) -> list:
        """The trajectories a step trains: all of them (distillation), or those in some preference pair (DPO:
        a trajectory in no pair has nothing to train; the trainer packs the paired ones only), so the report's
        token counts are those of what is packed. A ValueError where DPO finds no pair."""
        if self.distill is not None:
            return trajectories
        paired = Pairs.of(trajectories, "group", self.loss).sequences
        if not paired:
            with_rewards = sum(t.reward is not None for t in trajectories)
            raise ValueError(
                f"--objective dpo: no preference pairs in {len(trajectories)} trajectories ({with_rewards} with a "
                "reward): sibling branches that end one node after their fork with different rewards, or "
                "TRL preference records through ds-tree convert --format preference"
            )
        return paired

    def step(self, model, optimizer, trajectories, mode: str, budget: int, block: int, dfs: DfsSettings, device):
        """One step of ``mode`` (module docstring): its times and counts as :class:`~ds_tree.bench.steps.ModeTimes`
        takes them."""
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        walk = dfs if mode == "dfs" else None
        started = time.perf_counter()
        pairs = Pairs.of(trajectories, "group", self.loss) if self.distill is None else None  # all paired: trained()
        rows = pack_trajectories(trajectories, mode, walk.chunk if walk else budget, block)
        packed = time.perf_counter()
        stats = WalkStats()
        run = RunContext(device, 0, walk, stats=stats)
        backward_for = lambda _: torch.Tensor.backward  # noqa: E731
        if self.distill is not None:
            normalisers = StepNormalisers.of(trajectories)
            prepared = prepare_distill_rows(model, self.model, rows, self.distill, normalisers, run, self.head)
            targets = sum(item.targets.size for item in prepared)
            update = lambda: run_distill_rows(model, prepared, self.distill, run, backward_for, self.head)  # noqa: E731
            epochs = self.objective.ppo_epochs
        else:
            policy, reference = sequence_sums(model, self.model, rows, pairs, run, reduce=False)
            statistics = pair_statistics(policy, reference, pairs.pairs, self.loss)
            terms = [linear_terms(row, pairs, statistics.derivatives) for row in rows]
            targets = sum(t.targets.size for t in terms)
            update = lambda: run_items(model, rows, terms, run, backward_for)  # noqa: E731
            epochs = 1
        synchronize(device)
        old_done = time.perf_counter()
        forward_backward = optimizer_time = 0.0
        for _ in range(epochs):
            epoch_started = time.perf_counter()
            update()
            synchronize(device)
            computed = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            forward_backward += computed - epoch_started
            optimizer_time += time.perf_counter() - computed
        done = time.perf_counter()
        return {
            "step": done - started,
            "pack": packed - started,
            "old_forward": old_done - packed,
            "updates": done - old_done,
            "forward_backward": forward_backward,
            "optimizer": optimizer_time,
            "packed_tokens": sum(row.n_tokens for row in rows),
            "visible_pairs": sum(part.visible_pairs for row in rows for part in row.parts),
            "targets": targets,
            "calls": stats.chunks // epochs if walk else len(rows),
            "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
        }
