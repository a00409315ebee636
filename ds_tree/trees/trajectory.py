"""One root-to-leaf token sequence and the checks every input path runs on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ds_tree.errors import DataError
from ds_tree.trees.images import TrajectoryImage, check_image_layout

LOGPROB_ROUNDOFF = 1e-6
LOSS_COEFFICIENT_MAX = 1e30
"""The largest ``loss_mask`` value: a loss coefficient times a token's loss (and their sum over a step)
stays finite in float32 and bfloat16 (largest finite value 3.4e38); 1e308 overflowed to a loss of 0."""
"""How far above 0 a sampler's log-probability may round (a probability of 1 computed in float32)."""


@dataclass
class Trajectory:
    """A token sequence with a per-token loss coefficient, and for RL the sampler's data.

    ``loss_mask[t]`` weights the loss of predicting token ``t`` from tokens ``< t``; the first
    token is never predicted, so ``loss_mask[0]`` is ignored everywhere (as in the flat
    baseline with Hugging Face's shifted labels), and so are ``advantages[0]`` and ``logprobs[0]``.
    """

    input_ids: np.ndarray
    """int64 token ids, length >= 1."""
    loss_mask: np.ndarray
    """float64 per-token loss coefficients (>= 0; 0 where untrained), same length as input_ids."""
    group_id: str | int = ""
    """Trajectories with the same group id form one tree (when merging by group); an integer id is
    a different group from the string of its digits."""
    reward: float | None = None
    """Scalar outcome for RL objectives; carried through untouched for SFT."""
    trial: int | None = None
    """Index of this trial inside its group, when the source has one."""
    source: str = ""
    """Where the trajectory came from (``file:line``), used in error messages."""
    logprobs: np.ndarray | None = None
    """float64 log-probabilities of the tokens under the sampling policy, same length as input_ids,
    NaN where a token was not sampled (the prompt, tool output); ``None`` when the data has none."""
    advantages: np.ndarray | None = None
    """float64 finite per-token advantages computed outside (the ``given`` estimator reads them),
    same length as input_ids; ``None`` when the data has none."""
    policy_version: int | None = None
    """Online RL: the policy that sampled it (training steps taken before); ``None`` for data from a file."""
    images: tuple[TrajectoryImage, ...] = ()
    """The images of a vision-language trajectory, in order of appearance (:mod:`ds_tree.trees.images`)."""
    image_index: np.ndarray | None = None
    """Per token: which of ``images`` it is a placeholder of, ``-1`` for text; ``None`` without images."""
    rope_positions: np.ndarray | None = None
    """``[3, length]`` int64 multimodal rotary positions (temporal, height, width) by the model's rule;
    ``None`` for text (positions are then the token's index)."""

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int64).reshape(-1)
        where = self.where
        if self.input_ids.size == 0:
            raise DataError(f"{where}: empty trajectory (input_ids has no tokens)")
        self.loss_mask = self._per_token("loss_mask")
        if not np.all(np.isfinite(self.loss_mask)):
            raise DataError(f"{where}: loss_mask contains a non-finite value")
        negative = np.flatnonzero(self.loss_mask < 0)
        if negative.size:
            raise DataError(
                f"{where}: loss_mask has {float(self.loss_mask[negative[0]])!r} at token {negative[0]}; "
                "a loss coefficient is >= 0"
            )
        large = np.flatnonzero(self.loss_mask > LOSS_COEFFICIENT_MAX)
        if large.size:
            raise DataError(
                f"{where}: loss_mask has {float(self.loss_mask[large[0]])!r} at token {large[0]}; a loss "
                f"coefficient is at most {LOSS_COEFFICIENT_MAX:g} (larger ones overflow the loss)"
            )
        if self.input_ids.min() < 0:
            raise DataError(f"{where}: negative token id {int(self.input_ids.min())}")
        self._check_images()
        if self.advantages is not None:
            self.advantages = self._per_token("advantages")
            if not np.all(np.isfinite(self.advantages)):
                raise DataError(f"{where}: advantages contains a non-finite value")
        if self.logprobs is not None:
            self.logprobs = self._per_token("logprobs")
            if np.any(np.isinf(self.logprobs)):
                raise DataError(f"{where}: logprobs contains an infinite value (NaN marks a token not sampled)")
            above = np.flatnonzero(self.logprobs > LOGPROB_ROUNDOFF)  # NaN compares False
            if above.size:
                raise DataError(
                    f"{where}: logprobs has {float(self.logprobs[above[0]])!r} at token {above[0]}; "
                    "a log-probability is at most 0"
                )

    def _check_images(self) -> None:
        self.images = tuple(self.images)
        if self.image_index is None and not self.images:
            if self.rope_positions is not None:
                self.rope_positions = self._rope_positions()
            return
        if self.image_index is None:
            raise DataError(f"{self.where}: {len(self.images)} image(s) but no image_index saying where they are")
        self.image_index = np.asarray(self.image_index, dtype=np.int64).reshape(-1)
        if self.image_index.shape != self.input_ids.shape:
            raise DataError(
                f"{self.where}: image_index has {self.image_index.size} entries but input_ids has {self.input_ids.size}"
            )
        if self.rope_positions is not None:
            self.rope_positions = self._rope_positions()
        check_image_layout(self.where, self.image_index, self.images)

    def _rope_positions(self) -> np.ndarray:
        positions = np.asarray(self.rope_positions, dtype=np.int64)
        if positions.shape != (3, self.input_ids.size):
            raise DataError(
                f"{self.where}: rope_positions has shape {positions.shape}, expected (3, {self.input_ids.size})"
            )
        return positions

    @property
    def where(self) -> str:
        """How error messages name this trajectory: its source, else its group."""
        return self.source or f"group {self.group_id!r}"

    def _per_token(self, name: str) -> np.ndarray:
        """Field ``name`` as a float64 vector, checked to be as long as input_ids."""
        values = np.asarray(getattr(self, name), dtype=np.float64).reshape(-1)
        if values.shape != self.input_ids.shape:
            raise DataError(
                f"{self.where}: {name} has {values.size} entries but input_ids has "
                f"{self.input_ids.size}; they must have the same length"
            )
        return values

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
            raise DataError(f"{trajectory.where}: token id {top} is >= the model's vocab size {vocab_size}")


def group_trajectories(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by ``group_id``, groups in order of first appearance (one tree per group)."""
    groups: dict[str | int, list[Trajectory]] = {}
    for trajectory in trajectories:
        groups.setdefault(trajectory.group_id, []).append(trajectory)
    return list(groups.values())
