"""The online loop's multi-turn mode: each slot is a task's episode tree against an environment
(docs/ENVIRONMENTS.md; the step's machinery is :mod:`ds_tree.rollout.loop`'s).

A task is a line of ``rollout.prompts`` (:mod:`ds_tree.rollout.episodes.tasks`); the episode runner
(:mod:`ds_tree.rollout.episodes.runner`) samples its tree on the engine's turn sampler, rendering with the
chat format (``rollout.env.format``) and stepping the environment (``rollout.env.path``); the tree's kept
leaves are the step's trajectories (:mod:`ds_tree.rollout.episodes.tree`), its metrics and saved rollouts
are :mod:`ds_tree.rollout.episodes.records`'. The run's first ``rollout.env.warmup_steps`` steps (and
every ``refresh_every``-th after) train instead on demonstrations the environment writes
(:meth:`MultiTurnRollouts.demonstrations`), and sample nothing.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

from ds_tree.data.convert import load_tokenizer
from ds_tree.errors import ConfigError, DataError, RolloutError
from ds_tree.models.vision import attach_rope_positions
from ds_tree.registries import ENVIRONMENTS
from ds_tree.rollout.env import Environment, EnvironmentCalls, awaited
from ds_tree.rollout.episodes.records import EpisodeFigures, episode_scalars, lost_tasks, save_rollouts
from ds_tree.rollout.episodes.runner import EpisodeRunner
from ds_tree.rollout.episodes.tasks import read_tasks
from ds_tree.rollout.episodes.tree import EpisodeTree
from ds_tree.rollout.images import observation_images, rendering_stand_ins, with_pil_images
from ds_tree.rollout.loop import SlotSummary, StepRollouts, kept_groups, rank_slots, run_tokenizer, slot_generator
from ds_tree.rollout.render import Renderer
from ds_tree.sampling.prompts import stop_token_ids
from ds_tree.sampling.settings import SamplerSettings, path_limit
from ds_tree.trees.images import placeholder_index
from ds_tree.trees.trajectory import Trajectory
from ds_tree.turn_formats import resolve_format, turn_stop_tokens

logger = logging.getLogger(__name__)


def gathered_trees(trees: list[EpisodeTree], to_first: bool = False) -> list[EpisodeTree]:
    """Every rank's episode trees in slot order, on every rank (``to_first``: on rank 0 only; a collective)."""
    if to_first:
        every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(trees, every, dst=0)
    else:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, trees)
    return sorted((tree for share in every or [] for tree in share), key=lambda tree: tree.slot)


class MultiTurnRollouts(StepRollouts):
    """The online loop's multi-turn mode on one rank: each slot a task's episode tree (module docstring)."""

    def __init__(self, config, model_config) -> None:
        rollout = config.rollout
        tokenizer = run_tokenizer(config)
        try:
            self.tasks = read_tasks(rollout.prompts)
        except DataError as error:
            raise ConfigError(f"rollout.prompts: {error}") from None
        try:
            turn_format = resolve_format(rollout.env.format, tokenizer)
        except ValueError as error:
            raise ConfigError(f"rollout.env.format ({rollout.env.format}) with model.tokenizer: {error}") from None
        stop_ids = stop_token_ids(tokenizer, model_config, turn_stop_tokens(turn_format, tokenizer))
        super().__init__(config, model_config, tokenizer, stop_ids, len(self.tasks))
        self.env_class = ENVIRONMENTS.get(rollout.env.path)
        try:  # its own tokenizer: episodes may render on the background sampler while demonstrations do here
            renderer_tokenizer = load_tokenizer(config.model.tokenizer) if rollout.max_staleness else tokenizer
            self.renderer = Renderer(
                renderer_tokenizer,
                stop_ids,
                rollout.env.max_observation_tokens,
                turn_format,
                observation_images(config.model.tokenizer, model_config, rollout.env.max_image_pixels),
            )
        except ValueError as error:
            raise ConfigError(f"model.tokenizer (chat format {turn_format.name}): {error}") from None
        self.runner: EpisodeRunner | None = None
        """The episodes' runner on the engine's turn sampler, made by the first episode (:meth:`episode_runner`)."""
        self.stopping = threading.Event()
        """Set by :meth:`close`: the episode being sampled stops at its next leaf, its environments closed."""

    def episode_runner(self) -> EpisodeRunner:
        """The runner every episode of the run samples with: one turn sampler of the engine (``hf``'s keeps
        keys/values from a leaf's turn to its next), one pool of environment-call threads."""
        if self.runner is None:
            self.runner = self.new_runner(self.settings)
        return self.runner

    def new_runner(self, settings: SamplerSettings) -> EpisodeRunner:
        """An episode runner sampling with ``settings`` (the run's, or an evaluation's) on its own turn sampler
        of the engine, with its own pool of environment-call threads."""
        env = self.config.rollout.env
        return EpisodeRunner(
            self.env_class,
            self.renderer,
            self.engine.turn_sampler(settings, self.stop_ids),
            settings,
            env,
            env.max_context_tokens or path_limit(self.config)[0],
            EnvironmentCalls(env.workers),
            stopping=self.stopping,
        )

    def sample_episode(self, step: int, slot: int, task_index: int, version: int | None = None) -> EpisodeTree:
        """One task's episode tree, every turn sampled by policy ``version`` (default ``step``)."""
        task = self.tasks[task_index]
        runner = self.episode_runner()
        generator = slot_generator(self.config.rollout.seed, step, slot, runner.sampler.generator_device)
        version = step if version is None else version
        with torch.no_grad():
            tree = runner.run(task.task, task.label, slot, version, generator)
        # one numbering: the console's and the saved file's 1-based step (``step`` counts from 0)
        tree.build_leaves(f"{task.label}/step{step + 1}/slot{slot}", f"{task.source} (step {step + 1}, slot {slot})")
        return tree

    def sample_share(self, step: int, version: int) -> list[EpisodeTree]:
        """This rank's episode trees of ``step`` (no collective: the background sampler runs it too, and
        its environments are made, forked and closed on that thread)."""
        indices = self.sampler.groups_for_step(step)
        slots = rank_slots(len(indices), dist.get_rank(), dist.get_world_size())
        return [self.sample_episode(step, slot, indices[slot], version) for slot in slots]

    def join_timeout_s(self) -> float:
        """Closing stops the episode being sampled at its next leaf (:class:`EpisodeRunner`): one leaf's
        forks, turn and steps, each environment call within ``step_timeout_s``."""
        return 5.0 + self.config.rollout.env.step_timeout_s * (self.config.rollout.width + 2)

    def warming_up(self, step: int) -> bool:
        """Whether ``step`` (0-based) is an SFT step: one of ``rollout.env.warmup_steps``, or a refresh
        (``rollout.env.refresh_every``)."""
        env = self.config.rollout.env
        if step < env.warmup_steps:
            return True
        return bool(env.refresh_every) and (step - env.warmup_steps) % env.refresh_every == env.refresh_every - 1

    def demonstrations(self, step: int, update: int) -> list[Trajectory]:
        """The warm-up's demonstrations of one update of ``step``: one per task of the step's order,
        written by the environment's ``demonstration(task, rng)`` and rendered with the chat
        template (every assistant turn trained). Every rank builds the same list."""
        import random

        from ds_tree.data.chat import render_chat

        trajectories = []
        settings = self.config.rollout.env
        calls = EnvironmentCalls(settings.workers)  # user code gets a deadline: a hang is an error, not a stall
        for slot, index in enumerate(self.sampler.groups_for_step(step)):
            task = self.tasks[index]
            rng = random.Random(f"{self.config.rollout.seed}/{step}/{update}/{slot}")
            where = f"{settings.path} demonstration of {task.label} (step {step + 1}, update {update})"
            env = None
            try:
                env = calls.call(self.env_class, timeout=settings.step_timeout_s)
                messages = calls.call(env.demonstration, task.task, rng, timeout=settings.step_timeout_s)
                messages = with_pil_images("demonstration", messages)
                images = self.renderer.images_of(messages)
                seen = {"image_token_id": self.vision_token(), "image_tokens": [i.tokens for i in images]}
                messages = rendering_stand_ins(messages)  # image parts as the records' paths: rendered alike
                rendered = render_chat(self.tokenizer, messages, self.tools_of(env), where=where, **seen)
                if step >= self.config.rollout.env.warmup_steps:  # a refresh: every assistant turn but the last
                    last = render_chat(
                        self.tokenizer, messages, self.tools_of(env), where=where, train_on="last_assistant", **seen
                    )
                    rendered.loss_mask = rendered.loss_mask - last.loss_mask
            except Exception as error:  # a broken demonstration is the environment's bug: stop, naming it
                raise DataError(f"{where}: {type(error).__name__}: {error}") from error
            finally:
                try:
                    if env is not None:
                        awaited(env.close())
                except Exception as error:  # best effort, as after an episode
                    logger.warning("environment close failed: %s: %s", type(error).__name__, error)
            index = placeholder_index(rendered.input_ids, self.vision_token(), images) if images else None
            trajectories.append(
                Trajectory(
                    input_ids=rendered.input_ids,
                    loss_mask=rendered.loss_mask,
                    group_id=f"{task.label}/step{step + 1}/update{update}/slot{slot}",
                    source=where,
                    images=tuple(images),
                    image_index=index,
                )
            )
        attach_rope_positions(self.model_config, trajectories)
        return trajectories

    def vision_token(self) -> int | None:
        return self.renderer.images.image_token_id if self.renderer.images is not None else None

    def tools_of(self, env: Environment) -> list[dict] | None:
        return env.tool_schemas() or None

    def slot_figures(self, tree: EpisodeTree) -> EpisodeFigures:
        return EpisodeFigures.of(tree)

    def figure_scalars(self, summaries: list[SlotSummary]) -> dict[str, float]:
        return episode_scalars([summary.figures for summary in sorted(summaries, key=lambda s: s.slot)])

    def trainable(self, trees: list[EpisodeTree]) -> list[list[Trajectory]]:
        """Each episode tree's kept leaves, with the model's own rotary positions for image observations."""
        kept = [[leaf.trajectory for leaf in tree.leaves] for tree in trees]
        attach_rope_positions(self.model_config, [t for leaves in kept for t in leaves])
        return kept

    def after_sampling(self, step: int, trees: list[EpisodeTree]) -> None:
        """``rollout.env.save_rollouts``: rank 0 writes every rank's trees of the step (sent to it alone)."""
        if self.config.rollout.env.save_rollouts:
            every = gathered_trees(trees, to_first=True)
            if dist.get_rank() == 0:
                save_rollouts(self.config.output_dir, step + 1, every)

    def check_groups(self, step: int, trees: list[EpisodeTree], summaries: list[SlotSummary]) -> None:
        """A step needs a task with a kept leaf per mini-batch at least; why the others lost theirs (every
        rank's trees gathered on this failure only)."""
        groups = kept_groups(summaries)
        if groups < self.config.objective.mini_batches:
            env = self.config.rollout.env
            every = gathered_trees(trees)
            why = lost_tasks(every, env.max_context_tokens or path_limit(self.config)[0], env.episode_timeout_s)
            raise RolloutError(
                f"step {step + 1}: only {groups} task(s) kept a leaf, fewer than objective.mini_batches="
                f"{self.config.objective.mini_batches}; the others lost every leaf to: {why}"
            )

    def close(self) -> None:
        """Stop the episode the background sampler is in (its environments closed), then as online RL."""
        self.stopping.set()
        super().close()
