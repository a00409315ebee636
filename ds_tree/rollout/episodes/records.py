"""A step's episode trees as metrics and files: the ``rollout/`` scalars, why tasks kept no leaf, and the
kept leaves saved as tokens JSONL (``output_dir/rollouts/step_<N>.jsonl``, with each leaf's extras)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_tree.atomic import remove
from ds_tree.rollout.episodes.tree import TRAINED_STOPS, EpisodeTree, Leaf


def lost_tasks(trees: list[EpisodeTree], max_context: int, episode_timeout_s: float) -> str:
    """Why the tasks that kept no leaf lost them: each cause with its count and the first error."""
    causes: dict[str, int] = {}
    for tree in trees:
        if tree.leaves:
            continue
        children = tree.children()
        ends = [node for index, node in enumerate(tree.nodes) if not children[index]]
        prompt = len(tree.nodes[0].token_ids) if tree.nodes else 0
        for node in ends[:1] or [None]:
            reason = node.stop_reason if node is not None else None
            if reason == "env_error":
                cause = f"environment errors (first: {node.error})"
            elif reason == "length" and not any(n.trainable and any(n.trainable) for n in tree.nodes):
                cause = (
                    f"the prompt ({prompt} tokens) leaves no room for a turn under the path limit "
                    f"({max_context} tokens: rollout.env.max_context_tokens, or packing.budget)"
                )
            elif reason == "timeout":
                cause = f"rollout.env.episode_timeout_s ({episode_timeout_s} s) ran out before a turn was sampled"
            else:
                cause = f"no sampled token on any kept path (stop reason {reason})"
            causes[cause] = causes.get(cause, 0) + 1
    return "; ".join(f"{count} task(s): {cause}" for cause, count in causes.items()) or "none lost"


@dataclass
class EpisodeFigures:
    """What the ``rollout/`` metrics need of an episode tree (what a rank sends of it: no tokens)."""

    leaves: int
    rewards: list[float]
    lengths: list[int]
    trained: list[int]
    """Per kept leaf, its trained tokens (the tokens sampling it alone would draw)."""
    turns: list[int]
    stops: list[str]
    tree_tokens: int
    sampled_tokens: int
    forward_tokens: int
    counts: dict[str, int]

    @classmethod
    def of(cls, tree: EpisodeTree) -> EpisodeFigures:
        leaves = tree.leaves
        return cls(
            leaves=len(leaves),
            rewards=[leaf.trajectory.reward for leaf in leaves],
            lengths=[len(leaf.trajectory) for leaf in leaves],
            trained=[int(leaf.trajectory.loss_mask.sum()) for leaf in leaves],
            turns=[leaf.turns for leaf in leaves],
            stops=[leaf.stop_reason for leaf in leaves],
            tree_tokens=sum(len(node.token_ids) for node in tree.nodes),
            sampled_tokens=tree.sampled_tokens,
            forward_tokens=tree.forward_tokens,
            counts=dict(tree.counts),
        )


def episode_scalars(figures: list[EpisodeFigures]) -> dict[str, float]:
    """The ``rollout/`` metrics of one step's episode trees (all ranks' :class:`EpisodeFigures`, in slot order)."""
    rewards = [reward for f in figures for reward in f.rewards]
    turns = [count for f in figures for count in f.turns]
    stops = [stop for f in figures for stop in f.stops]
    flat = sum(length for f in figures for length in f.lengths)
    tree_tokens = sum(f.tree_tokens for f in figures)
    independent = sum(count for f in figures for count in f.trained)
    sampled = sum(f.sampled_tokens for f in figures)
    scalars = {
        "rollout/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
        "rollout/leaves": float(np.mean([f.leaves for f in figures])),
        "rollout/turns": float(np.mean(turns)) if turns else 0.0,
        "rollout/por": 1.0 - tree_tokens / flat if flat else 0.0,
        "rollout/sampled_tokens": float(sampled),
        "rollout/forward_tokens": float(sum(f.forward_tokens for f in figures)),
        "rollout/tokens_saved": float(independent - sampled),
    }
    for name in ("parse_errors", "step_timeouts", "env_errors", "rewritten", "observations_cut"):
        scalars[f"rollout/{name}"] = float(sum(f.counts.get(name, 0) for f in figures))
    for reason in TRAINED_STOPS:
        scalars[f"rollout/stop_{reason}"] = float(sum(stop == reason for stop in stops))
    return scalars


def leaf_record(leaf: Leaf, task: str) -> dict:
    """A kept leaf as a tokens JSONL record (:mod:`ds_tree.data.tokens`), with its episode's extras."""
    trajectory = leaf.trajectory
    return {
        "group_id": trajectory.group_id,
        "trial": trajectory.trial,
        "input_ids": trajectory.input_ids.tolist(),
        "loss_mask": trajectory.loss_mask.tolist(),
        "logprobs": [None if math.isnan(x) else x for x in trajectory.logprobs.tolist()],
        "reward": trajectory.reward,
        "versions": leaf.versions,
        "turn_rewards": leaf.turn_rewards,
        "stop_reason": leaf.stop_reason,
        "task": task,
        **(
            {"images": [{"key": image.key, "grid_thw": list(image.grid_thw)} for image in trajectory.images]}
            if trajectory.images
            else {}
        ),
    }


def save_rollouts(output_dir: str | Path, step: int, trees: list[EpisodeTree]) -> Path:
    """Write ``step``'s kept leaves to ``output_dir/rollouts/step_<N>.jsonl`` (replaced atomically)."""
    directory = Path(output_dir) / "rollouts"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.jsonl"
    partial = path.with_suffix(".jsonl.partial")
    remove(partial)  # a leftover, or a link planted under its name: created anew ("x"), never followed
    with partial.open("x") as handle:
        for tree in sorted(trees, key=lambda t: t.slot):
            for leaf in tree.leaves:
                handle.write(json.dumps(leaf_record(leaf, tree.task)) + "\n")
    partial.replace(path)
    return path
