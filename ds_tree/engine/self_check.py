"""The training-time tree-vs-flat self-check (``objective.self_check``; docs/LORA.md, "Self-check").

On the chosen steps the trainer takes a small sample of the step's trajectories (whole groups, in the
step's order, up to :data:`SAMPLE_TOKENS` flat tokens; the smallest group when none fits) and computes, with the
model as it is (the same weights for both), without gradients:
- the tree layout's restoration-weighted SFT loss of the sample (packed tree rows) and every
  trajectory's log-probs in the run's own execution mode (packed tree rows, or dfs walks), and
- the flat baseline's: every trajectory its own sequence, its own loss terms.
It compares the two and stops the run (:class:`SelfCheckError`) when the loss's relative error or a
log-prob's absolute error exceeds the tolerance of the model's dtype (:data:`TOLERANCES`).

What it covers: the packed layout, positions, the tree mask of the run's attention engine, the dfs
walk, the restoration weights and the objective's normalisers, on the user's model and data. What it
does not: the gradients (the exactness of the backward is the forward's plus autograd's, which
``ds-tree verify`` checks in float64 offline) and the RL objective's per-sign sums (RL runs are
checked with the SFT objective of their token masks: same layout, same restoration weights).

Every rank checks the same whole sample (the ranks' forwards stay collective under ZeRO-3), so
the check costs two no-grad forwards of at most :data:`SAMPLE_TOKENS` tokens per chosen step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.config import self_check_every
from ds_tree.engine.dfs import DfsSettings, trajectory_logprobs
from ds_tree.engine.step import run_rows
from ds_tree.losses.sft import Normalisers
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.trajectory import Trajectory, group_trajectories

logger = logging.getLogger(__name__)

SAMPLE_TOKENS = 256
"""Flat tokens of the sample (whole groups; the smallest group when none fits)."""

TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 5e-2}
"""Largest loss relative error and log-prob absolute error per dtype. float64 and float32 are
``ds-tree verify``'s. bf16 (8 significant bits, unit round-off 2^-8 = 3.9e-3): the tree and the flat
forward round their matmuls and attention sums in different orders, so each log-prob carries
independent bf16 errors of round-off size (measured on the tiny Llama, 16 trajectories: 2e-3
absolute); 5e-2 leaves room for sharper trained distributions, while a broken restoration weight
or mask moves the loss by far more (a shared token's weight off by one: tens of percent)."""


class SelfCheckError(RuntimeError):
    """The tree result differs from the flat baseline beyond the dtype's tolerance."""


@dataclass
class SelfCheckResult:
    loss_tree: float
    loss_flat: float
    loss_rel_err: float
    max_abs_logprob_err: float
    worst_trajectory: str
    trajectories: int
    tokens: int
    seconds: float
    """Wall time of the check (its cost: two no-grad forwards of the sample, three in dfs mode)."""

    def scalars(self) -> dict[str, float]:
        return {
            "selfcheck/loss_rel_err": self.loss_rel_err,
            "selfcheck/max_abs_logprob_err": self.max_abs_logprob_err,
            "selfcheck/tokens": float(self.tokens),
            "selfcheck/time_s": self.seconds,
        }


def is_due(setting: str, step: int, first_step: int) -> bool:
    """Whether 0-based ``step`` is checked under ``objective.self_check`` (``first_step``: this run's first)."""
    every = self_check_every(setting)
    return step == first_step if every == -1 else every > 0 and step % every == 0


def sample_groups(trajectories: Sequence[Trajectory], budget: int, cap: int = SAMPLE_TOKENS) -> list[Trajectory]:
    """Whole groups from the start of ``trajectories`` up to ``cap`` flat tokens; when no group fits
    the cap, the smallest group. Groups with a path longer than ``budget`` are skipped (those are
    walked or sharded, not packed)."""
    groups = [g for g in group_trajectories(trajectories) if max(len(t) for t in g) <= budget]
    sample: list[Trajectory] = []
    tokens = 0
    for group in groups:
        size = sum(len(t) for t in group)
        if tokens + size <= cap:
            sample.extend(group)
            tokens += size
    if not sample and groups:
        sample = list(min(groups, key=lambda g: sum(len(t) for t in g)))
    return sample


def _name(trajectory: Trajectory) -> str:
    return trajectory.source or f"group {trajectory.group_id!r}"


def check_sample(
    model,
    sample: Sequence[Trajectory],
    *,
    budget: int,
    normalisation: str = "token_mean",
    dfs: DfsSettings | None = None,
    device: torch.device | str = "cpu",
) -> SelfCheckResult:
    """Tree against flat on ``sample``, no gradients; the errors (module docstring). With ``dfs`` the
    log-probs are the dfs walk's (the walk's loss is computed with its backward, so the loss compared
    is the packed tree's: the same restoration weights)."""
    started = time.perf_counter()
    flat_rows = pack_trajectories(sample, "flat", budget)
    tree_rows = pack_trajectories(sample, "tree", budget)
    with torch.no_grad():
        flat, tree = (
            run_rows(model, rows, Normalisers.from_rows(rows), normalisation, collect_logprobs=True, device=device)
            for rows in (flat_rows, tree_rows)
        )
        tree_logprobs = tree.trajectory_logprobs
        if dfs is not None:  # the walk's log-probs (its loss needs a backward: the packed tree's stands for it)
            walked_rows = pack_trajectories(sample, "dfs", budget)
            tree_logprobs = trajectory_logprobs(model, walked_rows, dfs.chunk, device=device)
    worst, worst_name = 0.0, ""
    for trajectory in sample:
        key = id(trajectory)
        error = float(np.abs(tree_logprobs[key] - flat.trajectory_logprobs[key]).max(initial=0.0))
        if not error <= worst:  # NaN counts as the worst
            worst, worst_name = error, _name(trajectory)
    return SelfCheckResult(
        loss_tree=tree.loss,
        loss_flat=flat.loss,
        loss_rel_err=abs(tree.loss - flat.loss) / max(abs(flat.loss), 1e-300),
        max_abs_logprob_err=worst,
        worst_trajectory=worst_name,
        trajectories=len(sample),
        tokens=sum(len(t) for t in sample),
        seconds=time.perf_counter() - started,
    )


def verdict(result: SelfCheckResult, step: int, dtype: torch.dtype) -> None:
    """Log the check's line; raise :class:`SelfCheckError` naming the step, the failing quantity and
    the worst trajectory when an error exceeds ``dtype``'s tolerance (NaN included)."""
    tolerance = TOLERANCES[dtype]
    logger.info(
        "self-check step %d: tree vs flat on %d trajectories (%d tokens): loss rel err %.2e, max log-prob err "
        "%.2e (tolerance %.0e), %.2f s",
        step,
        result.trajectories,
        result.tokens,
        result.loss_rel_err,
        result.max_abs_logprob_err,
        tolerance,
        result.seconds,
    )
    failures = []
    if not result.loss_rel_err <= tolerance:
        failures.append(
            f"loss relative error {result.loss_rel_err:.3e} (tree {result.loss_tree:.9g}, flat {result.loss_flat:.9g})"
        )
    if not result.max_abs_logprob_err <= tolerance:
        failures.append(
            f"log-prob absolute error {result.max_abs_logprob_err:.3e} (worst trajectory: {result.worst_trajectory})"
        )
    if failures:
        raise SelfCheckError(
            f"step {step}: the tree result differs from the flat baseline on the self-check sample: "
            f"{'; '.join(failures)}; tolerance {tolerance:.0e} for {str(dtype).removeprefix('torch.')}. "
            "Run `ds-tree verify` on this data and model to locate it (objective.self_check: off skips the check)"
        )
