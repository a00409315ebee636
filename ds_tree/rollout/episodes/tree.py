"""An episode tree: one task's turns as nodes, and its kept root-to-leaf paths as trajectories.

A node holds one turn: its sampled tokens (trained, with the sampler's log-probs and the policy
version, the training step, that sampled them) followed by the observation's tokens (context); a root
holds the prompt (or a conversation the environment rewrote, which continues a node of the tree). A
leaf's reward is the sum of its path's turn rewards plus the environment's ``score``; GRPO/RLOO
compare leaves of a task, TreePO's sub-groups are the turn nodes (the trie's branch points are turn
boundaries). Per-turn rewards are saved with each leaf (``turn_rewards``). Why a leaf ended is one
of :data:`STOP_REASONS`; an ``env_error`` leaf is dropped from the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ds_tree.trees.images import TrajectoryImage, placeholder_index
from ds_tree.trees.trajectory import Trajectory

STOP_REASONS = ("done", "max_turns", "length", "timeout", "env_error", "rewritten")
"""Why a leaf ended: the environment said done; ``max_turns``; the context (or one turn) ran out of
tokens; ``episode_timeout_s``; an environment failure (dropped from the loss); its history was
rewritten and the episode went on in a new branch."""
TRAINED_STOPS = ("done", "max_turns", "length", "timeout")


class EpisodeStopped(RuntimeError):
    """The run closed while an episode was sampled (on the background sampler): the episode is dropped,
    its environments closed; a resumed run samples its step anew from the step's seeds."""


@dataclass
class TurnNode:
    """One turn of an episode tree: sampled tokens, then the observation's (context)."""

    parent: int
    """-1: a root (the prompt, or a conversation the environment rewrote)."""
    token_ids: list[int] = field(default_factory=list)
    trainable: list[int] = field(default_factory=list)
    """1 on the sampled assistant tokens, 0 on prompt and observation tokens."""
    logprobs: list[float] = field(default_factory=list)
    """The sampler's log-prob of each sampled token, NaN elsewhere."""
    version: int = -1
    """The policy version (training step) that sampled this node's tokens; -1 for a root."""
    turn: int = 0
    reward: float = 0.0
    """This turn's reward (``StepResult.reward``)."""
    stop_reason: str | None = None
    """On a leaf, one of :data:`STOP_REASONS`."""
    error: str = ""
    continues: int = -1
    """On a root made by a rewritten conversation: the node whose episode it continues."""
    score: float = 0.0
    """The environment's ``score`` added on this leaf."""
    images: list[TrajectoryImage] = field(default_factory=list)
    """The images whose placeholders are among ``token_ids`` (image observations), in order."""


@dataclass
class Leaf:
    """One kept root-to-leaf path, ready to train, and what is saved about it."""

    trajectory: Trajectory
    versions: list[int]
    turn_rewards: list[float]
    stop_reason: str
    turns: int


@dataclass
class EpisodeTree:
    """A task's episode tree and its counters (what a rank sends to the others)."""

    slot: int
    task: str
    nodes: list[TurnNode]
    sampled_tokens: int = 0
    forward_tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    """``parse_errors``, ``step_timeouts``, ``env_errors``, ``rewritten``, ``observations_cut``."""
    leaves: list[Leaf] = field(default_factory=list)
    image_token_id: int | None = None
    """A vision-language policy's ``<|image_pad|>`` (never sampled: each run of it is one node image)."""

    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in self.nodes]
        for index, node in enumerate(self.nodes):
            parent = node.parent if node.parent >= 0 else node.continues
            if parent >= 0:
                children[parent].append(index)
        return children

    def path(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.nodes[node].parent
        return path[::-1]

    def build_leaves(self, group_id: str, source: str) -> None:
        """The kept leaves as trajectories (``env_error`` leaves and paths with no sampled token dropped)."""
        children = self.children()
        returns: dict[int, float] = {}

        def path_return(index: int) -> float:
            node = self.nodes[index]
            total = node.reward + node.score
            parent = node.parent if node.parent >= 0 else node.continues
            return total + (path_return(parent) if parent >= 0 else 0.0)

        def kept_below(index: int) -> list[int]:
            if not children[index]:
                return [index] if self.nodes[index].stop_reason in TRAINED_STOPS else []
            return [leaf for child in children[index] for leaf in kept_below(child)]

        for index, node in enumerate(self.nodes):
            if node.stop_reason in TRAINED_STOPS and not children[index]:
                returns[index] = path_return(index)
        for index, node in enumerate(self.nodes):  # a rewritten path: the mean return of its continuation
            if node.stop_reason == "rewritten":
                below = [returns[leaf] for leaf in kept_below(index)]
                if below:
                    returns[index] = float(np.mean(below))
        self.leaves = []
        for index in sorted(returns):
            path = self.path(index)
            nodes = [self.nodes[n] for n in path]
            mask = np.concatenate([np.asarray(n.trainable, dtype=np.float64) for n in nodes])
            if not mask[1:].any():
                continue
            trial = len(self.leaves)
            input_ids = np.concatenate([np.asarray(n.token_ids, dtype=np.int64) for n in nodes])
            images = [image for n in nodes for image in n.images]
            image_index = placeholder_index(input_ids, self.image_token_id, images) if images else None
            trajectory = Trajectory(
                input_ids=input_ids,
                loss_mask=mask,
                group_id=group_id,
                reward=returns[index],
                trial=trial,
                source=f"{source} leaf {trial}",
                logprobs=np.concatenate([np.asarray(n.logprobs, dtype=np.float64) for n in nodes]),
                policy_version=min(n.version for n in nodes if n.parent >= 0),  # its oldest turn's
                images=tuple(images),
                image_index=image_index,
            )
            self.leaves.append(
                Leaf(
                    trajectory,
                    versions=[n.version for n in nodes for _ in n.token_ids],
                    turn_rewards=[n.reward for n in nodes if n.parent >= 0],
                    stop_reason=self.nodes[index].stop_reason,
                    turns=sum(n.parent >= 0 for n in nodes),
                )
            )
