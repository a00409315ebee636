"""The RL objective on packed rows: old/reference log-probs, per-token sums, loss and metrics.

The computation every entry point shares (the policy-gradient objective,
:mod:`ds_tree.objectives.policy_gradient`; ``verify``; ``bench``), in two passes over the same rows
(docs/RL.md):

1. :func:`prepare_rl_rows` (no gradient): per row, fold the trajectories through its tokens into
   per-token sums (:func:`ds_tree.losses.rl.token_sums`: the sign split of the clipped objective),
   choose the targets the LM head must score, and compute the old policy's log-probs there
   (recomputed by a forward, or read from the data) and the reference model's;
2. :func:`run_rl_rows`: forward each row with gradients and hand the clipped-objective loss of its
   targets to ``backward``; PPO epochs repeat this pass on the prepared rows.

Both passes run each row with its kind's runner (:mod:`ds_tree.engine.runners`: a packed row or a
sequence-parallel shard at once, a walked tree chunk by chunk), and one forward per row on every
rank, even for a row without targets, because ZeRO-3 gathers parameters collectively in every forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import PreTrainedModel

from ds_tree.engine.calls import NO_GRAD, in_process_group
from ds_tree.engine.dfs import DfsSettings, WalkStats, dummy_call
from ds_tree.engine.runners import RunContext, StepOutput, run_items, runner_of
from ds_tree.engine.self_check import merge_over_group
from ds_tree.errors import DataError
from ds_tree.losses.cppo import CPPOPairs, kept_sums, row_divergence, row_pairs
from ds_tree.losses.rl import RLSettings, TokenSums, ppo_tree_loss, token_sums, trajectory_coefficients
from ds_tree.losses.terms import RowTerms
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.packing.distributed import SHARED_KINDS
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import TokenTree

OLD_LOGPROBS = ("recompute", "data")

SHARED_LOGPROB_TOLERANCE = 1e-6
"""Largest difference between the sampler log-probs that trajectories through one tree token may
carry when ``old_logprobs: data`` (the tree shares one ratio per token, so they must agree)."""


@dataclass
class StepNormalisers:
    """The aggregation's global denominators over one optimizer step's trajectories (all ranks)."""

    total_tokens: float
    sequences: float

    @classmethod
    def of(cls, trajectories: Sequence[Trajectory]) -> StepNormalisers:
        trained = [t.trained_tokens for t in trajectories]
        return cls(float(sum(trained)), float(sum(count > 0 for count in trained)))


@dataclass
class RLRow:
    """One packed row ready for the loss pass."""

    row: PackedRow
    targets: np.ndarray
    """Row indices whose log-probs the loss needs (owned tokens with any non-zero sum)."""
    sums: TokenSums
    """Per-target sums (aligned with ``targets``)."""
    logp_old: np.ndarray
    logp_ref: np.ndarray | None
    cppo: CPPOPairs | None = None
    """With CPPO: the row's (path copy, trained token) pairs its mask reads (``targets`` then hold every trained
    token the row predicts, owned or not: a pair's prefix, :func:`cppo_targets`)."""
    cppo_mask: tuple[np.ndarray, np.ndarray] | None = None
    """With CPPO on a walked row: the update's mask sums per target (kept ``c A``, masked loss mask), from a no-grad
    walk before the update's (:func:`walked_cppo_masks`), since a walk scores the targets chunk by chunk."""


def trajectory_copies(row: PackedRow) -> list[tuple[Trajectory, np.ndarray]]:
    """``(trajectory, row index of each of its tokens or -1)`` for every trajectory with a token in ``row``.

    A tree part holds a trajectory whole (its leaf is in the part) or only a prefix of it (the
    chain carried as context, owned or not); with the ``owned`` array, listing every copy makes
    each token's sums count every trajectory through it exactly once over all rows.
    """
    copies = []
    offset = 0
    for part in row.layout_parts:
        tree = part.tree
        to_row = np.full(tree.n_tokens, -1, dtype=np.int64)
        to_row[part.token_index] = offset + np.arange(part.n_tokens)
        for trajectory, path in zip(tree.trajectories, tree.paths, strict=True):
            in_row = to_row[path]
            if in_row[0] >= 0:  # parts always hold the root, so a trajectory is here iff its first token is
                copies.append((trajectory, in_row))
        offset += part.n_tokens
    return copies


def row_sums(
    row: PackedRow,
    copies: list[tuple[Trajectory, np.ndarray]],
    advantages: dict[int, np.ndarray],
    settings: RLSettings,
    normalisers: StepNormalisers,
    logp_old: np.ndarray | None = None,
) -> TokenSums:
    """Per-token sums of ``row`` (all its tokens); with ``logp_old`` (per row token) and truncation, IS-weighted."""
    masks = [t.loss_mask for t, _ in copies]
    coefficients = copy_coefficients(copies, settings, normalisers)
    weighted = settings.importance_truncation is not None and logp_old is not None
    sampler = None
    if weighted:
        sampler = [_sampler_logprobs(t) for t, _ in copies]
    return token_sums(
        row.n_tokens,
        [path for _, path in copies],
        masks,
        coefficients,
        [advantages[id(t)] for t, _ in copies],
        row.owned,
        logp_old=logp_old if weighted else None,
        sampler_logprobs=sampler,
        truncation=settings.importance_truncation if weighted else None,
    )


def copy_coefficients(
    copies: list[tuple[Trajectory, np.ndarray]], settings: RLSettings, normalisers: StepNormalisers
) -> list[np.ndarray]:
    """Per copy, its trajectory's aggregation coefficients ``c_it``."""
    return [
        trajectory_coefficients(
            t.loss_mask,
            settings.aggregation,
            total_tokens=normalisers.total_tokens,
            sequences=normalisers.sequences,
            constant=settings.aggregation_constant,
        )
        for t, _ in copies
    ]


def cppo_targets(row: PackedRow, copies, active: np.ndarray) -> np.ndarray:
    """CPPO's targets: ``active`` and every token of the row a copy trains (a pair's prefix, owned or not) that the
    row predicts (a shard: those predicted inside it; the group completes them, :func:`cppo_mask_sums`)."""
    return np.union1d(active, np.flatnonzero(trained_tokens(row.n_tokens, copies) & row.predicted_here()))


def cppo_pairs(
    row: PackedRow, copies, advantages: dict[int, np.ndarray], settings: RLSettings, normalisers: StepNormalisers
) -> CPPOPairs:
    """The row's pairs for CPPO's mask (:func:`ds_tree.losses.cppo.row_pairs`)."""
    return row_pairs(
        [path for _, path in copies],
        [t.loss_mask for t, _ in copies],
        copy_coefficients(copies, settings, normalisers),
        [advantages[id(t)] for t, _ in copies],
        row.owned,
    )


def _sampler_logprobs(trajectory: Trajectory) -> np.ndarray:
    values = getattr(trajectory, "logprobs", None)
    if values is None:
        raise DataError(
            f"{trajectory.source or trajectory.group_id}: the sampler's per-token 'logprobs' are needed "
            "(objective.old_logprobs=data or objective.importance_truncation), but this trajectory has none"
        )
    return np.asarray(values, dtype=np.float64)


def shared_sampler_logprobs(n_tokens: int, copies: Sequence[tuple[Trajectory, np.ndarray]]) -> np.ndarray:
    """Per token, the sampler log-prob of the trajectories trained on it (``inf`` where none is).

    ``copies`` pairs each trajectory with the index of each of its tokens (``-1`` where absent), as
    :func:`trajectory_copies` gives them for a row or ``zip(tree.trajectories, tree.paths)`` for a
    tree. Every trained token must carry a value, and the trajectories trained on one token must agree
    to :data:`SHARED_LOGPROB_TOLERANCE`: the tree shares one ratio per token, so disagreeing values
    (independent samples that happen to share tokens) cannot be trained exactly on the tree. Either
    failure is a :class:`DataError` naming the trajectories.
    """
    low = np.full(n_tokens, np.inf)
    high = np.full(n_tokens, -np.inf)
    for trajectory, path in copies:
        values = _sampler_logprobs(trajectory)
        trained = np.flatnonzero((trajectory.loss_mask[1:] != 0) & (path[1:] >= 0)) + 1
        if np.any(np.isnan(values[trained])):
            t = int(trained[np.isnan(values[trained])][0])
            raise DataError(f"{trajectory.where}: token {t} is trained but has no sampler log-prob (null)")
        np.minimum.at(low, path[trained], values[trained])
        np.maximum.at(high, path[trained], values[trained])
    spread = np.where(np.isfinite(low), high - low, 0.0)
    if np.any(spread > SHARED_LOGPROB_TOLERANCE):
        k = int(np.argmax(spread))
        through = [t.where for t, path in copies if k in path]
        raise DataError(
            f"{', '.join(through[:3])}: these trajectories share a token whose sampler log-probs differ by "
            f"{spread[k]:.3g} (> {SHARED_LOGPROB_TOLERANCE}); the tree shares one ratio per token, so use "
            "objective.old_logprobs=recompute"
        )
    return low


def check_shared_logprobs(tree: TokenTree) -> None:
    """For ``old_logprobs: data``, before training: :func:`shared_sampler_logprobs` holds on ``tree``."""
    shared_sampler_logprobs(tree.n_tokens, list(zip(tree.trajectories, tree.paths, strict=True)))


def prepare_rl_rows(
    model: PreTrainedModel,
    rows: Sequence[PackedRow],
    advantages: dict[int, np.ndarray],
    settings: RLSettings,
    normalisers: StepNormalisers,
    *,
    reference: PreTrainedModel | None = None,
    device: torch.device | str = "cpu",
    head_chunk: int = 0,
    dfs: DfsSettings | None = None,
    old_logprobs: dict[int, np.ndarray] | None = None,
) -> list[RLRow]:
    """Targets, per-token sums, old and reference log-probs of every row (no gradients).

    ``advantages`` maps ``id(trajectory)`` to its per-token advantages. ``model`` is the policy
    before this step's updates (its log-probs are ``logp_old`` unless ``old_logprobs`` is ``data``).
    ``head_chunk``: see :mod:`ds_tree.models.logprobs`. ``dfs``: how walked rows (:class:`DfsRow`)
    are walked. ``old_logprobs`` (``id(trajectory) -> log p`` per token, equal on shared tokens): the
    old policy's log-probs given, not computed (the self-check's, :mod:`ds_tree.engine.self_check`).

    Two passes over the rows: every row's old-policy forwards, then every row's reference forwards.
    A walked row makes one forward per chunk, so ranks make different numbers of forwards; with
    ``dfs.lockstep`` (ZeRO-3) each pass is first padded to the busiest rank's count on its own model
    (:func:`even_out_forwards`) when that model's forwards gather parameters collectively
    (:func:`gathers_collectively`: the policy engine, a partitioned reference engine, the policy with
    its adapters off), so every rank's gathers of one model meet those of the same model in order.
    """
    run = RunContext(device, head_chunk, dfs)
    lockstep = dfs is not None and dfs.lockstep and in_process_group()
    recompute = settings.old_logprobs != "data" and old_logprobs is None
    if lockstep and recompute:
        even_out_forwards(model, rows, run)
    prepared = []
    for row in rows:
        copies = trajectory_copies(row)
        sums = row_sums(row, copies, advantages, settings, normalisers)
        targets = sums.active()
        if settings.cppo is not None:
            if settings.importance_truncation is not None:
                raise ValueError("cppo is not combined with importance truncation")
            targets = cppo_targets(row, copies, targets)
        if old_logprobs is not None:
            logp_old = row_token_values(row.n_tokens, copies, old_logprobs)[targets]
        elif settings.old_logprobs == "data":
            logp_old = shared_sampler_logprobs(row.n_tokens, copies)[targets]
        else:
            logp_old = runner_of(row).logprobs(model, row, targets, run)
        if settings.importance_truncation is not None:
            by_token = np.full(row.n_tokens, np.nan)
            by_token[targets] = logp_old
            sums = row_sums(row, copies, advantages, settings, normalisers, logp_old=by_token)
        pairs = None if settings.cppo is None else cppo_pairs(row, copies, advantages, settings, normalisers)
        prepared.append(RLRow(row, targets, sums.take(targets), logp_old, None, pairs))
    if reference is not None:
        if lockstep and gathers_collectively(reference):
            even_out_forwards(reference, rows, run)
        for item in prepared:
            item.logp_ref = runner_of(item.row).logprobs(reference, item.row, item.targets, run)
    return prepared


def gathers_collectively(model) -> bool:
    """Whether ``model``'s forwards gather its parameters collectively, so that every rank must make them
    alike: a ZeRO-3 engine's (the policy, a partitioned reference), or a view of one (LoRA's reference,
    the policy engine with its adapters off, :class:`~ds_tree.models.lora.AdaptersDisabled`)."""
    stage = getattr(model, "zero_optimization_stage", None)
    return stage is not None and stage() == 3


def even_out_forwards(model, rows: Sequence[PackedRow], run: RunContext) -> None:
    """No-grad dummy forwards of ``model`` (:func:`~ds_tree.engine.dfs.dummy_call`) until this rank has made
    as many as the busiest will for ``rows`` (one per packed row, one per chunk of a walked tree)."""
    count = torch.tensor([sum(runner_of(row).forwards(row, run) for row in rows)])
    most = count.clone()
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    dummy = dummy_call(model, None, run.device)
    for _ in range(int(most - count)):
        dummy(NO_GRAD)


def row_token_values(n_tokens: int, copies, given: Mapping[int, np.ndarray]) -> np.ndarray:
    """Per row token, the value ``given`` holds (``id(trajectory) -> one per token``) for the trajectories through
    it, which must agree there (a function of the prefix: a log-prob, a critic's value); NaN where none is."""
    by_token = np.full(n_tokens, np.nan)
    for trajectory, path in copies:
        present = path >= 0
        by_token[path[present]] = given[id(trajectory)][present]
    return by_token


def trained_tokens(n_tokens: int, copies) -> np.ndarray:
    """Per row token, whether a trajectory through it trains it (its loss mask is not 0 there)."""
    trained = np.zeros(n_tokens, dtype=bool)
    for trajectory, path in copies:
        present = np.flatnonzero(path >= 0)
        trained[path[present[np.asarray(trajectory.loss_mask)[present] != 0]]] = True
    return trained


def trajectory_scores(
    model, trajectories: Sequence[Trajectory], rows: Sequence[PackedRow], run: RunContext, *, trained_only: bool = False
) -> list[np.ndarray]:
    """Per trajectory, what ``run.head`` gives (log-probs, a critic's values) at each of its tokens (index 0 unused,
    NaN) where this rank's items predict them: each item's runner scores the tokens the item owns (a shard: those
    predicted from it), ``trained_only``: those a trajectory trains. No gradients; with ``run.dfs.lockstep`` the
    forwards of a model that gathers collectively are evened out over the ranks first (:func:`even_out_forwards`).
    :func:`merged_over_ranks` completes them with the other ranks' tokens."""
    if run.dfs is not None and run.dfs.lockstep and in_process_group() and gathers_collectively(model):
        even_out_forwards(model, rows, run)
    index = {id(t): i for i, t in enumerate(trajectories)}
    values = [np.full(len(t), np.nan) for t in trajectories]
    for row in rows:
        copies = trajectory_copies(row)
        scored = row.owned & (row.pred_pos >= 0)
        if trained_only:
            scored &= trained_tokens(row.n_tokens, copies)
        targets = np.flatnonzero(scored)
        by_token = np.full(row.n_tokens + 1, np.nan)  # the last entry: tokens absent from the row
        with torch.no_grad():
            by_token[targets] = runner_of(row).logprobs(model, row, targets, run)
        for trajectory, path in copies:
            found = by_token[path]  # -1 (absent) reads the NaN entry
            known = ~np.isnan(found)
            values[index[id(trajectory)]][known] = found[known]
    return values


def merged_over_ranks(values: list[np.ndarray]) -> list[np.ndarray]:
    """:func:`trajectory_scores` of every rank: each token is scored by the one rank owning its copy (NaN where no
    rank did); unchanged without a process group of several ranks."""
    return merge_over_group(values, None) if in_process_group() else values


RLOutput = StepOutput
"""One accumulation's loss and RL metric sums (:class:`~ds_tree.engine.runners.StepOutput`)."""


def targets_loss(
    settings: RLSettings,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    item: RLRow,
    select: np.ndarray | slice = slice(None),
) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`ppo_tree_loss` of ``item``'s targets ``select`` (``logp`` and ``entropy`` computed at them); with CPPO,
    of all of them at once (the mask reads each pair's prefix), the mask folded into the sums."""
    sums = item.sums.take(select) if isinstance(select, np.ndarray) else item.sums
    masked = None
    if settings.cppo is not None:
        if item.cppo_mask is not None:  # a walked row: the mask of the update, from its no-grad walk
            kept, masked = (values[select] for values in item.cppo_mask)
        elif np.arange(item.targets.size)[select].size != item.targets.size:
            raise ValueError("cppo scores a row's (or shard's) targets in one forward, or walks it first")
        else:
            kept, masked = cppo_mask_sums(item, logp.detach().double().cpu().numpy(), settings)
        sums = replace(sums, positive=kept, negative=np.zeros_like(kept))
    loss, metrics = ppo_tree_loss(
        logp,
        item.logp_old[select],
        sums,
        eps_low=settings.eps_low,
        eps_high=settings.eps_high,
        dual_clip=settings.dual_clip,
        logp_ref=None if item.logp_ref is None else item.logp_ref[select],
        kl_coef=settings.kl_coef,
        kl_estimator=settings.kl_estimator,
        entropy=entropy,
        entropy_coef=settings.entropy_coef,
        ratio_clip=settings.cppo is None,
    )
    if masked is not None:
        metrics["cppo_masked"] = float(masked.sum())
    return loss, metrics


def cppo_mask_sums(item: RLRow, logp: np.ndarray, settings: RLSettings) -> tuple[np.ndarray, np.ndarray]:
    """CPPO's per-target sums ``sum_i c_i keep_i A_i`` of ``item`` and its masked counts, from this update's ``logp``
    at its targets. A sequence-parallel shard scores only the targets predicted inside it: the divergences of the
    whole row are summed over its group first (each trained token is predicted in one shard), one all-reduce per
    shard, made by every rank of the group for the same row in the same order, as its forward's all-to-alls are."""
    divergence, rising = row_divergence(item.row.n_tokens, item.targets, logp, item.logp_old, settings.cppo.divergence)
    if item.row.kind in SHARED_KINDS:  # each rank scored the targets of its own shards
        divergence, rising = _over_group(divergence, rising)
    kept, masked = kept_sums(item.cppo, divergence, rising, settings.cppo)
    return kept[item.targets], masked[item.targets]


WALKED = ("walked", "walked_shard")
"""Row kinds scored chunk by chunk (:func:`walked_cppo_masks`)."""


def walked_cppo_masks(model, prepared: Sequence[RLRow], settings: RLSettings, run: RunContext) -> None:
    """Sets CPPO's mask of this update on the walked rows of ``prepared`` (:attr:`RLRow.cppo_mask`; nothing without
    dfs walks): a walk scores a tree chunk by chunk (with ``dfs_recompute`` a chunk's loss after its children's),
    so the current policy's log-probs at a walked row's targets come from a no-grad walk first, one more per
    walked row and update. With ``run.dfs.lockstep`` (ZeRO-3) the ranks' walks are evened out first, as the old
    policy's are: every rank calls this before every update."""
    if run.dfs is None:
        return
    walked = [item for item in prepared if item.row.kind in WALKED]
    if run.dfs.lockstep and in_process_group() and gathers_collectively(model):
        even_out_forwards(model, [item.row for item in walked], run)
    for item in walked:
        with torch.no_grad():
            logp = runner_of(item.row).logprobs(model, item.row, item.targets, run)
        item.cppo_mask = cppo_mask_sums(item, logp, settings)


def _over_group(divergence: np.ndarray, rising: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row token, the value of the one shard of the sequence-parallel group that knows it (NaN where none)."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    known = ~np.isnan(divergence)
    values = torch.tensor(np.stack([np.where(known, divergence, 0.0), np.where(known, rising, 0.0), known]))
    dist.all_reduce(values, group=parallel_state_sp.get_sequence_parallel_group())
    whole = values.numpy()
    missing = whole[2] == 0
    return np.where(missing, np.nan, whole[0]), np.where(missing, np.nan, whole[1])


def rl_terms(item: RLRow, settings: RLSettings) -> RowTerms:
    """The clipped objective's share of a prepared row (:class:`~ds_tree.losses.terms.RowTerms`): a sum of
    per-target terms, so any runner may score its targets in pieces. The entropy is differentiated only
    when its coefficient is not 0 (else only reported, ``rl/entropy``)."""
    return RowTerms(
        item.targets,
        lambda logp, entropy, select: targets_loss(settings, logp, entropy, item, select),
        entropy="loss" if settings.entropy_coef else "metric",
    )


def run_rl_rows(
    model: PreTrainedModel,
    prepared: Sequence[RLRow],
    settings: RLSettings,
    *,
    backward: Callable[[torch.Tensor], None] | None = None,
    backward_for: Callable[[int], Callable[[torch.Tensor], None]] | None = None,
    dfs: DfsSettings | None = None,
    device: torch.device | str = "cpu",
    head_chunk: int = 0,
    stats: WalkStats | None = None,
    collect_logprobs: bool = False,
    router_aux: RouterAuxLoss | None = None,
) -> RLOutput:
    """Forward every prepared item with gradients and hand its loss to ``backward`` (or the ``backward`` of
    ``backward_for(n)`` for ``n`` calls); ``dfs``: how walked items are walked, a walked row's loss being
    the sum over its chunks of :func:`ppo_tree_loss` on the targets each chunk predicts.
    ``collect_logprobs``: record the trajectories' log-probs at packed items' targets (NaN elsewhere).
    ``router_aux``: an MoE model's router load-balancing loss of the update's trajectories (docs/RL.md, "The
    MoE router loss"), added to each item's loss as the SFT objective adds it, on this forward's routing."""
    run = RunContext(device, head_chunk, dfs, router_aux, collect_logprobs, stats)
    if backward_for is None:
        backward_for = lambda _: backward or (lambda loss: None)  # noqa: E731
    if settings.cppo is not None:
        walked_cppo_masks(model, prepared, settings, run)
    rows = [item.row for item in prepared]
    return run_items(model, rows, [rl_terms(item, settings) for item in prepared], run, backward_for)


def rl_scalars(statistics: dict[str, float], metrics: dict[str, float], *, cppo: bool = False) -> dict[str, float]:
    """``rl/`` scalars as the flat batch computes them: ``statistics``, the reward and advantage ones
    (:meth:`~ds_tree.objectives.rl_statistics.StepStatistics.scalars`: rewards per trajectory, advantages per
    trained (trajectory, token)), and the loss metrics per trained token summed over the step's updates."""
    tokens = metrics["tokens"]

    def per_token(name: str) -> float:
        return metrics[name] / tokens if tokens else 0.0

    masked = {"rl/cppo_masked_frac": per_token("cppo_masked")} if cppo else {}  # CPPO's mask, when it is on

    return {
        **statistics,
        "rl/clip_frac_low": per_token("clip_low"),
        "rl/clip_frac_high": per_token("clip_high"),
        "rl/clip_frac_dual": per_token("clip_dual"),
        "rl/ratio_mean": per_token("ratio_sum"),
        "rl/ratio_max": metrics["ratio_max"],
        "rl/approx_kl": per_token("approx_kl"),
        "rl/kl_ref": per_token("kl_ref"),
        "rl/entropy": per_token("entropy"),
        **masked,
    }
