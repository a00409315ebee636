"""Direct preference optimisation on trees, exact for the gradient (``objective.kind: dpo``; docs/RL.md, "DPO").

A pair ``(c, r)`` of sequences (chosen, rejected) scores ``x = (z_c - z_c^ref) - (z_r - z_r^ref)``, where
``z_s = sum_t m_st log pi(s_t | s_<t)`` sums the sequence's trained tokens (``m``: its loss mask; IPO: the mask
over its sum, a length-averaged log-prob) under the policy, ``z^ref`` under the frozen reference. Losses:

- ``sigmoid`` (DPO, Rafailov et al. 2023, arXiv 2305.18290): ``-(1 - e) log sigmoid(beta x) - e log
  sigmoid(-beta x)``, ``e`` the label smoothing (conservative DPO, ``e = 0``: DPO itself);
- ``ipo`` (Azar et al. 2023, arXiv 2310.12036): ``(x - 1 / (2 beta))^2``.

The step's loss ``L`` is the mean over its ``P`` pairs. It is nonlinear in each ``z_s``, so it does not fold
into per-token weights; its gradient does: with ``g_s = dL / dz_s`` (the pairs' derivatives over ``P``, ``+``
for a chosen, ``-`` for a rejected sequence, summed over the pairs a sequence is in), ``grad L = sum_s g_s grad
z_s = sum_t w_t grad log pi_t``, ``w_t = sum_{s through t} g_s m_st``: a linear objective of per-token
weights, which restore on trees exactly as SFT's do. :func:`pair_derivatives` gives ``g`` from the sums
(no gradient), the training pass differentiates ``sum_t w_t log pi_t`` (its value is not ``L``; the loss
reported is ``L`` from the sums).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.trees.weights import predicted_mask

LOSSES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class DPOLoss:
    """The pair loss and its parameters (``objective.dpo``)."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"the DPO loss must be one of {LOSSES}, got {self.loss!r}")

    def of(self, log_ratio_difference: torch.Tensor) -> torch.Tensor:
        """Each pair's loss from its ``x`` (module docstring), differentiable."""
        x = log_ratio_difference
        if self.loss == "ipo":
            return (x - 1 / (2 * self.beta)) ** 2
        smoothing = self.label_smoothing
        logsigmoid = torch.nn.functional.logsigmoid
        return -(1 - smoothing) * logsigmoid(self.beta * x) - smoothing * logsigmoid(-self.beta * x)

    def averaged(self) -> bool:
        """Whether sequences score length-averaged log-probs (IPO)."""
        return self.loss == "ipo"


def sequence_mask(trajectory, averaged: bool) -> np.ndarray:
    """``m_s``: the trajectory's trained-token weights in ``z_s`` (its loss mask, token 0 never predicted;
    ``averaged``: over their sum)."""
    mask = predicted_mask(trajectory.loss_mask)
    total = mask.sum()
    return mask / total if averaged and total > 0 else mask


@dataclass
class PairStatistics:
    """What the sums give a step's pairs (all ranks alike)."""

    loss: float
    """``L``: the mean pair loss."""
    derivatives: np.ndarray
    """``g_s = dL / dz_s`` per sequence."""
    margins: np.ndarray
    """Per pair, ``beta x``: the chosen sequence's implicit reward minus the rejected one's."""
    chosen_rewards: np.ndarray
    """Per pair, ``beta (z_c - z_c^ref)``."""
    rejected_rewards: np.ndarray

    def scalars(self) -> dict[str, float]:
        """``dpo/`` metrics (TRL's ``rewards/*``)."""
        empty = self.margins.size == 0
        return {
            "dpo/pairs": float(self.margins.size),
            "dpo/margin": float("nan") if empty else float(self.margins.mean()),
            "dpo/accuracy": float("nan") if empty else float((self.margins > 0).mean()),
            "dpo/reward_chosen": float("nan") if empty else float(self.chosen_rewards.mean()),
            "dpo/reward_rejected": float("nan") if empty else float(self.rejected_rewards.mean()),
        }


def pair_statistics(
    policy: np.ndarray, reference: np.ndarray, pairs: Sequence[tuple[int, int]], settings: DPOLoss
) -> PairStatistics:
    """The loss and ``g`` (module docstring) from every sequence's sums ``z`` under the ``policy`` and the
    ``reference`` (float64), ``pairs`` indexing them; no pairs: loss 0 and ``g = 0``."""
    derivatives = np.zeros(policy.size)
    if not pairs:
        empty = np.zeros(0)
        return PairStatistics(0.0, derivatives, empty, empty, empty)
    chosen, rejected = (np.array(side, dtype=np.int64) for side in zip(*pairs, strict=True))
    ratios = torch.as_tensor(policy - reference, dtype=torch.float64)
    x = (ratios[chosen] - ratios[rejected]).requires_grad_(True)
    loss = settings.of(x).mean()
    (dx,) = torch.autograd.grad(loss, x)
    np.add.at(derivatives, chosen, dx.numpy())
    np.add.at(derivatives, rejected, -dx.numpy())
    beta = settings.beta
    return PairStatistics(
        float(loss.detach()),
        derivatives,
        beta * x.detach().numpy(),
        beta * ratios[chosen].numpy(),
        beta * ratios[rejected].numpy(),
    )
