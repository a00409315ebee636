"""The ``eval`` section at work (docs/EVAL.md): the trainer's evaluation component, and ``ds-tree eval``'s.

:meth:`Evaluator.prepare` (the dry run's checks: the held-out data, prompts or tasks, ``checkpoint.keep_best``),
:meth:`Evaluator.connect` (the model and layout to evaluate with), then :meth:`Evaluator.after_step` after every
training step: every ``eval.every_steps`` steps and after the last one it runs :meth:`Evaluator.evaluate` (a
collective; every rank gets the same scalars) and scores the step for the best checkpoint
(:meth:`Evaluator.checkpoint_saved`).

An evaluation leaves the training run as it was: it runs without gradients with the model in eval mode, its
samples come from generators of their own (:func:`~ds_tree.evaluation.tasks.eval_generator`), and the
global random states (Python's, numpy's, torch's) are put back after it (:func:`preserved_random_state`:
an environment or a reward function may draw from them); the weights it samples with are those the next step
syncs into the engine (:meth:`~ds_tree.rollout.loop.StepRollouts.sync_for_eval`). Each rank samples every
``world_size``-th task (:func:`~ds_tree.rollout.loop.rank_slots`); the outcomes are gathered in task order,
and a task missing or twice is an error.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.atomic import remove
from ds_tree.config import Config, ConfigError
from ds_tree.engine.runners import RunContext
from ds_tree.evaluation.heldout import HeldOutData, LossRun
from ds_tree.evaluation.scores import TaskOutcome, tagged_scalars
from ds_tree.evaluation.tasks import EpisodeTasks, PromptTasks, eval_tasks
from ds_tree.objectives.base import Rollouts, StepContext
from ds_tree.rollout.loop import raise_any, rank_slots
from ds_tree.run.best import BestCheckpoint
from ds_tree.sampling.interface import EngineError

logger = logging.getLogger(__name__)


@dataclass
class EvalContext:
    """What an evaluation runs on: the model (forwards without gradients), the layout and this rank."""

    model: torch.nn.Module
    """The policy's module (a ZeRO-3 engine's: its forwards gather the parameters collectively)."""
    loss_run: LossRun
    rank: int
    world_size: int
    rollouts: Rollouts | None
    """The run's rollouts: the sampling engine, tokenizer, reward or environment (None: no online RL)."""

    @classmethod
    def of(cls, context: StepContext) -> EvalContext:
        """A training run's, from its step context."""
        policy = context.policy
        run = RunContext(policy.device, context.config.model.head_chunk, context.layout.dfs_settings())
        loss_run = LossRun(policy.module, context.plan, run)
        return cls(policy.module, loss_run, context.rank, dist.get_world_size(), context.online)


class Evaluator:
    """The run's ``eval`` section (module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.data: HeldOutData | None = None
        """``eval.data`` (:meth:`prepare`)."""
        self.tasks: PromptTasks | EpisodeTasks | None = None
        """``eval.prompts`` (:meth:`prepare`)."""
        self.best: BestCheckpoint | None = None
        """``checkpoint.keep_best`` (rank 0, :meth:`connect`)."""
        self.context: EvalContext | None = None
        self.scores: tuple[int, dict[str, float]] | None = None
        """The last evaluation: its step and scalars."""
        self.outcomes: list[TaskOutcome] = []
        """The last evaluation's sampled tasks, in task order (every rank's)."""

    @property
    def enabled(self) -> bool:
        return self.config.eval.enabled

    # ------------------------------------------------------------------ set-up
    def prepare(self, model_config, rollouts: Rollouts | None) -> None:
        """Everything that can fail on bad input, before any model is built: the held-out data, the prompts or
        tasks (through the run's ``rollouts``), and a ``checkpoint.keep_best`` that names a tag's metric."""
        settings = self.config.eval
        if settings.data:
            self.data = HeldOutData(self.config, model_config)
        if settings.prompts:
            self.tasks = eval_tasks(self.config, rollouts)
        self.check_keep_best()

    def check_keep_best(self) -> None:
        best = self.config.checkpoint.keep_best
        if not best or best in self.config.eval.metrics():
            return
        names = self.metric_names()
        if best not in names:
            raise ConfigError(f"checkpoint.keep_best: no evaluation produces {best!r}; it gives {', '.join(names)}")

    def metric_names(self) -> list[str]:
        """Every score the evaluation gives (``checkpoint.keep_best``'s choices), per tag included."""
        names = self.config.eval.metrics()
        k = self.config.eval.k
        for tag in sorted(self.tasks.tags()) if self.tasks is not None else ():
            names += list(dict.fromkeys([f"eval/{tag}/reward_mean", f"eval/{tag}/pass@1", f"eval/{tag}/pass@{k}"]))
        return names

    def connect(self, context: EvalContext, checkpoint_dir: Path | None = None, resume_step: int = 0) -> None:
        """The model and layout to evaluate with; rank 0 reads the best checkpoint's record back (a resume)."""
        self.context = context
        keep_best = self.config.checkpoint
        if keep_best.keep_best and checkpoint_dir is not None and context.rank == 0:
            self.best = BestCheckpoint(checkpoint_dir, keep_best.keep_best, keep_best.best_direction())
            self.best.load(resume_step)

    # ------------------------------------------------------------------ the run
    def due(self, done: int) -> bool:
        every = self.config.eval.every_steps
        return self.enabled and (done == self.config.max_steps or bool(every) and done % every == 0)

    def after_step(self, done: int) -> dict[str, float]:
        """After ``done`` steps (every rank): the evaluation's scalars when one is due, else none."""
        if not self.due(done):
            return {}
        scalars = self.evaluate(done)
        self.scores = (done, scalars)
        return scalars

    def evaluate(self, step: int) -> dict[str, float]:
        """The ``eval/`` scalars of the model as it is after ``step`` steps, the same on every rank (a collective);
        rank 0 saves the samples (``eval.save_samples``)."""
        context = self.context
        started = time.perf_counter()
        scalars: dict[str, float] = {}
        with preserved_random_state(), evaluation_mode(context.model):
            if self.data is not None:
                scalars.update(self.data.scalars(context.loss_run))
            if self.tasks is not None:
                context.rollouts.sync_for_eval(step, context.model)
                self.outcomes = self.gathered_outcomes(step)
                settings = self.config.eval
                scalars.update(tagged_scalars(self.outcomes, settings.k, settings.success_threshold))
                if settings.save_samples and context.rank == 0:
                    write_samples(Path(self.config.output_dir) / "eval" / f"step_{step:06d}.jsonl", self.outcomes)
        seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        scalars["eval/seconds"] = float(seconds.item())
        return scalars

    def gathered_outcomes(self, step: int) -> list[TaskOutcome]:
        """Every task's outcome, this rank sampling its share (:func:`rank_slots`), gathered in task order; a
        sampling failure on any rank is raised on every rank."""
        context = self.context
        mine, failure = [], None
        try:
            for index in rank_slots(len(self.tasks), context.rank, context.world_size):
                mine.append(self.tasks.sample(step, index))
        except EngineError as error:
            failure = f"evaluation after step {step}: {type(error).__name__}: {error}"
        gathered: list = [None] * context.world_size
        dist.all_gather_object(gathered, (mine, failure))
        raise_any(*[f"rank {rank}: {failed}" for rank, (_, failed) in enumerate(gathered) if failed], gather=False)
        return in_task_order([outcome for share, _ in gathered for outcome in share], len(self.tasks))

    # ------------------------------------------------------------------ the best checkpoint
    def kept_checkpoints(self) -> tuple[str, ...]:
        """The checkpoints rotation must not delete (the best one; rank 0)."""
        return self.best.kept() if self.best is not None else ()

    def checkpoint_saved(self, step: int) -> None:
        """Checkpoint ``step`` is complete: rank 0 records it as the best when its evaluation scored best."""
        if self.best is None or self.scores is None or self.scores[0] != step:
            return
        value = self.scores[1].get(self.best.metric, float("nan"))
        self.best.consider(step, value, self.config.checkpoint.keep_last)


def in_task_order(outcomes: list[TaskOutcome], count: int) -> list[TaskOutcome]:
    """``outcomes`` sorted by task, checked to hold each of the ``count`` tasks exactly once."""
    ordered = sorted(outcomes, key=lambda outcome: outcome.index)
    if [outcome.index for outcome in ordered] != list(range(count)):
        seen = [outcome.index for outcome in ordered]
        twice = sorted({index for index in seen if seen.count(index) > 1})
        missing = sorted(set(range(count)) - set(seen))
        raise RuntimeError(f"the evaluation's tasks were not each sampled once: missing {missing}, twice {twice}")
    return ordered


def write_samples(path: Path, outcomes: list[TaskOutcome]) -> Path:
    """Every sample of ``outcomes`` to ``path`` (a run's ``eval/step_<N>.jsonl``; its folder made, the file
    replaced atomically), a record a line in task order: a tokens record (``input_ids``, ``loss_mask``,
    ``reward``) with its task, tag, sample index and success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    remove(partial)  # a leftover, or a link planted under its name: created anew ("x"), never followed
    with partial.open("x") as handle:
        for outcome in outcomes:
            for sample, record in enumerate(outcome.records):
                handle.write(json.dumps({**record, "sample": sample}) + "\n")
    partial.replace(path)
    return path


@contextmanager
def preserved_random_state() -> Iterator[None]:
    """Python's, numpy's and torch's global random states (CPU and CUDA) as they were before the block."""
    python, numpy = random.getstate(), np.random.get_state()
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextmanager
def evaluation_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) inside the block, each module's training mode back after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
