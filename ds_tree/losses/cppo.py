"""CPPO's token mask: a position-weighted threshold and a cumulative prefix budget (docs/RL.md, "CPPO").

CPPO (Mao, Zhou, Tao et al. 2026, "Beyond Uniform Token-Level Trust Region in LLM Reinforcement Learning",
arXiv 2606.10968, Eq. 8-11) replaces PPO's ratio clip by a mask on DPPO's surrogate ``A r`` (Qi, Zhou et al.
2026, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879). On one path with trained tokens
``k = 1..T`` (environment and prompt tokens count for nothing), with ``D_k`` the divergence of the current
policy from the old one at the sampled token (:func:`token_divergence`)::

    w_k = w_min + (1 - w_min) (T - k) / (T - 1)          position weight, 1 at the first token, w_min at the last
    Z_k = w_k D_k,   S_{k-1} = sum_{j<k} Z_j,   W_{k-1} = sum_{j<k} w_j
    c_k = min(delta, delta + budget W_{k-1} - S_{k-1})    the threshold left by the prefix's drift
    keep_k = A_k (r_k - 1) <= 0  or  Z_k <= c_k           a step back towards the old policy is always kept

and the path's policy term is ``sum_k c_ik keep_k A_k r_k`` (no clip). The mask is detached.

On a tree: ``D`` is one value per tree token (its context is shared), computed once per update from the
log-probs the forward gives anyway; the mask is a function of the path's prefix only through ``S`` and
``W``, but ``w`` depends on the path's length ``T``, so two paths through one token may keep or mask it
differently. Each (path, trained token) pair's keep is therefore evaluated with that path's ``T`` over its
own prefix (which every tree part carries), and folded, like any per-path coefficient, into the token's
sum ``sum_i c_i keep_i A_i``, the only place the mask enters the loss. So the tree loss equals flat's term
for term, and its gradient too (the mask is a constant of the update).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ds_tree.trees.weights import predicted_mask

DIVERGENCES = ("tv", "kl")


@dataclass(frozen=True)
class CPPOSettings:
    """CPPO's parameters (``objective.cppo``; the paper's names in brackets)."""

    delta: float = 0.15
    """The token threshold [``delta``] on ``w_k D_k`` (paper: 0.15 dense models, 0.2 MoE)."""
    w_min: float = 0.8
    """The position weight of a path's last trained token [``w_min``], in (0, 1]; the first has 1."""
    budget: float = 0.02
    """The prefix budget per unit of position weight [``delta_b``]: a prefix may drift ``budget W`` in all."""
    divergence: str = "tv"
    """``tv``: ``|pi - mu|`` of the sampled token (DPPO's binary TV); ``kl``: the binary KL
    ``mu log(mu / pi) + (1 - mu) log((1 - mu) / (1 - pi))``."""

    def __post_init__(self) -> None:
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"cppo divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if not (self.delta > 0 and 0 < self.w_min <= 1 and self.budget >= 0):
            raise ValueError(
                f"cppo needs delta > 0, w_min in (0, 1] and budget >= 0, got {self.delta}, {self.w_min}, {self.budget}"
            )


def token_divergence(logp: np.ndarray, logp_old: np.ndarray, divergence: str) -> np.ndarray:
    """``D`` per token, from the current and old log-probs of the sampled token (float64, no gradient)."""
    logp, logp_old = np.asarray(logp, dtype=np.float64), np.asarray(logp_old, dtype=np.float64)
    pi, mu = np.exp(logp), np.exp(logp_old)
    if divergence == "tv":
        return np.abs(pi - mu)
    if divergence == "kl":
        # 1 - p as -expm1(log p): exact for p near 1, where 1 - exp(log p) cancels
        rest_pi, rest_mu = -np.expm1(logp), -np.expm1(logp_old)
        with np.errstate(divide="ignore", invalid="ignore"):
            rest = np.where(rest_mu > 0, rest_mu * (np.log(rest_mu) - np.log(rest_pi)), 0.0)
        return mu * (logp_old - logp) + rest
    raise ValueError(f"cppo divergence must be one of {DIVERGENCES}, got {divergence!r}")


def position_weights(trained: int, count: int, w_min: float) -> np.ndarray:
    """``w_k`` for ``k = 1..count`` of a path with ``trained`` trained tokens (``count <= trained``)."""
    k = np.arange(1, count + 1, dtype=np.float64)
    return w_min + (1.0 - w_min) * (trained - k) / max(trained - 1, 1)


def path_keep(divergence: np.ndarray, moves_away: np.ndarray, trained: int, settings: CPPOSettings) -> np.ndarray:
    """The keep mask of a path's first ``len(divergence)`` trained tokens, in path order.

    ``divergence``: ``D_k``; ``moves_away``: ``A_k (r_k - 1) > 0`` (the update would move the policy further
    from the old one there); ``trained``: the path's ``T``, all its trained tokens (a tree part may hold only
    the first ones)."""
    weights = position_weights(trained, divergence.size, settings.w_min)
    drift = weights * divergence
    spent = np.concatenate([[0.0], np.cumsum(drift)[:-1]])
    allowed = np.concatenate([[0.0], np.cumsum(weights)[:-1]])
    threshold = np.minimum(settings.delta, settings.delta + settings.budget * allowed - spent)
    return ~moves_away | (drift <= threshold)


@dataclass
class CPPOPairs:
    """The (path copy, trained token) pairs of one packed row (or shard) that the mask needs, grouped by copy.

    Built once per row (:func:`row_pairs`); every update evaluates them on its own log-probs
    (:func:`kept_sums`)."""

    tokens: list[np.ndarray]
    """Per copy, the row index of each of its trained tokens in the row, in path order: the prefix its mask
    reads."""
    trained: np.ndarray
    """Per copy, ``T``: the path's trained tokens in all."""
    counted: list[np.ndarray]
    """Per copy, for each token, whether the pair is counted in this row (its copy owns the token)."""
    scaled: list[np.ndarray]
    """Per copy, for each token, ``c A`` (0 where not counted)."""
    masks: list[np.ndarray]
    """Per copy, for each token, the loss mask ``m`` (metrics; 0 where not counted)."""


def row_pairs(
    paths: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    coefficients: Sequence[np.ndarray],
    advantages: Sequence[np.ndarray],
    owned: np.ndarray,
) -> CPPOPairs:
    """The pairs of a row: ``paths``, ``loss_masks``, ``coefficients``, ``advantages`` and ``owned`` as for
    :func:`ds_tree.losses.rl.token_sums` (a copy's tokens in the row are a prefix of its path)."""
    tokens, trained, counted, scaled, masks = [], [], [], [], []
    for path, mask, coefficient, advantage in zip(paths, loss_masks, coefficients, advantages, strict=True):
        path, mask = np.asarray(path, dtype=np.int64), predicted_mask(mask)
        on = np.flatnonzero((mask != 0) & (path >= 0))
        mine = np.asarray(owned, dtype=bool)[path[on]]
        tokens.append(path[on])
        trained.append(int(np.count_nonzero(mask)))
        counted.append(mine)
        scaled.append(np.where(mine, np.asarray(coefficient, dtype=np.float64)[on] * np.asarray(advantage)[on], 0.0))
        masks.append(np.where(mine, mask[on], 0.0))
    return CPPOPairs(tokens, np.asarray(trained, dtype=np.int64), counted, scaled, masks)


def row_divergence(
    n_tokens: int, targets: np.ndarray, logp: np.ndarray, logp_old: np.ndarray, divergence: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per row token, ``D`` and the sign of ``logp - logp_old`` at ``targets`` (NaN elsewhere), from this update's
    ``logp`` and the old ``logp_old`` there."""
    by_token = np.full((2, n_tokens), np.nan)
    by_token[0, targets] = token_divergence(logp, logp_old, divergence)
    by_token[1, targets] = np.sign(np.asarray(logp, dtype=np.float64) - np.asarray(logp_old, dtype=np.float64))
    return by_token[0], by_token[1]


def kept_sums(
    pairs: CPPOPairs, divergence: np.ndarray, rising: np.ndarray, settings: CPPOSettings
) -> tuple[np.ndarray, np.ndarray]:
    """Per row token, ``sum_i c_i keep_i A_i`` over the pairs counted there, and the masked pairs' loss-mask sum
    (``rl/cppo_masked_frac``'s numerator), from :func:`row_divergence` (known at every trained token of a copy
    that counts a pair)."""
    total = np.zeros(divergence.size)
    masked = np.zeros(divergence.size)
    for tokens, trained, counted, scaled, mask in zip(
        pairs.tokens, pairs.trained, pairs.counted, pairs.scaled, pairs.masks, strict=True
    ):
        if not counted.any():
            continue
        if np.any(np.isnan(divergence[tokens])):
            raise ValueError("cppo needs the divergence at every trained token of a path's prefix in the row")
        keep = path_keep(divergence[tokens], scaled * rising[tokens] > 0, int(trained), settings)
        np.add.at(total, tokens, np.where(keep, scaled, 0.0))
        np.add.at(masked, tokens, np.where(keep, 0.0, mask))
    return total, masked
