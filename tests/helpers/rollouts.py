"""One generator of RL rollouts for the tests: groups that share a stem and fork at random depths.

Every RL test draws its groups here (as tokens records, as :class:`Trajectory` objects, or written to a
tokens JSONL file), so a change to what a rollout looks like is made once. A group's trajectories
share the first ``cut`` tokens of the group's stem (``cut`` drawn per trajectory from ``fork``; all of it
where ``cut`` is longer), then continue with their own tokens to a length in ``[cut + min_tail, longest)``;
the first ``untrained`` tokens are untrained (the prompt). Rewards: ``mixed`` (0/1 in odd groups, normal
in even ones: both the binary and the real-valued case), ``normal``, ``binary``, or ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_tree.data.jsonl import write_jsonl
from ds_tree.trees.trajectory import Trajectory

REWARD_KINDS = ("mixed", "normal", "binary", "none")


@dataclass(frozen=True)
class RolloutShape:
    stem: int = 30
    """Tokens of a group's stem (its prompt and the shared start of its samples)."""
    fork: tuple[int, int] = (2, 30)
    """A trajectory leaves the stem after ``min(cut, stem)`` tokens, ``fork[0] <= cut < fork[1]``."""
    min_tail: int = 2
    """At least this many tokens of its own after the fork."""
    longest: int = 56
    """Every trajectory is shorter than this."""
    vocab: int = 200
    """Token ids are drawn from ``[3, vocab)``."""
    untrained: int = 8
    """Leading tokens with ``loss_mask`` 0."""
    rewards: str = "mixed"

    def __post_init__(self) -> None:
        assert self.rewards in REWARD_KINDS, self.rewards
        assert self.fork[1] + self.min_tail <= self.longest


def reward(rng: np.random.Generator, kind: str, group: int) -> float | None:
    """One trajectory's reward of ``kind`` in group number ``group``."""
    if kind == "none":
        return None
    if kind == "binary" or (kind == "mixed" and group % 2):
        return float(rng.integers(0, 2))
    return float(rng.normal())


def rl_records(seed: int = 0, groups: int = 3, per_group: int = 4, shape: RolloutShape = RolloutShape()) -> list[dict]:
    """Tokens records (``group_id``, ``input_ids``, ``loss_mask``, ``reward`` unless ``none``)."""
    rng = np.random.default_rng(seed)
    records = []
    for group in range(groups):
        stem = rng.integers(3, shape.vocab, shape.stem).tolist()
        for _ in range(per_group):
            cut = int(rng.integers(*shape.fork))
            length = int(rng.integers(cut + shape.min_tail, shape.longest))
            shared = min(cut, shape.stem)
            ids = stem[:shared] + rng.integers(3, shape.vocab, length - shared).tolist()
            untrained = min(shape.untrained, length)
            record = {
                "group_id": f"g{group}",
                "input_ids": ids,
                "loss_mask": [0] * untrained + [1] * (length - untrained),
            }
            value = reward(rng, shape.rewards, group)
            if value is not None:
                record["reward"] = value
            records.append(record)
    return records


def rl_trajectories(
    seed: int = 0, groups: int = 3, per_group: int = 4, shape: RolloutShape = RolloutShape()
) -> list[Trajectory]:
    """:func:`rl_records` as trajectories, each with ``source`` ``g<group>:<index in group>``."""
    records = rl_records(seed, groups, per_group, shape)
    return [
        Trajectory(
            r["input_ids"],
            r["loss_mask"],
            group_id=r["group_id"],
            reward=r.get("reward"),
            source=f"{r['group_id']}:{i % per_group}",
        )
        for i, r in enumerate(records)
    ]


def write_rl_records(
    path: Path, seed: int = 0, groups: int = 3, per_group: int = 4, shape: RolloutShape = RolloutShape()
) -> Path:
    """:func:`rl_records` written as a tokens JSONL file at ``path``."""
    write_jsonl(path, rl_records(seed, groups, per_group, shape))
    return path
