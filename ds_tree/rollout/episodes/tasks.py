"""What a multi-turn run reads: the tasks file and the environment class (``rollout.prompts`` and
``rollout.env.path``), and what they need from the rest of the config, checked before any model is built."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from ds_tree.data.jsonl import read_jsonl
from ds_tree.errors import ConfigError, DataError
from ds_tree.registries import ENVIRONMENTS, configured
from ds_tree.rollout.env import Environment, EnvironmentCalls, writes_demonstrations
from ds_tree.sampling.settings import EnvSettings, path_limit

logger = logging.getLogger(__name__)


@dataclass
class Task:
    """One line of the tasks file: the JSON object the environment's ``reset`` gets."""

    task: dict
    label: str
    """The line's ``group_id`` (or ``id``), else ``task-<index>``: the start of its groups' ids."""
    source: str
    """``file:line``."""


def read_tasks(path: str | Path) -> list[Task]:
    """The tasks JSONL (``rollout.prompts`` with ``rollout.env.path``): one JSON object a line."""
    tasks = []
    for index, (where, record) in enumerate(read_jsonl(path)):
        if not isinstance(record, dict):
            raise DataError(f"{where}: a task must be a JSON object")
        tasks.append(Task(record, str(record.get("group_id", record.get("id", f"task-{index}"))), where))
    if not tasks:
        raise DataError(f"{path}: no tasks")
    return tasks


def check_env_config(config) -> None:
    """What ``rollout.env.path`` needs from the rest of the config (raises :class:`ConfigError`)."""
    rollout = config.rollout
    env_class = configured(ENVIRONMENTS, rollout.env.path)
    if rollout.reward:
        raise ConfigError(
            "rollout.reward is not used with rollout.env.path (the environment gives the rewards); remove it"
        )
    for name in ("repetition_ngram", "logprob_floor"):
        if getattr(rollout, name):
            raise ConfigError(f"rollout.{name} is a single-turn sampler setting; set it to 0 with rollout.env.path")
    limit, what = path_limit(config)
    if rollout.env.max_context_tokens > limit:
        raise ConfigError(
            f"rollout.env.max_context_tokens ({rollout.env.max_context_tokens}) is more than {what}: "
            "every root-to-leaf path must fit one row"
        )
    if rollout.env.turn_branching and math.prod(rollout.env.turn_branching) != rollout.width:
        raise ConfigError(
            f"rollout.env.turn_branching {rollout.env.turn_branching} makes {math.prod(rollout.env.turn_branching)} "
            f"leaves a task, not rollout.width ({rollout.width}); make their product the width"
        )
    warmup = rollout.env.warmup_steps
    for name in ("warmup_steps", "refresh_every"):  # both train on demonstrations
        value = getattr(rollout.env, name)
        if value and not writes_demonstrations(env_class):
            raise ConfigError(
                f"rollout.env.{name} ({value}) needs demonstrations, and {rollout.env.path} does not write them: "
                f"it does not override Environment.demonstration(task, rng) (docs/ENVIRONMENTS.md); write it or "
                f"set {name}: 0"
            )
    check_constructor(env_class, rollout.env)
    if warmup:
        if warmup >= config.max_steps:
            raise ConfigError(
                f"rollout.env.warmup_steps ({warmup}) leaves no RL step: it must be less than max_steps "
                f"({config.max_steps})"
            )


def check_constructor(env_class, env: EnvSettings, tries: int = 2) -> None:
    """Build the environment as a run would (under ``step_timeout_s``, then ``close`` it): a
    constructor that fails ``tries`` times in a row would fail every task of every step, a config
    error now rather than a run that keeps no leaf (a failure at run time is a per-task error)."""
    calls = EnvironmentCalls(max(env.workers, tries))
    errors = []
    for _ in range(tries):
        try:
            made = calls.call(env_class, timeout=env.step_timeout_s)
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
            continue
        if not isinstance(made, Environment):
            raise ConfigError(
                f"rollout.env.path {env.path} made a {type(made).__name__}, not an Environment (derive from "
                "ds_tree.rollout.env.Environment)"
            )
        try:
            calls.call(made.close, timeout=env.step_timeout_s)
        except Exception as error:
            logger.warning("environment close failed: %s: %s", type(error).__name__, error)
        return
    raise ConfigError(
        f"rollout.env.path {env.path}: the environment cannot be constructed ({tries} tries, "
        f"each within rollout.env.step_timeout_s={env.step_timeout_s} s): {errors[-1]}"
    )
