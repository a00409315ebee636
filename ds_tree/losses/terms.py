"""What an objective asks of one work item, whatever runs it (docs/DESIGN.md, "Architecture").

Every objective of ds_tree is a sum of per-target terms: the SFT loss weights each target's NLL
by its restoration weight, the clipped RL objective is fixed per target by its log-prob and the
per-token sums of the trajectories through it. So an objective hands each item's runner a
:class:`RowTerms`: the targets whose log-probs it needs, and the loss of any subset of them. A
packed row or a sequence-parallel shard takes all its targets in one forward; a walked tree takes
each chunk's own. The objective never sees how its item runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.losses.sft import weighted_nll

TermsLoss = Callable[[torch.Tensor, "torch.Tensor | None", np.ndarray], tuple[torch.Tensor, "dict[str, float] | None"]]
"""``loss(logp, entropy, select)``: the loss of the targets ``targets[select]`` (``logp`` and
``entropy``, or :attr:`RowTerms.statistic`'s values, computed at them) and its metric sums (or None)."""


@dataclass
class RowTerms:
    """One item's share of the objective (module docstring)."""

    targets: np.ndarray
    """Row indices whose log-probs the loss needs, in row order."""
    loss: TermsLoss
    entropy: str | None = None
    """``"loss"``: the loss differentiates the entropy of each predicted distribution; ``"metric"``: it
    is only reported (computed without a graph); None: not needed."""
    statistic: Callable[[np.ndarray], Callable] | None = None
    """Instead of the entropy, another statistic of each predicted distribution, differentiated by the loss:
    ``statistic(select)`` is the head's :data:`~ds_tree.models.logprobs.Statistic` for the targets
    ``targets[select]`` of one forward (on-policy distillation's divergence to the teacher); its values
    reach ``loss`` in the entropy's place."""

    def head_statistic(self, select: np.ndarray) -> str | Callable | None:
        """What the LM head computes beside the log-probs of the targets ``targets[select]`` of one forward:
        the :attr:`statistic` for them, else :attr:`entropy`."""
        return self.entropy if self.statistic is None else self.statistic(select)


def sft_terms(weights: np.ndarray, targets: np.ndarray | None = None) -> RowTerms:
    """The restoration-weighted NLL (:func:`~ds_tree.losses.sft.weighted_nll`) of a row whose tokens
    weigh ``weights`` (:func:`~ds_tree.losses.sft.restoration_weights`). ``targets``: every token
    with a non-zero weight unless given (``verify`` asks for every predicted token's log-prob)."""
    targets = np.flatnonzero(weights) if targets is None else targets

    def loss(logp: torch.Tensor, entropy, select: np.ndarray) -> tuple[torch.Tensor, None]:
        return weighted_nll(logp, weights[targets[select]]), None

    return RowTerms(targets, loss)
