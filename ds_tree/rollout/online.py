"""Single-turn online RL: every training step samples trees from the current policy, scores them and
trains on them (docs/RL.md, *Online RL*; the step's machinery is :mod:`ds_tree.rollout.loop`'s).

Each slot is one prompt of ``rollout.prompts`` sampled as one tree by the sampling engine
(``rollout.engine``): on ``hf`` in this process (:func:`ds_tree.sampling.hf.sample_tree`), on
``vllm`` segment by segment on the server (:func:`ds_tree.sampling.interface.sample_tree_by_segments`),
seeded from the slot's generator either way. Each rank scores its own completions (``rollout.reward``) and
keeps them; the ranks exchange each slot's :class:`SlotFigures` (:meth:`~ds_tree.rollout.loop.StepRollouts.step_units`).
A trajectory whose reward function failed (reward ``None``) is dropped with a warning naming it, and counted
in ``rollout/reward_failures``. Every trajectory records the ``policy_version`` (training steps taken) that
sampled it.

The trajectories then go through the RL step exactly as offline rollouts do (advantages, old
log-probs, updates). :func:`rollout_scalars` gives the ``rollout/`` metrics.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.errors import ConfigError, DataError
from ds_tree.registries import REWARDS
from ds_tree.rollout.loop import SlotSummary, StepRollouts, kept_groups, rank_slots, run_tokenizer, slot_generator
from ds_tree.rollout.rewards import RewardRequest, score
from ds_tree.sampling.hf import SampledTree
from ds_tree.sampling.prompts import Prompt, read_prompts, stop_token_ids
from ds_tree.sampling.settings import path_limit
from ds_tree.trees.trajectory import Trajectory

logger = logging.getLogger(__name__)


@dataclass
class SlotResult:
    """One slot's sampled tree, scored (what a rank sends to the others)."""

    slot: int
    trajectories: list[Trajectory]
    """The tree's leaves as trajectories, rewards set (``None`` where the reward function failed)."""
    prompt_tokens: int
    leaves: int
    depth: int
    sampled_tokens: int
    """Distinct tokens the sampler drew (each shared segment once)."""
    forward_tokens: int
    """Tokens the sampler ran through the model (prompt prefill included)."""
    failures: list[str] = field(default_factory=list)
    """The reward function's failure messages."""


@dataclass
class SlotFigures:
    """What the ``rollout/`` metrics need of a slot (what a rank sends of it: no tokens)."""

    rewards: list[float]
    """The rewards of its trajectories that have one, in order."""
    lengths: list[int]
    """Every trajectory's tokens."""
    prompt_tokens: int
    leaves: int
    depth: int
    sampled_tokens: int
    forward_tokens: int
    failures: list[str]

    @classmethod
    def of(cls, result: SlotResult) -> SlotFigures:
        return cls(
            rewards=[t.reward for t in result.trajectories if t.reward is not None],
            lengths=[len(t) for t in result.trajectories],
            prompt_tokens=result.prompt_tokens,
            leaves=result.leaves,
            depth=result.depth,
            sampled_tokens=result.sampled_tokens,
            forward_tokens=result.forward_tokens,
            failures=list(result.failures),
        )


def kept_trajectories(results: list[SlotResult]) -> list[Trajectory]:
    """Every slot's trajectories in slot order, those without a reward dropped with one warning naming them."""
    kept, dropped = [], []
    for result in sorted(results, key=lambda r: r.slot):
        for trajectory in result.trajectories:
            (dropped if trajectory.reward is None else kept).append(trajectory)
    if dropped:
        names = ", ".join(t.where for t in dropped[:8]) + (", ..." if len(dropped) > 8 else "")
        logger.warning(
            "%d trajectories without a reward (the reward function failed) are dropped: %s", len(dropped), names
        )
    return kept


def rollout_scalars(figures: list[SlotFigures]) -> dict[str, float]:
    """The ``rollout/`` metrics of one step's slots (all ranks' :class:`SlotFigures`).

    ``reward_mean`` over the trajectories with a reward; ``leaves`` and ``depth`` are means per tree;
    ``por`` is 1 - tree tokens / flat tokens of the sampled trees (prompt once per tree against the
    prompt once per trajectory); ``tokens_saved`` the completion tokens that sampling every leaf on its
    own would draw minus those the sampler drew (0 for independent sampling).
    """
    rewards = [reward for f in figures for reward in f.rewards]
    flat = sum(length for f in figures for length in f.lengths)
    tree = sum(f.prompt_tokens + f.sampled_tokens for f in figures)
    independent = sum(length - f.prompt_tokens for f in figures for length in f.lengths)
    sampled = sum(f.sampled_tokens for f in figures)
    return {
        "rollout/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
        "rollout/leaves": float(np.mean([f.leaves for f in figures])),
        "rollout/depth": float(np.mean([f.depth for f in figures])),
        "rollout/por": 1.0 - tree / flat if flat else 0.0,
        "rollout/sampled_tokens": float(sampled),
        "rollout/forward_tokens": float(sum(f.forward_tokens for f in figures)),
        "rollout/tokens_saved": float(independent - sampled),
        "rollout/reward_failures": float(sum(len(f.failures) for f in figures)),
    }


class OnlineRollouts(StepRollouts):
    """Single-turn online RL on one rank: each slot a prompt's tree, its leaves scored by ``rollout.reward``."""

    def __init__(self, config, model_config) -> None:
        rollout = config.rollout
        tokenizer = run_tokenizer(config)
        try:
            self.prompts = read_prompts(rollout.prompts, tokenizer, model_config.vocab_size)
        except DataError as error:
            raise ConfigError(f"rollout.prompts: {error}") from None
        longest = max(self.prompts, key=lambda p: p.ids.size)
        limit, what = path_limit(config)
        if longest.ids.size + rollout.max_new_tokens > limit:
            raise ConfigError(
                f"{what} is below the longest prompt ({longest.ids.size} tokens, "
                f"{longest.source}) plus rollout.max_new_tokens ({rollout.max_new_tokens}); "
                "every root-to-leaf path must fit one row"
            )
        self.reward = REWARDS.get(rollout.reward)
        super().__init__(config, model_config, tokenizer, stop_token_ids(tokenizer, model_config), len(self.prompts))

    def sample_slot(self, step: int, slot: int, prompt_index: int, version: int | None = None) -> SlotResult:
        """One prompt slot: sample its tree, decode and score the leaves; ``version``: the policy version
        the engine holds (the trajectories' ``policy_version``; default ``step``)."""
        return self.scored_slot(step, slot, prompt_index, self.slot_tree(step, slot, prompt_index), version)

    def slot_tree(self, step: int, slot: int, prompt_index: int) -> SampledTree:
        """One prompt slot's tree, sampled from the slot's generator (thread-safe: trees may be sampled at once)."""
        prompt = self.prompts[prompt_index]
        generator = slot_generator(self.config.rollout.seed, step, slot, self.engine.generator_device)
        with torch.no_grad():
            return self.engine.sample_tree(
                prompt.ids.tolist(), self.settings, generator=generator, eos_token_ids=self.stop_ids
            )

    def scored_slot(
        self, step: int, slot: int, prompt_index: int, tree: SampledTree, version: int | None = None
    ) -> SlotResult:
        """A slot's sampled ``tree``, its leaves decoded and scored."""
        prompt = self.prompts[prompt_index]
        # one numbering: the console's, metrics' and saved files' 1-based step (``step`` counts from 0)
        trajectories = tree.trajectories(f"{prompt.label}/step{step + 1}/slot{slot}")
        for leaf, trajectory in enumerate(trajectories):
            trajectory.source = f"{prompt.source} (step {step + 1}, slot {slot}, leaf {leaf})"
            trajectory.policy_version = step if version is None else version
        failures = self.score_leaves(prompt, trajectories)
        return SlotResult(
            slot=slot,
            trajectories=trajectories,
            prompt_tokens=int(prompt.ids.size),
            leaves=tree.leaves,
            depth=tree.depth,
            sampled_tokens=tree.sampled_tokens,
            forward_tokens=tree.forward_tokens,
            failures=failures,
        )

    def completion_text(self, prompt: Prompt, trajectory: Trajectory) -> str:
        """What the reward function reads of a leaf: its completion decoded, special tokens dropped."""
        return self.tokenizer.decode(trajectory.input_ids[prompt.ids.size :].tolist(), skip_special_tokens=True)

    def score_leaves(self, prompt: Prompt, trajectories: list[Trajectory]) -> list[str]:
        """Set each leaf's reward by ``rollout.reward`` (None where it failed); the failures' messages."""
        requests = [RewardRequest(prompt.text, self.completion_text(prompt, t), prompt.metadata) for t in trajectories]
        rewards, failures = score(self.reward, requests)
        for trajectory, reward in zip(trajectories, rewards, strict=True):
            trajectory.reward = reward
        return list(failures)

    def sample_share(self, step: int, version: int) -> list[SlotResult]:
        """This rank's slots of ``step`` (no collective: the background sampler runs it too)."""
        prompt_indices = self.sampler.groups_for_step(step)
        slots = rank_slots(len(prompt_indices), dist.get_rank(), dist.get_world_size())
        if self.engine.concurrent_trees < 2 or len(slots) < 2:
            return [self.sample_slot(step, slot, prompt_indices[slot], version) for slot in slots]
        # several servers: the trees in flight together (each slot's own generator: the same trees), then
        # decoded and scored one after another on this thread (a reward function need not be thread-safe)
        workers = min(self.engine.concurrent_trees, len(slots))
        with ThreadPoolExecutor(workers, thread_name_prefix="slot-tree") as pool:
            trees = list(pool.map(lambda slot: self.slot_tree(step, slot, prompt_indices[slot]), slots))
        return [
            self.scored_slot(step, slot, prompt_indices[slot], tree, version)
            for slot, tree in zip(slots, trees, strict=True)
        ]

    def slot_figures(self, result: SlotResult) -> SlotFigures:
        return SlotFigures.of(result)

    def figure_scalars(self, summaries: list[SlotSummary]) -> dict[str, float]:
        return rollout_scalars([summary.figures for summary in summaries])  # rank order, as they were gathered

    def trainable(self, results: list[SlotResult]) -> list[list[Trajectory]]:
        """Each slot's trajectories with a reward (those without dropped with one warning naming them)."""
        kept = {id(t) for t in kept_trajectories(results)}
        return [[t for t in result.trajectories if id(t) in kept] for result in results]

    def check_groups(self, step: int, results: list[SlotResult], summaries: list[SlotSummary]) -> None:
        """A step needs a group per mini-batch at least (every rank raises alike)."""
        groups = kept_groups(summaries)
        if groups < self.config.objective.mini_batches:
            failures = [message for summary in summaries for message in summary.figures.failures]
            raise RuntimeError(
                f"step {step + 1}: the reward function failed on every leaf of some prompts; {groups} group(s) are "
                f"left for objective.mini_batches={self.config.objective.mini_batches}. First failure: {failures[0]}"
            )
