"""What the checks of the objectives with a frozen second model share (``ds-tree verify --objective distill``
and ``dpo``: :mod:`ds_tree.verify.distill`, :mod:`ds_tree.verify.dpo`).

Each compares the objective's tree computation, the trainer's own code on the items of a plan (packed rows,
walked trees, sequence-parallel shards), with an independent flat oracle: every trajectory its own sequence,
its whole logits, the loss written out and differentiated by autograd. A check runs the tree side in every
layout asked for (:func:`layouts`), each against the one oracle result (:func:`side_report`); under sequence
parallelism in ``size`` spawned processes (:func:`~ds_tree.verify.sequence_parallel.spawn_group`), each
planning its items as the trainer does, the group's gradients summed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.comparison import gradient_errors, relative_error
from ds_tree.engine.dfs import DfsSettings
from ds_tree.engine.runners import RunContext
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.rows import PackedRow
from ds_tree.trees.trajectory import Trajectory


@dataclass
class SideResult:
    """One side's loss, its gradients and the per-item values it is compared on (distillation: the teacher's
    log-probs of the sampled tokens; DPO: each pair's margin)."""

    loss: float
    gradients: dict[str, torch.Tensor]
    values: np.ndarray
    """Aligned over the sides (NaN where a side has none)."""


def gradients_of(model) -> dict[str, torch.Tensor]:
    """The gradients the last backward left, by parameter name (then cleared)."""
    found = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


def flat_logits(model, trajectory: Trajectory) -> torch.Tensor:
    """``[len, vocab]``: the trajectory alone, its whole logits (row ``t - 1`` predicts token ``t``)."""
    (row,) = pack_trajectories([trajectory], "flat", len(trajectory))
    return model(**row.tensors(), use_cache=False).logits[0, : len(trajectory)]


def layouts(
    trajectories: list[Trajectory], budget: int, block: int, head_chunk: int, dfs: DfsSettings | None
) -> dict[str, tuple[list[PackedRow], RunContext]]:
    """The single-process tree layouts to check: ``tree`` (packed rows, trees split into parts over ``budget``)
    and with ``dfs`` ``dfs`` (every tree walked), each with how its items run."""
    found = {"tree": (pack_trajectories(trajectories, "tree", budget, block), RunContext("cpu", head_chunk))}
    if dfs is not None:
        found["dfs"] = (pack_trajectories(trajectories, "dfs", budget, block), RunContext("cpu", head_chunk, dfs))
    return found


def side_report(name: str, flat: SideResult, side: SideResult, value_name: str) -> dict:
    """``<name>_``-prefixed errors of one side against the oracle (none for ``tree``, the first): its loss,
    every parameter's gradient and the aligned values."""
    prefix = "" if name == "tree" else f"{name}_"
    errors = gradient_errors(flat.gradients, side.gradients)
    both = ~np.isnan(flat.values) & ~np.isnan(side.values)
    return {
        f"loss_{name}": side.loss,
        f"{prefix}loss_rel_err": relative_error(side.loss, flat.loss),
        f"{prefix}max_rel_grad_err": max(errors.values(), default=0.0),
        f"{prefix}worst_parameter": max(errors, key=errors.get) if errors else None,
        f"{prefix}max_abs_{value_name}_err": float(np.abs(side.values[both] - flat.values[both]).max(initial=0.0)),
        f"{prefix}{value_name}_compared": int(both.sum()),
    }


ERROR_FIELDS = ("loss_rel_err", "max_rel_grad_err")


def passed(report: dict, sides: list[str], value_name: str, tolerance: float) -> bool:
    """Every side's loss, gradient and value errors within ``tolerance``."""
    names = (*ERROR_FIELDS, f"max_abs_{value_name}_err")
    return all(report[("" if side == "tree" else f"{side}_") + name] <= tolerance for side in sides for name in names)


def run_side(model, compute: Callable[[], tuple[float, np.ndarray]]) -> SideResult:
    """``compute()`` (its backward included) on cleared gradients: ``(loss, values)`` and the gradients."""
    model.zero_grad(set_to_none=True)
    loss, values = compute()
    return SideResult(loss, gradients_of(model), values)
