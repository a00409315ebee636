"""Supervised (SFT) loss on packed rows with restoration weights (docs/DESIGN.md section 3).

The flat objective ``sum_i sum_t c_it * l_it`` equals ``sum_tree-tokens w_t * l_t`` with
``w_t = sum_{i through t} c_it``. The packer stores, per token, the raw sums that every
normalisation needs (``mask_sum``, ``seq_mean_sum``, ``mask_max``); the normaliser itself is a
few global scalars of the optimizer step (:class:`Normalisers`) that the engine all-reduces
before the first forward, so the loss of every micro-batch on every rank is already a term of the
global objective.

Normalisations: ``token_mean`` (``c = mask / T_global``), ``sequence_mean``
(``c = mask / (T_i * n_seq)``; sequences without trained tokens are left out of ``n_seq``),
``sum`` (``c = mask``). Policies: ``exact`` (the flat baseline's objective, the default) and
``dedup`` (each distinct token counted once, with its largest coefficient; ``token_mean`` then
divides by the distinct trained tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.packing.rows import PackedRow

NORMALISATIONS = ("token_mean", "sequence_mean", "sum")
POLICIES = ("exact", "dedup")


@dataclass
class Normalisers:
    """Global denominators of one optimizer step (summed over all micro-batches and ranks)."""

    target_tokens: float
    """Sum over trajectories of their trained-token coefficients (``T_global``)."""
    sequences: float
    """Trajectories with at least one trained token."""
    distinct_target_tokens: float
    """Sum over distinct tree tokens of their largest coefficient (the ``dedup`` denominator)."""

    @classmethod
    def from_rows(cls, rows: Iterable[PackedRow]) -> Normalisers:
        target = sequences = distinct = 0.0
        for row in rows:
            target += float(row.mask_sum.sum())
            distinct += float(row.mask_max.sum())
            for part in row.parts:
                sequences += sum(part.tree.trajectories[i].trained_tokens > 0 for i in part.trajectory_ids)
        return cls(target, sequences, distinct)

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.target_tokens, self.sequences, self.distinct_target_tokens], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> Normalisers:
        target, sequences, distinct = values.tolist()
        return cls(target, sequences, distinct)


def check_objective(normalisation: str, policy: str) -> None:
    if normalisation not in NORMALISATIONS:
        raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {normalisation!r}")
    if policy not in POLICIES:
        raise ValueError(f"weight policy must be one of {POLICIES}, got {policy!r}")
    if policy == "dedup" and normalisation == "sequence_mean":
        raise ValueError("the dedup policy counts each distinct token once, so it has no per-sequence mean")


def restoration_weights(row: PackedRow, normalisers: Normalisers, normalisation: str, policy: str) -> np.ndarray:
    """Loss weight of every token of ``row`` (0 on padding, roots' first tokens, weight-0 copies)."""
    check_objective(normalisation, policy)
    if policy == "dedup":
        raw, denominator = row.mask_max, normalisers.distinct_target_tokens
    elif normalisation == "sequence_mean":
        raw, denominator = row.seq_mean_sum, normalisers.sequences
    else:
        raw, denominator = row.mask_sum, normalisers.target_tokens
    if normalisation == "sum":
        return raw.copy()
    return raw / denominator if denominator > 0 else np.zeros_like(raw)


def weighted_nll(logprobs: torch.Tensor, weights: np.ndarray) -> torch.Tensor:
    """``-sum_t w_t log p_t`` in the dtype of ``logprobs``."""
    return -(torch.as_tensor(weights, dtype=logprobs.dtype, device=logprobs.device) * logprobs).sum()
