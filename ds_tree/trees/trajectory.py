"""One root-to-leaf token sequence and the checks every input path runs on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ds_tree.errors import DataError


@dataclass
class Trajectory:
    """A token sequence with a per-token loss coefficient.

    ``loss_mask[t]`` weights the loss of predicting token ``t`` from tokens ``< t``; the first
    token is never predicted, so ``loss_mask[0]`` is ignored everywhere (as in the flat
    baseline with Hugging Face's shifted labels).
    """

    input_ids: np.ndarray
    """int64 token ids, length >= 1."""
    loss_mask: np.ndarray
    """float64 per-token loss coefficients (0 where untrained), same length as input_ids."""
    group_id: str = ""
    """Trajectories with the same group id form one tree (when merging by group)."""
    reward: float | None = None
    """Scalar outcome for RL objectives; carried through untouched for SFT."""
    trial: int | None = None
    """Index of this trial inside its group, when the source has one."""
    source: str = ""
    """Where the trajectory came from (``file:line``), used in error messages."""

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int64).reshape(-1)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.float64).reshape(-1)
        where = self.source or f"group {self.group_id!r}"
        if self.input_ids.size == 0:
            raise DataError(f"{where}: empty trajectory (input_ids has no tokens)")
        if self.loss_mask.shape != self.input_ids.shape:
            raise DataError(
                f"{where}: loss_mask has {self.loss_mask.size} entries but input_ids has "
                f"{self.input_ids.size}; they must have the same length"
            )
        if not np.all(np.isfinite(self.loss_mask)):
            raise DataError(f"{where}: loss_mask contains a non-finite value")
        if self.input_ids.min() < 0:
            raise DataError(f"{where}: negative token id {int(self.input_ids.min())}")

    def __len__(self) -> int:
        return int(self.input_ids.size)

    @property
    def trained_tokens(self) -> float:
        """Sum of the loss coefficients over predicted tokens (everything but the first)."""
        return float(self.loss_mask[1:].sum())


def check_vocab(trajectories: list[Trajectory], vocab_size: int) -> None:
    """Raise a :class:`DataError` naming the first trajectory with an id outside the vocabulary."""
    for trajectory in trajectories:
        top = int(trajectory.input_ids.max())
        if top >= vocab_size:
            where = trajectory.source or f"group {trajectory.group_id!r}"
            raise DataError(f"{where}: token id {top} is >= the model's vocab size {vocab_size}")


def group_trajectories(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by ``group_id``, groups in order of first appearance (one tree per group)."""
    groups: dict[str, list[Trajectory]] = {}
    for trajectory in trajectories:
        groups.setdefault(trajectory.group_id, []).append(trajectory)
    return list(groups.values())
