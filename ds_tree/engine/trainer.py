"""The DeepSpeed training engine for tree data (docs/DESIGN.md sections 3 and 5).

One optimizer step:
1. the step's groups come from ``(seed, step)``; each rank builds the trees of its share of them, the ranks
   exchange per-part summaries and every rank runs the same balance on them, then each builds its own items:
   trees split into parts under the row budget, packed into rows (each rank pads its list with empty rows to
   the common count, because ZeRO-3 forwards are collective) (:mod:`ds_tree.packing.step_units`). For offline
   data this host work runs one step ahead, while the step before computes (:mod:`ds_tree.engine.plan_ahead`);
2. the normalisers of the objective (trained tokens, sequences) are summed over ranks with one
   all-reduce, before the first forward, so every micro-batch's loss is a term of the global
   objective;
3. each row is a micro-batch: forward, weighted loss, ``engine.backward``. DeepSpeed divides by
   the accumulation steps (skipped: ``scale_wrt_gas=False``) and averages gradients over the
   data-parallel ranks (cancelled: the loss is multiplied by the world size), so the final
   gradient is exactly the single-process flat gradient;
4. ``engine.step()`` at the boundary ds_tree marks itself (the row count varies per step). A step
   whose loss or gradient norm is not finite stops the run or is discarded
   (``optimizer.non_finite``); the decision is taken from all-reduced values, so every rank
   takes the same one.

What a step computes is the objective's (:mod:`ds_tree.objectives`, one class per ``objective.kind``): the
trainer calls :meth:`~ds_tree.objectives.base.Objective.run_step` for every objective alike, with a
:class:`~ds_tree.objectives.base.StepContext` of what a step needs (steps 1-4 above:
:class:`~ds_tree.engine.layout.StepLayout`, :class:`~ds_tree.engine.updates.Updates`), then runs the
self-check hook (:class:`~ds_tree.engine.self_check.SelfCheck`).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tree.attention.registry import resolve_engine
from ds_tree.config import Config, ConfigError, config_to_dict
from ds_tree.data.convert import load_tokenizer
from ds_tree.data.dataset_reader import LoadedGroups, TreeDatasetReader
from ds_tree.data.sampler import StepSampler
from ds_tree.engine.build import Policy, build_engine, load_policy
from ds_tree.engine.layout import StepLayout
from ds_tree.engine.memory import check_memory
from ds_tree.engine.plan_ahead import Planning, planning_group
from ds_tree.engine.self_check import SelfCheck
from ds_tree.engine.updates import Updates
from ds_tree.errors import DataError, HubError
from ds_tree.evaluation.evaluator import EvalContext, Evaluator
from ds_tree.models.hybrid_settings import check_hybrid_settings
from ds_tree.models.loading import check_hub_weights, check_model_settings
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.token_mixing import check_branch_isolation, check_layer_types
from ds_tree.models.ulysses import check_sequence_parallel
from ds_tree.models.vision import check_vision_settings
from ds_tree.objectives.base import Components, Objective, Rollouts, StepContext, StepResult
from ds_tree.packing.exchange import Collectives
from ds_tree.registries import OBJECTIVES
from ds_tree.run import checkpoint, process_group, resume, run_dir, run_lock
from ds_tree.run.console import progress_bar
from ds_tree.run.dataset import prepare_dataset
from ds_tree.run.ds_config import resolve_deepspeed_config
from ds_tree.run.metrics import MetricsLogger, console_line
from ds_tree.run.preemption import PreemptionHandler
from ds_tree.run.trackers import TrackerRun, check_installed, open_trackers
from ds_tree.trees.trajectory import Trajectory

logger = logging.getLogger(__name__)


class Trainer:
    """One rank's run: :meth:`prepare` (everything that can fail on bad input), :meth:`setup` (process group,
    engines, resume), :meth:`train`, :meth:`close`."""

    def __init__(self, config: Config) -> None:
        # ------------------------------------------------------------------ config
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.checkpoint_dir = self.output_dir / "checkpoints"
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        """This rank: the launcher's, then the process group's (:meth:`setup`)."""
        # ------------------------------------------------------------------ components
        self.objective: Objective = OBJECTIVES.get(config.objective.kind)(config)
        self.model_config = None
        """``model.source``'s model config (:meth:`prepare`)."""
        self.attention_engine = ""
        """``model.attention`` resolved (``auto``: flex on CUDA, torch on the CPU)."""
        self.ds_config: dict = {}
        """The resolved DeepSpeed config."""
        self.layout: StepLayout | None = None
        self.trajectories: list[Trajectory] = []
        """``data.path``'s trajectories when they are loaded whole (tokens JSONL; empty for a converted dataset)."""
        self.groups: LoadedGroups | TreeDatasetReader = LoadedGroups([])
        """``data.path``'s groups by index: a converted dataset read lazily (each step reads only the groups a
        rank needs), or tokens JSONL held in memory."""
        self.sampler: StepSampler | None = None
        """Which groups (online: prompts) each step takes."""
        self.online: Rollouts | None = None
        """Online RL (``rollout.enabled``): samples each step's groups (:mod:`ds_tree.rollout.online`)."""
        self.policy: Policy | None = None
        """The policy's model as built, with its ZeRO-3 init config and sequence-parallel group."""
        self.engine = None
        """The policy's DeepSpeed engine."""
        self.updates: Updates | None = None
        self.planning: Planning | None = None
        """Where each step's host work runs: offline data one step ahead on a thread
        (:mod:`ds_tree.engine.plan_ahead`)."""
        self.self_check: SelfCheck | None = None
        self.context: StepContext | None = None
        self.metrics: MetricsLogger | None = None
        self.preemption: PreemptionHandler | None = None
        """The preemption signal handler while :meth:`train` runs (:mod:`ds_tree.run.preemption`)."""
        self.evaluator = Evaluator(config)
        """The ``eval`` section: held-out loss and task success after steps (:mod:`ds_tree.evaluation`)."""
        # ------------------------------------------------------------------ training state
        self.start_step = 0
        self.resume_from: str | None = None
        """The checkpoint this run resumes from (rank 0 plans it in :meth:`prepare`)."""

    # ----------------------------------------------------------------- set-up
    def prepare(self, lock: bool = False) -> None:
        """Everything that can fail on bad input, before any process group exists.

        ``lock``: rank 0 takes the output directory's lock (a run; held until :meth:`close` or the
        process ends) and removes a killed run's leftovers; without it (a dry run) it only checks
        that no other run holds the lock. Rank 0 alone plans the resume (:meth:`resume` tells the others).
        """
        config = self.config
        first = self.rank == 0
        run_dir.check_writable(self.output_dir)
        run_dir.check_not_nested(self.output_dir)
        check_installed(config.logging.report_to)  # W&B, MLflow, trackio are optional extras
        if first and lock:
            run_lock.acquire(self.output_dir)
            run_dir.remove_leftovers(self.output_dir)
        elif first:
            run_lock.check_free(self.output_dir)
        self.model_config = self.load_inputs()
        check_layer_types(self.model_config)
        check_model_settings(config)  # attention engine, objective.reference
        self.attention_engine = resolve_engine(config.model.attention)  # auto: flex on CUDA, torch on the CPU
        check_hybrid_settings(config, self.model_config)  # recurrent layers: no SP, online with the hf sampler
        check_vision_settings(config, self.model_config)  # images: packed rows, offline data
        check_sequence_parallel(config, self.world_size, self.model_config)
        if config.rollout.enabled:
            self.prepare_online()
        else:
            self.prepare_dataset()
        self.evaluator.prepare(self.model_config, self.online)
        text = self.model_config.get_text_config()
        self.ds_config = resolve_deepspeed_config(config, self.world_size, getattr(text, "hidden_size", None))
        self.layout = StepLayout(config, self.ds_config, text.pad_token_id or 0, self.world_size)
        warning = check_memory(config, self.model_config, self.world_size)  # what `ds-tree plan` predicts
        if warning:
            logger.warning(warning)
        if first:
            self.plan_resume()

    def load_inputs(self):
        """``model.source``'s model config, and ``model.tokenizer`` loaded once where a run that exports
        needs it at its end: a hub id (:mod:`ds_tree.hub`) is resolved (downloaded where there is network)
        here, and one that is not cached while offline is an error naming the field now, not after training."""
        config = self.config
        try:
            model_config = load_model_config(config.model.source)
            check_hub_weights(config.model.source)  # offline: the cached snapshot holds the weights
        except HubError as error:
            raise ConfigError(f"model.source: {error}") from None
        if config.model.tokenizer and config.checkpoint.export_hf and not config.rollout.enabled:
            try:
                load_tokenizer(config.model.tokenizer)
            except DataError as error:  # HubError included
                raise ConfigError(f"model.tokenizer: {error}") from None
        return model_config

    def prepare_dataset(self) -> None:
        """:meth:`prepare`'s data: ``data.path``'s groups, their checks, the step sampler
        (:func:`ds_tree.run.dataset.prepare_dataset`)."""
        reads = type(self.objective).check_data is not Objective.check_data
        data = prepare_dataset(self.config, self.model_config, self.objective.check_data if reads else None)
        self.trajectories, self.groups, self.sampler = data.trajectories, data.groups, data.sampler

    def prepare_online(self) -> None:
        """:meth:`prepare`'s data for online RL: prompts, tokenizer and reward function instead of a dataset."""
        from ds_tree.rollout.online import OnlineRollouts

        if self.config.rollout.env.path:  # multi-turn episodes against an environment (docs/ENVIRONMENTS.md)
            from ds_tree.rollout.multiturn import MultiTurnRollouts as OnlineRollouts
        self.online = OnlineRollouts(self.config, self.model_config)
        self.sampler = self.online.sampler

    def plan_resume(self) -> None:
        """Which checkpoint this run resumes from, and whether it may (``checkpoint.resume``, the objective's state)."""
        self.resume_from = resume.plan(self.checkpoint_dir, self.config, self.world_size, self.objective.check_resume)

    def setup(self) -> None:
        """Process group, policy, its DeepSpeed engine, the objective's models, resume. Call :meth:`prepare` first."""
        config = self.config
        self.rank = process_group.start(self.ds_config, config.distributed.timeout_s, self.world_size)
        if self.online is None:  # offline data: each step's host work one step ahead, on its own group
            self.planning = Planning(Collectives(planning_group(config.distributed.timeout_s)))
        if self.online is not None:  # before any zero.Init: the generation copy is never partitioned
            self.online.build_model()
        self.policy = load_policy(config, self.ds_config, self.attention_engine)
        if self.rank == 0:
            logger.info("attention engine: %s (model.attention: %s)", self.attention_engine, config.model.attention)
        self.engine = build_engine(self.policy.model, config, self.ds_config)
        check_branch_isolation(self.engine.module, self.engine.device)  # every rank: collective under ZeRO-3
        self.objective.build(Components(self.engine, self.ds_config, self.policy.hf_deepspeed_config))
        client_state = self.resume()
        self.connect(int(client_state.get("skipped_steps", 0)), int(client_state.get("untrained_steps", 0)))
        self.evaluator.connect(EvalContext.of(self.context), self.checkpoint_dir, self.start_step)
        self.open_metrics()

    def resume(self) -> dict:
        """Load the checkpoint rank 0 chose for every rank, once each of its files matches its record; its
        client state (empty: the run starts at step 0)."""

        def choose() -> str | None:
            if not run_lock.held(self.output_dir):  # a caller that did not lock in prepare
                run_lock.acquire(self.output_dir)
                run_dir.remove_leftovers(self.output_dir)
                self.plan_resume()
            return self.resume_from

        self.resume_from = checkpoint.agree(choose, self.rank, self.engine.device)
        if self.resume_from is None:
            return {}
        path = self.checkpoint_dir / self.resume_from
        client_state = resume.load(
            self.engine,
            self.checkpoint_dir,
            self.resume_from,
            rank=self.rank,
            world_size=self.world_size,
            frozen_base=self.config.model.lora.enabled,  # adapters only: the base is rebuilt
        )
        self.start_step = int(client_state["step"])
        self.objective.load_state(path, self.start_step)
        logger.info("resumed from %s at step %d", path, self.start_step)
        return client_state

    def connect(self, skipped_steps: int = 0, untrained_steps: int = 0) -> None:
        """What a step needs, around the policy's engine: its updates (with the counts a resumed run carries),
        the self-check hook and the objective's step context (again where a check script replaces the engine)."""
        non_finite = self.config.optimizer.non_finite
        self.updates = Updates(
            self.engine, non_finite, self.checkpoint_dir, skipped_steps=skipped_steps, untrained_steps=untrained_steps
        )
        self.self_check = SelfCheck(
            self.config, self.layout, self.engine, self.start_step, self.policy.sequence_parallel
        )
        self.context = StepContext(
            self.config,
            self.engine,
            self.updates,
            self.layout,
            self.self_check,
            self.rank,
            self.groups,
            self.sampler,
            self.online,
            self.planning,
        )

    def open_metrics(self) -> None:
        """The metrics log and rank 0's experiment trackers (``logging.report_to``), continuing their runs after
        a resume; rank 0 records the config this run trains with."""
        trackers = []
        if self.rank == 0:
            settings = self.config.logging
            run = TrackerRun(
                output_dir=self.output_dir,
                project=settings.project,
                name=settings.run_name or self.config.output_dir,
                config=config_to_dict(self.config),
                resume_step=self.start_step,
            )
            trackers = open_trackers(settings.report_to, run)
        self.metrics = MetricsLogger(self.output_dir, self.rank == 0, self.start_step, trackers)
        if self.rank == 0:
            recorded = run_dir.record_config(self.output_dir, self.config, self.start_step)
            if recorded is not None and recorded.name != "config.yaml":
                logger.info("this run's config differs from the recorded one: saved as %s", recorded)

    # ------------------------------------------------------------------ steps
    def train_step(self, step: int) -> dict[str, float]:
        """One training step of the objective, then the self-check hook: the step's scalars."""
        started = time.perf_counter()
        lr = float(self.engine.get_lr()[0])  # the rate this step applies (its first update's, for RL)
        result = self.objective.run_step(step, self.context)
        elapsed = time.perf_counter() - started
        checked = self.self_check.after_step(step, result.loss)  # after the timing: the check is not training
        return {**self.step_scalars(step, result, lr, elapsed), **result.scalars, **checked}

    def step_scalars(self, step: int, result: StepResult, lr: float, elapsed: float) -> dict[str, float]:
        """The scalars of every step: loss, optimizer, throughput, tree shape, time, memory, data epoch."""
        peak = (
            torch.cuda.max_memory_allocated()
            if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        plans = result.plans
        flat_tokens = sum(plan.flat_tokens for plan in plans)
        tree_tokens = sum(plan.tree_tokens for plan in plans)
        packed_tokens = sum(plan.packed_tokens for plan in plans)
        return {
            "loss/train": result.loss,
            "optim/lr": lr,
            "optim/grad_norm": result.grad_norm if result.grad_norm is not None else float("nan"),
            "optim/skipped_steps": float(self.updates.skipped_steps),
            "throughput/flat_tokens_per_s": flat_tokens / elapsed,
            "throughput/unique_tokens_per_s": tree_tokens / elapsed,
            "tree/por": 1.0 - tree_tokens / flat_tokens,
            "tree/err": 1.0 - packed_tokens / flat_tokens,
            "tree/micro_batches": float(sum(len(plan.rows) for plan in plans)),
            "time/step_s": elapsed,
            "memory/peak_bytes": float(peak),
            "data/epoch": self.sampler.epoch_of_step(step + 1),
        }

    def train(self) -> None:
        config = self.config
        bar = None
        if self.rank == 0 and config.logging.progress_bar:
            bar = progress_bar(config.max_steps, self.start_step)  # None unless stderr is a terminal
        for step in range(self.start_step, config.max_steps):
            scalars = self.train_step(step)
            done = step + 1
            self.objective.end_step(done, self.context)  # the KL reference's copy (a collective)
            evaluated = self.evaluator.after_step(done)  # every rank (a collective), when due
            scalars.update(evaluated)
            if self.rank == 0:
                if done % config.logging.every == 0 or done == config.max_steps or evaluated:
                    self.metrics.log(done, scalars)
                    logger.info(console_line(done, config.max_steps, scalars))
                if bar:
                    bar.update(1)
            if config.checkpoint.every and done % config.checkpoint.every == 0 and done < config.max_steps:
                self.save(done)
            if self.preemption is not None and done < config.max_steps:  # a collective: every rank stops alike
                self.preemption.at_step_boundary(self, done)
        if bar:
            bar.close()
        if self.updates.untrained_steps:
            logger.warning(
                "%d of %d steps had no trained token (every loss weight 0)",
                self.updates.untrained_steps,
                config.max_steps,
            )
        if self.updates.skipped_steps:
            logger.warning("%d of %d steps were discarded (non-finite)", self.updates.skipped_steps, config.max_steps)
        if self.start_step < config.max_steps:
            self.save(config.max_steps)
        if config.checkpoint.export_hf:
            self.export_hf(self.output_dir / "hf")
        dist.barrier()  # every rank done before any tears its process group down

    def save(self, step: int) -> None:
        """Checkpoint ``step`` (every rank), the objective's own files included."""
        updates = self.updates
        client_state = {
            "step": step,
            "skipped_steps": updates.skipped_steps,
            "untrained_steps": updates.untrained_steps,
        }
        record = {"world_size": self.world_size, "config": config_to_dict(self.config)}
        checkpoint.save(
            self.engine,
            self.checkpoint_dir,
            step,
            client_state,
            record,
            self.config.checkpoint.keep_last,
            exclude_frozen=self.config.model.lora.enabled,
            extra=lambda path: self.objective.save_state(path, step),
            keep=self.evaluator.kept_checkpoints(),
        )
        self.evaluator.checkpoint_saved(step)  # the best checkpoint (checkpoint.keep_best)

    def export_hf(self, directory: Path) -> None:
        """Final weights as a Hugging Face directory that ``from_pretrained`` loads without ds_tree."""
        from ds_tree.run.export import export_hf

        export_hf(self.engine, directory, self.rank, self.config.model.tokenizer, merge=self.config.checkpoint.merge)
        logger.info("exported Hugging Face model to %s", directory)

    def close(self) -> None:
        """Flush the logs and tear the process group down.

        Leaving the group to interpreter shutdown let a rank abort at exit now and then
        ("terminate called without an active exception", return code -6) after a complete run.
        """
        if self.metrics is not None:
            self.metrics.close()
        if self.planning is not None:  # its step ahead finishes on every rank before the group goes
            self.planning.close()
        if self.online is not None:  # a managed vLLM server stops with the run
            self.online.close()
        run_lock.release(self.output_dir)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
