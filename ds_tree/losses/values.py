"""PPO with a learned critic on trees: GAE per path, and the clipped value loss per (path, token) pair (docs/RL.md,
"PPO with a learned critic").

Values: ``V_t`` is the critic's value head at ``pred_pos`` of target ``t``, the value of the state before token ``t``
is generated. It depends on the prefix only, so a tree token has one value, shared by every path through it, and a
flat trajectory's value at its token ``t`` is the tree token's.

GAE runs along each path over its trained tokens ``t_1 < ... < t_n`` (loss mask non-zero; a multi-turn path's
environment tokens are not actions of the policy, so they are skipped: the chain goes from one trained token to the
next, their values unused), with the trajectory's reward ``R`` at its last trained token (Schulman et al. 2016,
arXiv 1506.02438)::

    delta_k = r_k + gamma V_{t_{k+1}} - V_{t_k},   r_k = R [k = n],   V_{t_{n+1}} = 0
    A_k = delta_k + gamma lam A_{k+1},             returns G_k = A_k + V_{t_k}

A path's advantages depend on its own suffix, so paths through one token get different ones: they enter the tree's
per-token sums of the clipped objective as any per-path advantages do (:func:`ds_tree.losses.rl.token_sums`). Given
the same values, tree and flat compute the same per-path numbers; the tree's values are the flat's (the same
prefixes), to round-off.

The critic's loss, over (path ``i``, trained token ``t``) pairs with the policy loss's coefficients ``c_it`` and
the values ``V_old`` of the step's start (the value clipping of OpenAI Baselines' PPO2, studied by Engstrom et al.
2020, arXiv 2005.12729, and applied so by verl and OpenRLHF)::

    L_V = 0.5 sum_{i,t} c_it max((V_t - G_it)^2, (V_old_t + clip(V_t - V_old_t, -eps_v, eps_v) - G_it)^2)

It is not linear in ``V_t`` per pair, and the pairs through one token have different returns, so it does not fold
into per-token sums: :class:`ValuePairs` lists an item's pairs with the index of their target, each pair's term is
computed on its target's value exactly as flat computes it (``N_flat`` values gathered from ``N_tree``), and
autograd sums the pairs' gradients into the shared value. The pairs of a target are the trajectories through it,
listed once over all items (owned copies only, :func:`ds_tree.objectives.rl_rows.trajectory_copies`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

VALUE_METRICS = ("value_pairs", "value_clipped", "value_loss")
"""The critic's metric sums over (path, trained token) pairs (mask-weighted), added over items, updates and ranks."""


def gae(
    values: np.ndarray, loss_mask: np.ndarray, reward: float, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """One path's GAE advantages and returns, per token of the path (module docstring; 0 where it is not trained).

    ``values[t]``: the critic's value at token ``t`` (read at trained tokens only, which must be finite)."""
    values = np.asarray(values, dtype=np.float64)
    advantages, returns = np.zeros(values.size), np.zeros(values.size)
    trained = np.flatnonzero(np.asarray(loss_mask)[1:] != 0) + 1
    if trained.size == 0:
        return advantages, returns
    chain = values[trained]
    if not np.all(np.isfinite(chain)):
        raise ValueError("a trained token has no finite critic value")
    following = np.append(chain[1:], 0.0)
    rewards = np.zeros(trained.size)
    rewards[-1] = reward
    deltas = rewards + gamma * following - chain
    running, discount = 0.0, gamma * lam
    for k in range(trained.size - 1, -1, -1):
        running = deltas[k] + discount * running
        advantages[trained[k]] = running
    returns[trained] = advantages[trained] + chain
    return advantages, returns


@dataclass
class ValuePairs:
    """The (path, trained token) pairs of one item's targets for the value loss (module docstring)."""

    targets: np.ndarray
    """Row indices of the item's targets (owned tokens with a pair), in row order."""
    target: np.ndarray
    """Per pair: the index of its token in :attr:`targets`."""
    coefficient: np.ndarray
    """Per pair: ``c_it``."""
    returns: np.ndarray
    """Per pair: ``G_it``."""
    mask: np.ndarray
    """Per pair: the loss mask (the metrics' pair count)."""

    @classmethod
    def of_row(
        cls,
        owned: np.ndarray,
        paths: Sequence[np.ndarray],
        coefficients: Sequence[np.ndarray],
        returns: Sequence[np.ndarray],
        masks: Sequence[np.ndarray],
    ) -> ValuePairs:
        """The pairs of a row: ``paths[j][t]`` is the row index of token ``t`` of trajectory copy ``j`` (``-1``:
        absent), each copy's coefficients, returns and loss mask per token; pairs at owned tokens with ``c != 0``."""
        owned = np.asarray(owned, dtype=bool)
        index, kept = [], {"coefficient": [], "returns": [], "mask": []}
        for path, coefficient, ret, mask in zip(paths, coefficients, returns, masks, strict=True):
            path = np.asarray(path, dtype=np.int64)
            present = np.flatnonzero(path[1:] >= 0) + 1
            present = present[owned[path[present]] & (np.asarray(coefficient)[present] != 0)]
            index.append(path[present])
            for name, values in (("coefficient", coefficient), ("returns", ret), ("mask", mask)):
                kept[name].append(np.asarray(values, dtype=np.float64)[present])
        flat = {name: np.concatenate(v) if v else np.zeros(0) for name, v in kept.items()}
        rows = np.concatenate(index).astype(np.int64) if index else np.zeros(0, np.int64)
        targets = np.unique(rows)
        return cls(targets, np.searchsorted(targets, rows), flat["coefficient"], flat["returns"], flat["mask"])

    def of_targets(self, select: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pairs whose target is among ``targets[select]`` (``select`` increasing), and each one's position in
        ``select``."""
        pairs = np.flatnonzero(np.isin(self.target, select))
        return pairs, np.searchsorted(select, self.target[pairs])


def value_loss(
    values: torch.Tensor,
    old_values: np.ndarray,
    pairs: ValuePairs,
    select: np.ndarray,
    value_clip: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``L_V`` (module docstring) of the pairs of targets ``targets[select]`` (``values`` computed at them, with
    gradients; ``old_values`` per target of the item), and its metric sums: ``value_pairs`` (pairs, mask-weighted),
    ``value_clipped`` (those whose value moved out of the clip range and whose clipped term is the larger: the
    clip acts), ``value_loss`` (the loss)."""
    chosen, local = pairs.of_targets(select)

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(array, dtype=values.dtype, device=values.device)

    value = values[torch.as_tensor(local, device=values.device)]
    target = tensor(pairs.returns[chosen])
    unclipped = (value - target).square()
    clipped, acts = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    if value_clip:
        old = tensor(np.asarray(old_values)[pairs.target[chosen]])
        moved = value - old
        clipped = (old + moved.clamp(-value_clip, value_clip) - target).square()
        # inside the range the two terms are equal but for round-off (old + (value - old) is not value): only a
        # value outside the range is clipped, else the count would follow the last bit of the values
        acts = (moved.detach().abs() > value_clip) & (clipped > unclipped)
    loss = 0.5 * (tensor(pairs.coefficient[chosen]) * torch.maximum(unclipped, clipped)).sum()
    with torch.no_grad():
        mask = tensor(pairs.mask[chosen])
        metrics = {
            "value_pairs": float(mask.sum()),
            "value_clipped": float((mask * acts).sum()),
            "value_loss": float(loss.detach()),
        }
    return loss, metrics
