"""Direct preference optimisation on trees (``objective.kind: dpo``; docs/RL.md, "DPO").

A step's trajectories are whole trees of the data; their preference pairs are the trees' sibling pairs
(:func:`~ds_tree.trees.pairs.preference_pairs`: a converted preference record is a tree of its prompt and its
two answers; a tree with rewards gives every fork's pairs). The loss (:mod:`ds_tree.losses.dpo`) is nonlinear
in each sequence's summed log-prob ``z_s``, so a step makes two passes over its planned rows:

1. without gradient, :func:`sequence_sums`: every paired sequence's ``z_s`` under the policy and under the
   reference (the frozen initial policy, ``objective.reference``, or under ``model.lora`` the policy with its
   adapters off), each tree token scored once per model and its log-prob added to every sequence through it,
   the sums of all ranks' items (packed rows, walked trees, sequence-parallel shards) all-reduced; the pairs'
   derivatives ``g_s = dL / dz_s`` follow (:func:`~ds_tree.losses.dpo.pair_statistics`);
2. the update: each row's terms are the linear ``sum_t w_t log pi_t``, ``w_t = sum_{s through t} g_s m_st``
   (:func:`linear_terms`), whose gradient is exactly DPO's at these weights, run by the runners of the rows'
   kinds like any objective's. The loss reported is ``L`` from the sums.
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
from ds_tree.engine.self_check import sample_groups
from ds_tree.losses.dpo import DPOLoss, PairStatistics, pair_statistics, sequence_mask
from ds_tree.losses.terms import RowTerms, sft_terms
from ds_tree.objectives.base import Components, Objective, Prepared, StepContext, Update, router_scalars
from ds_tree.objectives.reference import frozen_model
from ds_tree.objectives.rl_rows import even_out_forwards, gathers_collectively, trajectory_copies
from ds_tree.packing.distributed import SHARED_KINDS
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.pairs import preference_pairs
from ds_tree.trees.trajectory import Trajectory


@dataclass
class RowSequences:
    """Where a row's owned, trained tokens sit in the paired sequences: entry ``j`` adds ``mask[j]`` times the
    log-prob of row token ``token[j]`` to sequence ``sequence[j]``."""

    sequence: np.ndarray
    token: np.ndarray
    mask: np.ndarray

    @classmethod
    def of(cls, row: PackedRow, index: dict[int, int], masks: Sequence[np.ndarray]) -> RowSequences:
        """``index``: ``id(trajectory) -> sequence`` of the paired ones; ``masks``: each sequence's ``m_s``."""
        sequence, token, mask = [], [], []
        for trajectory, path in trajectory_copies(row):
            s = index.get(id(trajectory))
            if s is None:
                continue
            present = np.flatnonzero(path[1:] >= 0) + 1
            present = present[row.owned[path[present]] & (masks[s][present] != 0)]
            sequence.append(np.full(present.size, s))
            token.append(path[present])
            mask.append(masks[s][present])
        if not sequence:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
        return cls(np.concatenate(sequence), np.concatenate(token), np.concatenate(mask))

    def targets(self) -> np.ndarray:
        """The row tokens whose log-probs the sums need (each once)."""
        return np.unique(self.token)


@dataclass
class Pairs:
    """A step's (or a sample's) preference pairs over its paired sequences."""

    sequences: list[Trajectory]
    """The trajectories in some pair, in the step's order."""
    pairs: list[tuple[int, int]]
    """``(chosen, rejected)`` indices into :attr:`sequences`."""
    masks: list[np.ndarray]
    """Each sequence's ``m_s`` (:func:`~ds_tree.losses.dpo.sequence_mask`)."""

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory], merge: str, loss: DPOLoss) -> Pairs:
        found = preference_pairs(trajectories, merge)
        paired = sorted({i for pair in found for i in pair})
        index = {position: s for s, position in enumerate(paired)}
        sequences = [trajectories[i] for i in paired]
        masks = [sequence_mask(t, loss.averaged()) for t in sequences]
        return cls(sequences, [(index[c], index[r]) for c, r in found], masks)

    def index(self) -> dict[int, int]:
        return {id(t): s for s, t in enumerate(self.sequences)}


def sequence_sums(
    model, reference, rows: Sequence[PackedRow], pairs: Pairs, run: RunContext, *, reduce: bool = True, group=None
) -> tuple[np.ndarray, np.ndarray]:
    """``z`` of every paired sequence under ``model`` and under ``reference`` (no gradient); with ``reduce``
    summed over the ranks of ``group`` (the default group: every rank's items). One forward of each model per
    row (per chunk of a walked one), evened out over the ranks first where its forwards gather collectively
    (ZeRO-3 walks, as the RL objective's old and reference passes are)."""
    located = [RowSequences.of(row, pairs.index(), pairs.masks) for row in rows]
    sums = np.zeros((2, len(pairs.sequences)))
    lockstep = run.dfs is not None and run.dfs.lockstep and in_process_group()
    for side, scorer in enumerate((model, reference)):
        if lockstep and gathers_collectively(scorer):
            even_out_forwards(scorer, rows, run)
        for row, where in zip(rows, located, strict=True):
            targets = where.targets()
            by_token = np.zeros(row.n_tokens)
            by_token[targets] = runner_of(row).logprobs(scorer, row, targets, run)
            np.add.at(sums[side], where.sequence, where.mask * by_token[where.token])
    if reduce and in_process_group():
        total = torch.as_tensor(sums)
        dist.all_reduce(total, group=group)
        sums = total.numpy()
    return sums[0], sums[1]


def linear_terms(row: PackedRow, pairs: Pairs, derivatives: np.ndarray) -> RowTerms:
    """The row's share of the update (module docstring): ``sum_t w_t log pi_t``, the weighted NLL of ``-w``."""
    where = RowSequences.of(row, pairs.index(), pairs.masks)
    weights = np.bincount(where.token, weights=derivatives[where.sequence] * where.mask, minlength=row.n_tokens)
    return sft_terms(-weights)


@dataclass
class DPOUpdate(Update):
    """An update of a DPO step, with its share of the step's loss ``L``."""

    loss_share: float = 0.0
    """``L`` on rank 0, 0 elsewhere: the all-reduced update loss is ``L`` (the surrogate's value is not)."""


@dataclass
class DPOStep(Prepared):
    statistics: PairStatistics | None = None
    pairs: Pairs | None = field(default=None, repr=False)


class DPO(Objective):
    """``objective.kind: dpo`` (module docstring): one update a step, on the step's trees."""

    def __init__(self, config) -> None:
        super().__init__(config)
        settings = config.objective.dpo
        self.loss = DPOLoss(settings.beta, settings.loss, settings.label_smoothing)
        self.reference = None
        """The frozen reference (a model, a ZeRO-3 engine, or the policy with its adapters off), once built."""

    def check_data(self, trajectories: list[Trajectory]) -> None:
        """Preference pairs exist (``dpo.pairs: siblings``): else a config error saying where pairs come from."""
        if not preference_pairs(trajectories, self.config.data.merge):
            with_rewards = sum(t.reward is not None for t in trajectories)
            raise ConfigError(
                f"data.path: no preference pairs in {len(trajectories)} trajectories ({with_rewards} with a reward): "
                "objective.kind dpo pairs the sibling branches of a tree that end one node after their fork and "
                "have different rewards; convert TRL preference records (prompt, chosen, rejected) with "
                "ds-tree convert --format preference, or give trees whose branches carry rewards"
            )

    def build(self, components: Components) -> None:
        self.reference = frozen_model(
            self.config, components.policy, components.ds_config, components.hf_deepspeed_config
        )

    def prepare_step(self, step: int, context: StepContext) -> DPOStep:
        trajectories = context.trajectories(step)
        pairs = Pairs.of(trajectories, self.config.data.merge, self.loss)
        plan = context.plan(pairs.sequences or trajectories)  # a trajectory in no pair has nothing to train
        run = RunContext(context.policy.device, self.config.model.head_chunk, context.layout.dfs_settings())
        policy, reference = sequence_sums(context.policy, self.reference, plan.rows, pairs, run)
        statistics = pair_statistics(policy, reference, pairs.pairs, self.loss)
        terms = [linear_terms(row, pairs, statistics.derivatives) for row in plan.rows]
        share = statistics.loss if context.rank == 0 else 0.0
        return DPOStep(
            trajectories,
            [DPOUpdate(plan, terms, loss_share=share)],
            untrained=not pairs.pairs,
            statistics=statistics,
            pairs=pairs,
        )

    def run_update(self, update: DPOUpdate, context: StepContext) -> StepOutput:
        """The surrogate's gradient, reported with the step's loss ``L`` (and an MoE model's router loss)."""
        run = context.run(context.router_aux(update.plan))
        output = run_items(context.policy, update.plan.rows, update.terms, run, context.updates.backward_for)
        router = 0.0 if run.router_aux is None else run.router_aux.coefficient * output.router_aux
        output.loss = update.loss_share + router
        return output

    def check_inputs(self, prepared: DPOStep, context: StepContext) -> DPOCheck:
        return DPOCheck(sample_groups(prepared.trajectories), self.loss, self.reference, self.config.data.merge)

    def step_metrics(
        self, prepared: DPOStep, outputs: list[StepOutput], losses: list[float], context: StepContext
    ) -> dict[str, float]:
        return {**prepared.statistics.scalars(), **router_scalars(outputs)}


@dataclass
class DPOCheck:
    """DPO on the self-check's sample (:class:`~ds_tree.engine.self_check.CheckedObjective`): each side sums its
    items with the model as it is after the step, and reports ``L`` (once per sequence-parallel group)."""

    sample: list[Trajectory]
    loss: DPOLoss
    reference: object
    merge: str = "group"
    targets_only = True

    def run(self, model, items, group_items, backward, run: RunContext) -> StepOutput:
        pairs = Pairs.of(self.sample, self.merge, self.loss)
        sharded = any(row.kind in SHARED_KINDS for row in items)
        group, first = None, True
        if sharded:
            from deepspeed.runtime.sequence_parallel import parallel_state_sp

            group = parallel_state_sp.get_sequence_parallel_group()
            first = dist.get_rank(group) == 0
        # sharded items: the group's sums; else this rank's own (every data-parallel group checks the sample)
        policy, reference = sequence_sums(model, self.reference, items, pairs, run, reduce=sharded, group=group)
        statistics = pair_statistics(policy, reference, pairs.pairs, self.loss)
        terms = [linear_terms(row, pairs, statistics.derivatives) for row in items]
        output = run_items(model, items, terms, run, lambda _: backward)
        output.loss = statistics.loss if first else 0.0
        return output
