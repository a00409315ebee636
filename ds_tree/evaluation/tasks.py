"""Held-out prompts and tasks (``eval.prompts``; docs/EVAL.md): each sampled ``eval.samples`` times on the run's
sampling engine and scored as training scores them.

Single-turn (:class:`PromptTasks`): a prompt's samples are one tree of independent completions (the prompt
shared), scored by ``rollout.reward``. Multi-turn (:class:`EpisodeTasks`): a task's samples are independent
episodes against ``rollout.env.path`` forked at the prompt, each scored by its return. The samples are
independent, as pass@k's estimator assumes; the sampler's other settings (top-p, stop rules, the chat format)
are ``rollout``'s, with ``eval.temperature`` and ``eval.max_new_tokens``.

Task ``i`` of the evaluation after step ``s`` samples from its own generator, seeded from ``(eval.seed, s, i)``
(:func:`eval_generator`): never a training generator, the same on any number of ranks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ds_tree.config import Config, ConfigError
from ds_tree.errors import DataError
from ds_tree.evaluation.scores import TaskOutcome
from ds_tree.rollout.episodes.records import leaf_record
from ds_tree.rollout.episodes.tasks import read_tasks
from ds_tree.rollout.multiturn import MultiTurnRollouts
from ds_tree.rollout.online import OnlineRollouts
from ds_tree.sampling.prompts import check_tag, read_prompts
from ds_tree.sampling.settings import SamplerSettings, path_limit

EVAL_STREAM = 0x6576616C
"""``"eval"``: the first entropy word of an evaluation's seeds, so no evaluation seed is a training slot's."""


def eval_generator(seed: int, step: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of task ``index`` in the evaluation after ``step`` steps: a function of those only."""
    state = np.random.SeedSequence([EVAL_STREAM, seed, step, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device=device).manual_seed(int(state))


def eval_settings(config: Config) -> SamplerSettings:
    """The rollout's sampler settings with ``eval.samples`` independent samples, ``eval.temperature`` and
    ``eval.max_new_tokens``."""
    evaluation, rollout = config.eval, config.rollout
    return dataclasses.replace(
        rollout.sampler_settings(),
        width=evaluation.samples,
        temperature=evaluation.temperature,
        max_new_tokens=evaluation.max_new_tokens or rollout.max_new_tokens,
        independent=True,
    )


class PromptTasks:
    """``eval.prompts`` of single-turn online RL (module docstring)."""

    def __init__(self, config: Config, rollouts: OnlineRollouts) -> None:
        self.config = config
        self.rollouts = rollouts
        self.settings = eval_settings(config)
        try:
            self.prompts = read_prompts(config.eval.prompts, rollouts.tokenizer, rollouts.model_config.vocab_size)
        except DataError as error:
            raise ConfigError(f"eval.prompts: {error}") from None
        longest = max(self.prompts, key=lambda p: p.ids.size)
        limit, what = path_limit(config)
        if longest.ids.size + self.settings.max_new_tokens > limit:
            raise ConfigError(
                f"eval.prompts: {longest.source} ({longest.ids.size} tokens) plus {self.settings.max_new_tokens} new "
                f"tokens (eval.max_new_tokens, or rollout's) is more than {what}: every path must fit one row"
            )

    def __len__(self) -> int:
        return len(self.prompts)

    def tags(self) -> set[str]:
        return {prompt.tag for prompt in self.prompts if prompt.tag}

    def sample(self, step: int, index: int) -> TaskOutcome:
        """Prompt ``index``'s samples after ``step`` steps, scored (no collective)."""
        prompt, engine, threshold = self.prompts[index], self.rollouts.engine, self.config.eval.success_threshold
        generator = eval_generator(self.config.eval.seed, step, index, engine.generator_device)
        with torch.no_grad():
            tree = engine.sample_tree(
                prompt.ids.tolist(), self.settings, generator=generator, eos_token_ids=self.rollouts.stop_ids
            )
        trajectories = tree.trajectories(f"{prompt.label}/eval{step}")
        self.rollouts.score_leaves(prompt, trajectories)  # a failed reward: None, a lost sample
        records = [
            {
                "group_id": trajectory.group_id,
                "trial": trajectory.trial,
                "input_ids": trajectory.input_ids.tolist(),
                "loss_mask": trajectory.loss_mask.astype(int).tolist(),
                "reward": trajectory.reward,
                "success": trajectory.reward is not None and trajectory.reward >= threshold,
                "task": prompt.label,
                "tag": prompt.tag,
                "completion": self.rollouts.completion_text(prompt, trajectory),
            }
            for trajectory in trajectories
        ]
        return TaskOutcome(index, prompt.label, prompt.tag, [t.reward for t in trajectories], records)


class EpisodeTasks:
    """``eval.prompts`` of multi-turn online RL: the environment's held-out tasks (module docstring)."""

    def __init__(self, config: Config, rollouts: MultiTurnRollouts) -> None:
        self.config = config
        self.rollouts = rollouts
        self.settings = eval_settings(config)
        try:
            self.tasks = read_tasks(config.eval.prompts)
            self.task_tags = [check_tag(task.source, task.task.get("tag", "")) for task in self.tasks]
        except DataError as error:
            raise ConfigError(f"eval.prompts: {error}") from None
        self.runner = None
        """The episodes' runner (:meth:`MultiTurnRollouts.new_runner`), made by the first episode."""

    def __len__(self) -> int:
        return len(self.tasks)

    def tags(self) -> set[str]:
        return {tag for tag in self.task_tags if tag}

    def sample(self, step: int, index: int) -> TaskOutcome:
        """Task ``index``'s episodes after ``step`` steps, each scored by its return (no collective). An
        episode that kept no leaf (an environment error, no sampled token) is a lost sample."""
        if self.runner is None:
            self.runner = self.rollouts.new_runner(self.settings)
        task, tag, samples = self.tasks[index], self.task_tags[index], self.config.eval.samples
        generator = eval_generator(self.config.eval.seed, step, index, self.runner.sampler.generator_device)
        with torch.no_grad():
            tree = self.runner.run(task.task, task.label, index, step, generator)
        tree.build_leaves(f"{task.label}/eval{step}", f"{task.source} (evaluation after step {step})")
        ends = [leaf for leaf in tree.leaves if leaf.stop_reason != "rewritten"][:samples]  # one per episode
        threshold = self.config.eval.success_threshold
        records = [
            leaf_record(leaf, task.label) | {"tag": tag, "success": leaf.trajectory.reward >= threshold}
            for leaf in ends
        ]
        rewards = [leaf.trajectory.reward for leaf in ends] + [None] * (samples - len(ends))
        return TaskOutcome(index, task.label, tag, rewards, records)


def eval_tasks(config: Config, rollouts) -> PromptTasks | EpisodeTasks:
    """The held-out prompts (single-turn) or tasks (``rollout.env.path``) of ``eval.prompts``."""
    return EpisodeTasks(config, rollouts) if config.rollout.env.path else PromptTasks(config, rollouts)
