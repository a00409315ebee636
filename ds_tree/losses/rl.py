"""The PPO/GRPO clipped objective on tree tokens, equal to the flat sum over trajectories (docs/RL.md).

Flat objective, a loss to minimise, over trajectories ``i`` and their predicted tokens ``t``::

    L = sum_{i,t} c_it * ( -w_it * g(r_t, A_it) + beta * kl_t - alpha * H_t )

with the ratio ``r_t = exp(logp_t - logp_old_t)``, ``g(r, A) = min(r A, clip(r) A)`` (PPO, Schulman
et al. 2017, arXiv 1707.06347), ``clip(r) = clamp(r, 1 - eps_low, 1 + eps_high)`` (asymmetric:
DAPO's clip-higher, arXiv 2503.14476) and, with dual clip ``d > 1`` (Ye et al. 2020, arXiv
1912.09729), ``g(r, A) = max(min(r A, clip(r) A), d A)`` for ``A < 0``. ``r_t``, ``kl_t`` and
``H_t`` depend on the token's context only, so they are the same for every trajectory through a
tree token. Since ``min(r A, clip(r) A) = A min(r, clip(r))`` for ``A >= 0`` and ``A max(r, clip(r))``
for ``A < 0``, and ``max(A x, d A) = A min(x, d)`` for ``A < 0``, the sum over trajectories
through a token folds into a few per-token sums (the sign split)::

    sum_i c_i w_i g(r, A_i) = P_t min(r, clip(r)) + N_t min(max(r, clip(r)), d)
    P_t = sum_{A_i >= 0} c_i w_i A_i,   N_t = sum_{A_i < 0} c_i w_i A_i,   C_t = sum_i c_i

(``d = inf`` without dual clip); the KL and entropy terms weigh by ``C_t``. ``w_it`` is the
optional truncated importance weight ``min(exp(logp_old_t - logp_sampler_it), C_trunc)`` between
the sampler's and the trainer's old log-probs (>= 0, so it keeps the sign of ``A``).

:func:`trajectory_coefficients` gives ``c_it`` for each aggregation from global normalisers,
:func:`token_sums` folds trajectories into per-token :class:`TokenSums`, :func:`ppo_tree_loss`
computes the loss and the metrics the flat batch would report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from ds_tree.losses.cppo import CPPOSettings
from ds_tree.registries import AGGREGATIONS
from ds_tree.trees.weights import predicted_mask

KL_ESTIMATORS = ("k1", "k2", "k3")
SUMMED_METRICS = (
    "tokens",
    "clip_low",
    "clip_high",
    "clip_dual",
    "ratio_sum",
    "approx_kl",
    "kl_ref",
    "entropy",
    "cppo_masked",
)
"""The metrics of :func:`ppo_tree_loss` that add up over micro-batches and ranks (the other, ``ratio_max``,
by max)."""


@dataclass(frozen=True)
class RLSettings:
    """The RL objective's parameters (``objective`` section of the config; docs/RL.md)."""

    aggregation: str = "token_mean"
    aggregation_constant: float | None = None
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    old_logprobs: str = "recompute"
    importance_truncation: float | None = None
    cppo: CPPOSettings | None = None
    """CPPO's mask in place of the ratio clip (:mod:`ds_tree.losses.cppo`); None: the clipped objective."""


def aggregation_token_mean(mask: np.ndarray, total_tokens: float, sequences: float, constant: float | None) -> float:
    """``token_mean``: ``c = m / total_tokens`` (every trained token of the step alike)."""
    return total_tokens


def aggregation_seq_mean_token_mean(
    mask: np.ndarray, total_tokens: float, sequences: float, constant: float | None
) -> float:
    """``seq_mean_token_mean``: ``c = m / (T_i * sequences)`` (each trajectory's mean, then the mean over them)."""
    return mask.sum() * sequences


def aggregation_seq_mean_token_sum(
    mask: np.ndarray, total_tokens: float, sequences: float, constant: float | None
) -> float:
    """``seq_mean_token_sum``: ``c = m / sequences``."""
    return sequences


def aggregation_token_sum_norm(
    mask: np.ndarray, total_tokens: float, sequences: float, constant: float | None
) -> float:
    """``token_sum_norm``: ``c = m / constant`` (Dr. GRPO's constant normaliser, e.g. the generation budget;
    independent of the batch)."""
    if constant is None or not constant > 0:
        raise ValueError(f"the token_sum_norm aggregation needs a constant > 0, got {constant!r}")
    return constant


def trajectory_coefficients(
    loss_mask: np.ndarray,
    aggregation: str,
    *,
    total_tokens: float,
    sequences: float,
    constant: float | None = None,
) -> np.ndarray:
    """Per-token coefficients ``c_it = m_t / denominator`` of one trajectory (``c_i0 = 0``: the first token is
    never predicted), the denominator by the aggregation registered as ``aggregation``
    (:data:`ds_tree.registries.AGGREGATIONS`: a function of ``(m, total_tokens, sequences, constant)``,
    the ``aggregation_*`` functions above for the built-ins).

    ``m`` is ``loss_mask`` with ``m_0 = 0`` and ``T_i = sum_t m_t``; the normalisers are global to
    the optimizer step (all micro-batches, all ranks): ``total_tokens = sum_i T_i`` and
    ``sequences`` = trajectories with ``T_i > 0``. A zero denominator (nothing trained in the step) gives
    all-zero coefficients.
    """
    mask = predicted_mask(loss_mask)
    denominator = AGGREGATIONS.get(aggregation)(mask, total_tokens, sequences, constant)
    return mask / denominator if denominator > 0 else np.zeros_like(mask)


@dataclass
class TokenSums:
    """Per-token sums over the trajectories through each token (float64, one entry per token).

    Only owned copies of a token carry them; other copies hold 0 (context only).
    """

    positive: np.ndarray
    """``P_t = sum_{A_i >= 0} c_i w_i A_i``."""
    negative: np.ndarray
    """``N_t = sum_{A_i < 0} c_i w_i A_i``."""
    weight: np.ndarray
    """``C_t = sum_i c_i``: the weight of the KL and entropy terms."""
    tokens: np.ndarray
    """``sum_i m_i``: the flat batch's trained-token count at this token (metrics)."""
    positive_tokens: np.ndarray
    """``sum_{A_i > 0} m_i`` (metrics: high clip fraction)."""
    negative_tokens: np.ndarray
    """``sum_{A_i < 0} m_i`` (metrics: low and dual clip fractions)."""

    def active(self) -> np.ndarray:
        """Indices of the tokens with any non-zero sum: the targets the LM head must score."""
        return np.flatnonzero(np.any([getattr(self, f.name) != 0 for f in fields(self)], axis=0))

    def take(self, index: np.ndarray) -> TokenSums:
        """The sums at ``index`` (e.g. :meth:`active`)."""
        return TokenSums(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


def token_sums(
    n_tokens: int,
    paths: Sequence[np.ndarray],
    loss_masks: Sequence[np.ndarray],
    coefficients: Sequence[np.ndarray],
    advantages: Sequence[np.ndarray],
    owned: np.ndarray,
    *,
    logp_old: np.ndarray | None = None,
    sampler_logprobs: Sequence[np.ndarray] | None = None,
    truncation: float | None = None,
) -> TokenSums:
    """Fold trajectories into the per-token sums of a packed row of ``n_tokens`` tokens.

    Entry ``j`` of ``paths`` is one copy of a trajectory in the row: ``paths[j][t]`` is the row
    index of its token ``t``, or ``-1`` where that token is not in the row (a tree part holds only
    a prefix of the trajectories that leave it); token ``t >= 1`` is the target predicted at that
    index. ``loss_masks``, ``coefficients``, ``advantages`` (and ``sampler_logprobs``) are the
    trajectory's per-token arrays, as long as its path. ``owned[k]`` says whether row token ``k``
    carries weight: a tree token duplicated into several parts is owned by exactly one copy.
    Every (trajectory, part) pair whose part holds any of the trajectory's tokens must be listed,
    so that each owned token sees every trajectory through it; then the sums over all rows of a
    step equal the flat sums.

    Truncated importance sampling: with ``sampler_logprobs`` (the sampler's log-probs per
    trajectory), ``logp_old`` (the trainer's old-policy log-probs per row target) and
    ``truncation`` (``C_trunc``), ``c A`` is multiplied by ``min(exp(logp_old - logp_sampler),
    C_trunc)``. The sums then depend on ``logp_old``: form them after the old-policy forward.
    Sampler log-probs are read only where ``c A != 0`` (NaN elsewhere is fine).
    """
    if (sampler_logprobs is None) != (truncation is None) or (sampler_logprobs is not None and logp_old is None):
        raise ValueError("importance weights need sampler_logprobs, logp_old and truncation together")
    if truncation is not None and not truncation > 0:
        raise ValueError(f"truncation (C_trunc) must be > 0, got {truncation!r}")
    owned = np.asarray(owned, dtype=bool)
    per_token = {"mask": loss_masks, "coefficient": coefficients, "advantage": advantages}
    if sampler_logprobs is not None:
        per_token["sampler"] = sampler_logprobs
    kept: dict[str, list[np.ndarray]] = {"index": [], **{name: [] for name in per_token}}
    for j, path in enumerate(paths):
        path = np.asarray(path, dtype=np.int64)
        present = np.flatnonzero(path[1:] >= 0) + 1
        present = present[owned[path[present]]]
        kept["index"].append(path[present])
        for name, arrays in per_token.items():
            values = np.asarray(arrays[j], dtype=np.float64)
            if values.shape != path.shape:
                raise ValueError(f"trajectory copy {j}: {name} has shape {values.shape}, its path {path.shape}")
            kept[name].append(values[present])
    flat = {name: np.concatenate(arrays) if arrays else np.zeros(0) for name, arrays in kept.items()}
    index = flat["index"].astype(np.int64)
    advantage, mask = flat["advantage"], flat["mask"]
    scaled = flat["coefficient"] * advantage
    if sampler_logprobs is not None:
        active = scaled != 0
        log_weight = np.asarray(logp_old, dtype=np.float64)[index[active]] - flat["sampler"][active]
        if not np.all(np.isfinite(log_weight)):
            raise ValueError("sampler or old log-probs are not finite at a trained token")
        scaled[active] *= np.minimum(np.exp(log_weight), truncation)

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(index, weights=values, minlength=n_tokens)

    return TokenSums(
        positive=total(np.where(advantage >= 0, scaled, 0.0)),
        negative=total(np.where(advantage < 0, scaled, 0.0)),
        weight=total(flat["coefficient"]),
        tokens=total(mask),
        positive_tokens=total(np.where(advantage > 0, mask, 0.0)),
        negative_tokens=total(np.where(advantage < 0, mask, 0.0)),
    )


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from a sample of ``pi`` (Schulman 2020, "Approximating KL
    divergence"), with ``x = logp_ref - logp``: k1 ``-x``, k2 ``x^2 / 2``, k3 ``exp(x) - 1 - x``."""
    log_ratio = logp_ref - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def ppo_tree_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor | np.ndarray,
    sums: TokenSums,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    logp_ref: torch.Tensor | np.ndarray | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ratio_clip: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss ``L`` of the module docstring on one set of target tokens, and metric sums.

    ``ratio_clip=False``: ``g(r, A) = r A`` (no clip, the clip metrics 0), the surrogate CPPO masks
    (:mod:`ds_tree.losses.cppo`: the mask is already folded into ``sums``).

    ``logp`` (differentiable), ``logp_old``, ``logp_ref``, ``entropy`` (of the predicted
    distribution, differentiable) and ``sums`` are aligned per target token. Returns a 0-dim loss
    in ``logp``'s dtype and sums over (trajectory, token) pairs weighted by the loss mask, which
    add up over micro-batches and ranks (``ratio_max`` by max) to the flat batch's: ``tokens``,
    ``clip_low`` (``r < 1 - eps_low`` with ``A < 0``), ``clip_high`` (``r > 1 + eps_high`` with
    ``A > 0``), ``clip_dual`` (``r > dual_clip`` with ``A < 0``), ``ratio_sum``, ``ratio_max`` (0
    when no token is trained), ``approx_kl`` (k3 estimate of ``KL(pi_old || pi)``, ``r - 1 - log
    r``), ``kl_ref`` and ``entropy`` (0 when not given). Divide by ``tokens`` for means.
    """
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (it bounds the loss of A < 0 at dual_clip * |A|), got {dual_clip}")
    if kl_coef and logp_ref is None:
        raise ValueError("kl_coef needs the reference policy's log-probs (logp_ref)")
    if entropy_coef and entropy is None:
        raise ValueError("entropy_coef needs the per-token entropy")

    def tensor(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=logp.dtype, device=logp.device)

    log_ratio = logp - tensor(logp_old)
    ratio = torch.exp(log_ratio)
    if ratio_clip:
        clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
        upper = torch.minimum(ratio, clipped)
        lower = torch.maximum(ratio, clipped)
        if dual_clip is not None:
            lower = lower.clamp(max=dual_clip)
    else:
        upper = lower = ratio
    loss = -(tensor(sums.positive) * upper + tensor(sums.negative) * lower).sum()
    weight = tensor(sums.weight)
    kl = None if logp_ref is None else kl_penalty(logp, tensor(logp_ref), kl_estimator)
    if kl is not None:
        loss = loss + kl_coef * (weight * kl).sum()
    if entropy is not None:
        loss = loss - entropy_coef * (weight * entropy).sum()

    with torch.no_grad():
        tokens, positive, negative = tensor(sums.tokens), tensor(sums.positive_tokens), tensor(sums.negative_tokens)
        if not ratio_clip:
            positive, negative, dual_clip = positive * 0, negative * 0, None
        ratio, log_ratio = ratio.detach(), log_ratio.detach()
        zero = ratio.new_zeros(())
        trained = ratio[tokens != 0]
        values = {
            "tokens": tokens.sum(),
            "clip_low": (negative * (ratio < 1 - eps_low)).sum(),
            "clip_high": (positive * (ratio > 1 + eps_high)).sum(),
            "clip_dual": zero if dual_clip is None else (negative * (ratio > dual_clip)).sum(),
            "ratio_sum": (tokens * ratio).sum(),
            "ratio_max": trained.max() if trained.numel() else zero,
            "approx_kl": (tokens * (ratio - 1 - log_ratio)).sum(),
            "kl_ref": zero if kl is None else (tokens * kl.detach()).sum(),
            "entropy": zero if entropy is None else (tokens * entropy.detach()).sum(),
        }
        metrics = dict(zip(values, torch.stack(list(values.values())).tolist(), strict=True))
    return loss, metrics
