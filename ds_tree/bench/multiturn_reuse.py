"""Tokens the multi-turn sampler draws and runs through the model (docs/ENVIRONMENTS.md, *Measured*).

Episode trees against independent episodes of the same width, and against trees whose every turn
prefills its whole path again (keys/values not carried across turns). Every mode samples the same
tasks with the same settings and seeds (slot ``i``'s generator of seed 0, step 0).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ds_tree.errors import ConfigError
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.vision import attention_implementations, is_vision_language
from ds_tree.registries import ENVIRONMENTS, configured
from ds_tree.rollout.env import EnvironmentCalls
from ds_tree.rollout.episodes.runner import EpisodeRunner
from ds_tree.rollout.episodes.tasks import Task, read_tasks
from ds_tree.rollout.images import observation_images
from ds_tree.rollout.loop import slot_generator
from ds_tree.rollout.render import Renderer
from ds_tree.sampling.hf_engine import HFTurnSampler
from ds_tree.sampling.prompts import stop_token_ids
from ds_tree.sampling.settings import path_limit
from ds_tree.turn_formats import resolve_format, turn_stop_tokens

MODES = {"tree": (False, True), "tree, every turn prefilled": (False, False), "independent": (True, True)}
"""Sampling mode -> (``rollout.independent``, keys/values carried across turns)."""

COLUMNS = ("sampling", "leaves", "reward", "sampled_tokens", "forward_tokens", "tree_tokens", "flat_tokens")
"""The keys of a row of :func:`measure_reuse`."""


def measure_reuse(model, tokenizer, config, tasks: list[Task]) -> list[dict]:
    """One row per mode of :data:`MODES` over ``tasks``: leaves, mean leaf reward, tokens sampled,
    tokens fed to the model, tokens of the episode trees and of their leaves laid out flat.

    ``config`` is a loaded training config with ``rollout.env.path`` (its sampler settings, env
    settings and path limit are used); ``model`` a Hugging Face causal LM in eval mode."""
    env = config.rollout.env
    try:  # as the trainer builds them (rollout.multiturn.MultiTurnRollouts); a VL policy reads image observations
        turn_format = resolve_format(env.format, tokenizer)
        stops = stop_token_ids(tokenizer, model.config, turn_stop_tokens(turn_format, tokenizer))
        images = observation_images(config.model.tokenizer, model.config, env.max_image_pixels)
        renderer = Renderer(tokenizer, stops, env.max_observation_tokens, turn_format, images)
    except ValueError as error:
        raise ConfigError(f"rollout.env.format ({env.format}) and model.tokenizer: {error}") from None
    rows = []
    for name, (independent, carry) in MODES.items():
        settings = dataclasses.replace(config.rollout.sampler_settings(), independent=independent)
        runner = EpisodeRunner(
            ENVIRONMENTS.get(env.path),
            renderer,
            HFTurnSampler(model, settings, stops, carry=carry),
            settings,
            env,
            env.max_context_tokens or path_limit(config)[0],
            EnvironmentCalls(env.workers),
        )
        leaves = rewards = sampled = forward = tree_tokens = flat = 0
        for slot, task in enumerate(tasks):
            with torch.no_grad():
                tree = runner.run(task.task, task.label, slot, 0, slot_generator(0, 0, slot))
            tree.build_leaves(task.label, task.source)
            leaves += len(tree.leaves)
            rewards += sum(leaf.trajectory.reward for leaf in tree.leaves)
            sampled += tree.sampled_tokens
            forward += tree.forward_tokens
            tree_tokens += sum(len(node.token_ids) for node in tree.nodes)
            flat += sum(len(leaf.trajectory) for leaf in tree.leaves)
        values = (name, leaves, rewards / max(leaves, 1), sampled, forward, tree_tokens, flat)
        rows.append(dict(zip(COLUMNS, values, strict=True)))
    return rows


def multiturn_reuse(
    model_dir: str | Path, tokenizer_dir: str | Path, tasks_path: str | Path, config_path: str | Path, count: int = 16
) -> list[dict]:
    """:func:`measure_reuse` of the trained policy in ``model_dir`` (a Hugging Face directory) on the
    first ``count`` tasks of ``tasks_path``, with the training config at ``config_path`` (its model,
    tokenizer and prompts replaced by these). Raises :class:`~ds_tree.errors.ConfigError` for a
    config without a loadable ``rollout.env.path``, :class:`~ds_tree.errors.DataError` for a missing
    model directory, unreadable tasks or tokenizer, ValueError for ``count`` below 1."""
    from ds_tree.config import load_config
    from ds_tree.data.convert import load_tokenizer
    from ds_tree.errors import DataError

    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not load_config(config_path).rollout.env.path:  # as written: the overrides below need a rollout section
        raise ConfigError(f"{config_path}: rollout.env.path is not set (not a multi-turn config)")
    overrides = [f"model.source={model_dir}", f"model.tokenizer={tokenizer_dir}", f"rollout.prompts={tasks_path}"]
    config = load_config(config_path, overrides)
    try:
        configured(ENVIRONMENTS, config.rollout.env.path)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    if not Path(model_dir).is_dir():
        raise DataError(f"{model_dir}: no such model directory")
    tokenizer = load_tokenizer(tokenizer_dir)
    tasks = read_tasks(tasks_path)[:count]
    return measure_reuse(sampling_model(model_dir), tokenizer, config, tasks)


def sampling_model(model_dir: str | Path):
    """The Hugging Face model in ``model_dir`` with transformers' own attention, in eval mode: a causal LM, or a
    vision-language model (its language model samples, its tower encodes the observations' images)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if is_vision_language(load_model_config(model_dir)):
        model_class, implementation = AutoModelForImageTextToText, attention_implementations("sdpa")
    else:
        model_class, implementation = AutoModelForCausalLM, "sdpa"
    return model_class.from_pretrained(str(model_dir), attn_implementation=implementation).eval()
