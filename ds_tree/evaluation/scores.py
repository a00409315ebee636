"""Task success as numbers: pass@k's unbiased estimator and the ``eval/`` scalars of sampled tasks
(docs/EVAL.md, *Metrics*).

A task sampled ``n`` times with ``c`` successes (reward at least ``eval.success_threshold``) passes at ``k``
with probability ``1 - C(n - c, k) / C(n, k)``: the chance that ``k`` of its ``n`` samples, drawn without
replacement, hold a success (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"). Averaged
over the tasks it is an unbiased estimate of pass@k; pass@1 is the mean success rate ``c / n``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)``, as the product ``prod_{i < k} (n - c - i) / (n - i)`` (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a success
        return 1.0
    failing = 1.0
    for i in range(k):
        failing *= (n - c - i) / (n - i)
    return 1.0 - failing


@dataclass
class TaskOutcome:
    """One evaluated task (prompt or environment task): what a rank sends to the others."""

    index: int
    """Its line in ``eval.prompts`` (0-based)."""
    label: str
    tag: str
    """Its ``"tag"`` (empty: none): the ``eval/TAG/`` breakdown."""
    rewards: list[float | None]
    """One per requested sample; None: lost (the reward function failed, an environment error, an episode
    that kept no sampled token). A lost sample is a failure for pass@k and left out of the reward mean."""
    records: list[dict] = field(default_factory=list)
    """The samples as saved (``eval/step_N.jsonl``)."""


def successes(outcome: TaskOutcome, threshold: float) -> int:
    return sum(reward is not None and reward >= threshold for reward in outcome.rewards)


def task_scalars(outcomes: list[TaskOutcome], k: int, threshold: float, prefix: str = "eval/") -> dict[str, float]:
    """``reward_mean`` (over the scored samples), ``pass@1``, ``pass@k`` (means over the tasks),
    ``lost_samples`` and ``tasks`` of ``outcomes``, each named ``prefix + name``."""
    rewards = [reward for outcome in outcomes for reward in outcome.rewards if reward is not None]
    passes = {1: [], k: []}
    for outcome in outcomes:
        n, c = len(outcome.rewards), successes(outcome, threshold)
        for size in passes:
            passes[size].append(pass_at_k(n, c, size))
    scalars = {
        f"{prefix}reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
        **{f"{prefix}pass@{size}": float(np.mean(values)) for size, values in passes.items()},
        f"{prefix}lost_samples": float(sum(reward is None for outcome in outcomes for reward in outcome.rewards)),
        f"{prefix}tasks": float(len(outcomes)),
    }
    return scalars


def tagged_scalars(outcomes: list[TaskOutcome], k: int, threshold: float) -> dict[str, float]:
    """:func:`task_scalars` over every task, then over each tag's tasks (``eval/TAG/...``)."""
    scalars = task_scalars(outcomes, k, threshold)
    for tag in sorted({outcome.tag for outcome in outcomes if outcome.tag}):
        tagged = [outcome for outcome in outcomes if outcome.tag == tag]
        scalars.update(task_scalars(tagged, k, threshold, prefix=f"eval/{tag}/"))
    return scalars
