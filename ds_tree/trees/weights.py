"""Restoration weight sums: per tree token, the raw sums every SFT normalisation needs (docs/DESIGN.md section 3).

A token shared by several trajectories has one loss term in the tree; its weight restores what the
flat baseline counts once per trajectory. With ``c_it`` the loss coefficient of trajectory ``i`` at
token ``t`` (0 at a trajectory's first token, which is never predicted) and ``T_i = sum_t c_it``:

- ``mask_sum[t] = sum_i c_it`` (``token_mean`` and ``sum``);
- ``seq_mean_sum[t] = sum_i c_it / T_i`` (``sequence_mean``; a trajectory with ``T_i = 0`` adds nothing);
- ``mask_max[t] = max_i c_it`` (the ``dedup`` policy: each distinct token once).

The global denominators of an optimizer step are applied later (:mod:`ds_tree.losses.sft`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ds_tree.trees.trajectory import Trajectory


def predicted_mask(loss_mask: np.ndarray) -> np.ndarray:
    """``loss_mask`` as the loss reads it: a float64 copy with ``m_0 = 0`` (the first token is never predicted)."""
    mask = np.asarray(loss_mask, dtype=np.float64).copy()
    mask[:1] = 0.0
    return mask


def restoration_sums(
    trajectories: Sequence[Trajectory], paths: Sequence[np.ndarray], n_tokens: int
) -> dict[str, np.ndarray]:
    """``mask_sum``, ``seq_mean_sum`` and ``mask_max`` of a tree of ``n_tokens`` tokens, where
    ``paths[i]`` holds the tree indices of the tokens of ``trajectories[i]``, in order."""
    mask_sum = np.zeros(n_tokens)
    seq_mean_sum = np.zeros(n_tokens)
    mask_max = np.zeros(n_tokens)
    for trajectory, path in zip(trajectories, paths, strict=True):
        coefficients = predicted_mask(trajectory.loss_mask)
        mask_sum[path] += coefficients
        trained = coefficients.sum()
        if trained > 0:
            seq_mean_sum[path] += coefficients / trained
        mask_max[path] = np.maximum(mask_max[path], coefficients)
    return {"mask_sum": mask_sum, "seq_mean_sum": seq_mean_sum, "mask_max": mask_max}
