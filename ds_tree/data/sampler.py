"""Which trees each optimizer step trains on: a pure function of (seed, step).

Groups are shuffled once per epoch with ``seed + epoch``; step ``s`` takes the next
``groups_per_step`` groups of that endless sequence. Every rank computes the same selection, so a
resumed run sees exactly the data an uninterrupted one would have, with no sampler state to save.
"""

from __future__ import annotations

import numpy as np


class StepSampler:
    def __init__(self, n_groups: int, groups_per_step: int, seed: int) -> None:
        if n_groups < 1:
            raise ValueError("the dataset has no groups")
        self.n_groups = n_groups
        self.groups_per_step = groups_per_step
        self.seed = seed

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_groups)

    def groups_for_step(self, step: int) -> list[int]:
        """Group indices of optimizer step ``step`` (0-based)."""
        positions = np.arange(step * self.groups_per_step, (step + 1) * self.groups_per_step)
        epochs, offsets = np.divmod(positions, self.n_groups)
        picked = np.empty(positions.size, dtype=np.int64)
        for epoch in np.unique(epochs):  # each epoch's shuffle drawn once (not once per group: 20 s a step
            here = epochs == epoch  # of 2048 groups out of 200k)
            picked[here] = self._epoch_order(int(epoch))[offsets[here]]
        return picked.tolist()

    def trajectories_for_step(self, groups: list[list], step: int) -> list:
        """The trajectories of step ``step``'s groups (``groups``: the data set's, by group index)."""
        return [t for g in self.groups_for_step(step) for t in groups[g]]

    def epoch_of_step(self, step: int) -> float:
        return step * self.groups_per_step / self.n_groups
