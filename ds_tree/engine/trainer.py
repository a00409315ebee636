"""The DeepSpeed training engine for tree data (docs/DESIGN.md sections 3 and 5).

One optimizer step:
1. every rank computes the same plan from ``(seed, step)``: the step's groups, their trees split
   into parts under the row budget, parts balanced over ranks and packed into rows (each rank
   pads its list with empty rows to the common count, because ZeRO-3 forwards are collective);
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
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tree.attention.registry import resolve_engine
from ds_tree.config import Config, ConfigError, config_to_dict
from ds_tree.data import load_trajectories
from ds_tree.data.convert import load_tokenizer
from ds_tree.data.sampler import StepSampler
from ds_tree.engine import dfs, self_check
from ds_tree.engine.memory import check_memory
from ds_tree.engine.reference import REFERENCE_FILE, build_reference, copy_policy, load_reference_state, reference_state
from ds_tree.engine.rl_trainer import RLSteps
from ds_tree.engine.step import StepOutput, global_normalisers, run_rows
from ds_tree.errors import DataError, HubError
from ds_tree.losses.sft import Normalisers
from ds_tree.models.hybrid_settings import check_hybrid_settings
from ds_tree.models.loading import check_hub_weights, check_model_settings, load_model
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.lora import AdaptersDisabled, apply_lora, trainable_parameters
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.models.token_mixing import check_branch_isolation, check_layer_types
from ds_tree.models.ulysses import check_sequence_parallel, enable_sequence_parallel
from ds_tree.models.vision import attach_rope_positions, check_vision_settings
from ds_tree.packing.plan import PlanSettings, RankPlan, plan_step
from ds_tree.packing.rows import PackedRow
from ds_tree.run import checkpoint, run_dir, run_lock
from ds_tree.run.console import progress_bar
from ds_tree.run.ds_config import resolve_deepspeed_config
from ds_tree.run.metrics import MetricsLogger, console_line
from ds_tree.run.op_builds import announce_op_builds
from ds_tree.run.shm import release_allreduce_buffers
from ds_tree.run.trackers import Tracker, TrackerRun, check_installed, open_trackers
from ds_tree.trees.trajectory import Trajectory, check_vocab, group_trajectories

logger = logging.getLogger(__name__)


SelfCheckError = self_check.SelfCheckError


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is not finite and ``optimizer.non_finite`` is ``stop``."""


def learning_rate_factor(step: int, config: Config) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` (or constant). With
    ``rollout.env.warmup_steps`` (an SFT phase first): the warm-up at ``warmup_lr``, then the
    schedule restarts for the RL steps."""
    optimizer = config.optimizer
    phase = config.rollout.env.warmup_steps if config.rollout.enabled and config.rollout.env.path else 0
    if step < phase:
        ramp = min(1.0, (step + 1) / optimizer.warmup_steps) if optimizer.warmup_steps else 1.0
        return ramp * (config.rollout.env.warmup_lr or optimizer.lr) / optimizer.lr
    step -= phase
    steps = config.max_steps - phase
    if optimizer.warmup_steps and step < optimizer.warmup_steps:
        return (step + 1) / optimizer.warmup_steps
    if optimizer.schedule == "constant":
        return 1.0
    span = max(1, steps - optimizer.warmup_steps)
    progress = min(1.0, (step - optimizer.warmup_steps) / span)
    return optimizer.min_lr_ratio + (1 - optimizer.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def ensure_distributed_env() -> None:
    """A single process started without a launcher still gets a (1-rank) process group."""
    if "RANK" in os.environ:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise RuntimeError("WORLD_SIZE > 1 but RANK is not set: start ranks with deepspeed, torchrun or srun")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


CUDA_BACKENDS = "cpu:gloo,cuda:nccl"
"""On CUDA the process group has a backend per device type: NCCL for the GPU tensors (DeepSpeed's
gradients and parameters), gloo for the trainer's own CPU scalars (normalisers, losses, metric sums,
the preemption flag, the checkpoint handshake), which NCCL refuses ("No backend type associated with
device type cpu", seen on the first GPU run of the trainer)."""


def init_process_group(timeout: timedelta) -> None:
    """On CUDA, the rank's process group over :data:`CUDA_BACKENDS`, this rank's GPU its device
    (``deepspeed.init_distributed`` then takes the group as it is); elsewhere nothing: DeepSpeed's
    CPU accelerator makes its own (gloo, and its shared-memory all-reduce)."""
    import deepspeed

    if deepspeed.get_accelerator().device_name() != "cuda" or dist.is_initialized():
        return
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(CUDA_BACKENDS, timeout=timeout)


class Trainer(RLSteps):
    def __init__(self, config: Config) -> None:
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.checkpoint_dir = self.output_dir / "checkpoints"
        self.engine = None
        self.metrics: MetricsLogger | None = None
        self.start_step = 0
        self.resume_from: str | None = None
        self.skipped_steps = 0
        """Steps whose update was discarded (``optimizer.non_finite: skip``), this run and the ones it resumed."""
        self.untrained_steps = 0
        """Steps without a trained token (every loss weight 0)."""
        self.online = None
        """Online RL (``rollout.enabled``): samples each step's groups (:mod:`ds_tree.rollout.online`)."""
        self.preemption = None
        """The preemption signal handler while :meth:`train` runs (:mod:`ds_tree.run.preemption`)."""

    # ----------------------------------------------------------------- set-up
    def prepare(self, lock: bool = False) -> None:
        """Everything that can fail on bad input, before any process group exists.

        ``lock``: rank 0 takes the output directory's lock (a run; held until :meth:`close` or the
        process ends) and removes a killed run's leftovers; without it (a dry run) it only checks
        that no other run holds the lock. Rank 0 alone plans the resume (:meth:`resume` tells the others).
        """
        config = self.config
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        first = int(os.environ.get("RANK", "0")) == 0
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
        hidden = getattr(self.model_config.get_text_config(), "hidden_size", None)
        self.ds_config = resolve_deepspeed_config(config, self.world_size, hidden)
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
        """:meth:`prepare`'s data: the trajectories of ``data.path``, their checks, the step sampler."""
        config = self.config
        try:
            self.trajectories = load_trajectories(config.data.path)
        except DataError as error:
            raise ConfigError(f"data.path: {error}") from None
        check_vocab(self.trajectories, self.model_config.get_text_config().vocab_size)
        try:  # images: positions by the model's rule, laid out on the trees when they are built
            attach_rope_positions(self.model_config, self.trajectories)
        except ValueError as error:
            raise ConfigError(f"model.source: {error} (data.path {config.data.path})") from None
        size = config.parallel.sequence_parallel_size
        budget = config.packing.budget * size
        longest = max(self.trajectories, key=len)
        if len(longest) > budget and not dfs.uses_dfs(config.packing):  # dfs walks paths of any length
            where = longest.source or f"group {longest.group_id!r}"
            limit = f"packing.budget ({budget})"
            if size > 1:
                limit = f"packing.budget x parallel.sequence_parallel_size ({config.packing.budget} x {size})"
            raise ConfigError(
                f"{limit} is below the longest trajectory ({len(longest)} tokens, {where}); "
                "every root-to-leaf path must fit one row"
            )
        self.groups = group_trajectories(self.trajectories)
        if config.data.groups_per_step > len(self.groups):  # a step would train some groups twice
            raise ConfigError(
                f"data.groups_per_step ({config.data.groups_per_step}) is more than the {len(self.groups)} groups "
                f"in data.path ({config.data.path}); set it to at most {len(self.groups)}"
            )
        self.sampler = StepSampler(len(self.groups), config.data.groups_per_step, config.data.seed)
        if config.objective.is_rl:
            self.check_rl_data()

    def prepare_online(self) -> None:
        """:meth:`prepare`'s data for online RL: prompts, tokenizer and reward function instead of a dataset."""
        from ds_tree.rollout.online import OnlineRollouts

        if self.config.rollout.env.path:  # multi-turn episodes against an environment (docs/ENVIRONMENTS.md)
            from ds_tree.rollout.multiturn import MultiTurnRollouts as OnlineRollouts
        self.online = OnlineRollouts(self.config, self.model_config)
        self.sampler = self.online.sampler

    def plan_resume(self) -> None:
        """Which checkpoint this run resumes from, and whether it may (see ``checkpoint.resume``)."""
        directory = self.checkpoint_dir
        self.resume_from = checkpoint.resume_tag(directory, self.config.checkpoint.resume)
        if self.resume_from is None:
            return
        record = checkpoint.read_record(directory, self.resume_from)
        changes = run_dir.resume_changes(record, self.config, self.world_size, directory / self.resume_from)
        at, step = self.config.objective.reference_step, checkpoint.step_of(self.resume_from)
        if at and step >= at and not (directory / self.resume_from / REFERENCE_FILE).is_file():
            raise checkpoint.CheckpointError(  # found at the dry run, not after the model is built
                f"{directory / self.resume_from} holds no {REFERENCE_FILE}: objective.reference_step ({at}) makes the "
                f"KL reference the policy of step {at}, and this checkpoint of step {step} was saved without it (by a "
                f"run without reference_step?). Resume from a checkpoint before step {at}, or set "
                "objective.reference_step: 0"
            )
        if changes:
            logger.warning("resuming from %s with a changed config: %s", self.resume_from, "; ".join(changes))
        resumed_step = checkpoint.step_of(self.resume_from)
        newer = [tag for tag in checkpoint.complete_tags(directory) if checkpoint.step_of(tag) > resumed_step]
        if newer:
            logger.warning(
                "resuming from %s although newer complete checkpoints exist (%s); they are kept until this run "
                "saves the same steps",
                self.resume_from,
                ", ".join(newer),
            )

    @property
    def plan_settings(self) -> PlanSettings:
        """What the step plan depends on, from the config as it is now."""
        return PlanSettings.of_config(self.config, pad_id=self.model_config.get_text_config().pad_token_id or 0)

    @property
    def dfs_settings(self) -> dfs.DfsSettings | None:
        """How walked items are walked (None: no tree is walked), from the config and the DeepSpeed
        config as they are now (under ZeRO-3 the walks run in lockstep)."""
        packing = self.config.packing
        return dfs.settings_of(packing, self.ds_config) if dfs.uses_dfs(packing) else None

    def setup(self) -> None:
        """Process group, model, DeepSpeed engine, resume. Call :meth:`prepare` first."""
        import deepspeed

        ensure_distributed_env()
        announce_op_builds(self.ds_config)  # the first CPU run compiles DeepSpeed ops for ~35 s
        timeout = timedelta(seconds=self.config.distributed.timeout_s)
        init_process_group(timeout)
        deepspeed.init_distributed(timeout=timeout)  # takes the group made above, if any
        release_allreduce_buffers()
        self.rank = dist.get_rank()
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"WORLD_SIZE={self.world_size} but the process group has {dist.get_world_size()}")
        config = self.config
        if self.online is not None:  # before any zero.Init: the generation copy is never partitioned
            self.online.build_model()
        dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
        if config.model.zero_init:
            if self.ds_config["zero_optimization"].get("stage") != 3:
                raise ConfigError("model.zero_init needs ZeRO stage 3 in the DeepSpeed config")
            from transformers.integrations import HfDeepSpeedConfig

            # While this object lives, transformers builds (and loads) models inside
            # deepspeed.zero.Init itself, partitioning weights as they are created or read,
            # including the init details (padding rows, tied weights) a bare zero.Init breaks.
            self._hf_deepspeed_config = HfDeepSpeedConfig(self.ds_config)
        model = load_model(
            config.model.source,
            attention=self.attention_engine,
            dtype=dtype,
            seed=config.model.seed,
            checkpoint_every=config.model.checkpointed_every,
            recurrent_kernels=config.model.recurrent_kernels,
        )
        if self.rank == 0:
            logger.info("attention engine: %s (model.attention: %s)", self.attention_engine, config.model.attention)
        if config.model.lora.enabled:  # after the tree attention swap: PEFT wraps the linear layers only
            model = apply_lora(model, config.model.lora)
        if config.parallel.sequence_parallel_size > 1:
            self.sequence_parallel = enable_sequence_parallel(model, config.parallel.sequence_parallel_size)
        self.build_engine(model)
        check_branch_isolation(self.engine.module, self.engine.device)  # every rank: collective under ZeRO-3
        self.reference = None
        if config.objective.is_rl and config.objective.kl_coef and config.model.lora.enabled:
            self.reference = AdaptersDisabled(self.engine)  # the policy with its adapters off: no second model
        elif config.objective.is_rl and config.objective.kl_coef:  # whole, or partitioned under zero_init
            hf_config = getattr(self, "_hf_deepspeed_config", None)
            self.reference = build_reference(config, self.ds_config, dtype, self.engine.device, hf_config)
        self.resume()

    def build_engine(self, model: torch.nn.Module) -> None:
        import deepspeed

        optimizer_config = self.config.optimizer
        optimizer = torch.optim.AdamW(
            trainable_parameters(model),  # the adapters only under model.lora
            lr=optimizer_config.lr,
            betas=optimizer_config.betas,
            eps=optimizer_config.eps,
            weight_decay=optimizer_config.weight_decay,
            fused=True,  # one kernel over all tensors: 3.7x faster than foreach on the CPU (8M params)
        )
        updates = self.config.objective.updates_per_step  # RL: ppo_epochs x mini_batches updates per step
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda update: learning_rate_factor(update // updates, self.config)
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config
        )

    def resume(self) -> None:
        """Load the checkpoint rank 0 chose for every rank, once each of its files matches its record."""

        def choose() -> str | None:
            if not run_lock.held(self.output_dir):  # a caller that did not lock in prepare
                run_lock.acquire(self.output_dir)
                run_dir.remove_leftovers(self.output_dir)
                self.plan_resume()
            return self.resume_from

        device = self.engine.device
        self.resume_from = checkpoint.agree(choose, self.rank, device)
        if self.resume_from is not None:
            checkpoint.verify(self.checkpoint_dir, self.resume_from, self.rank, self.world_size, device)
            with checkpoint.weights_only_loads():
                _, client_state = self.engine.load_checkpoint(
                    str(self.checkpoint_dir),
                    tag=self.resume_from,
                    load_module_strict=not self.config.model.lora.enabled,  # adapters only: the base is rebuilt
                )
            self.start_step = int(client_state["step"])
            self.skipped_steps = int(client_state.get("skipped_steps", 0))
            self.untrained_steps = int(client_state.get("untrained_steps", 0))
            if self.reference_copied(self.start_step):
                self.load_reference_copy(self.checkpoint_dir / self.resume_from)
            logger.info("resumed from %s at step %d", self.checkpoint_dir / self.resume_from, self.start_step)
        trackers = self.open_trackers() if self.rank == 0 else []
        self.metrics = MetricsLogger(self.output_dir, self.rank == 0, self.start_step, trackers)
        if self.rank == 0:
            recorded = run_dir.record_config(self.output_dir, self.config, self.start_step)
            if recorded is not None and recorded.name != "config.yaml":
                logger.info("this run's config differs from the recorded one: saved as %s", recorded)

    def open_trackers(self) -> list[Tracker]:
        """Rank 0's experiment trackers (``logging.report_to``), continuing their runs after a resume."""
        settings = self.config.logging
        run = TrackerRun(
            output_dir=self.output_dir,
            project=settings.project,
            name=settings.run_name or self.config.output_dir,
            config=config_to_dict(self.config),
            resume_step=self.start_step,
        )
        return open_trackers(settings.report_to, run)

    # ------------------------------------------------------------------ steps
    def step_trajectories(self, step: int) -> list[Trajectory]:
        """The trajectories of ``step``'s groups (every rank computes the same list)."""
        if self.online is not None:  # sampled from the current policy (a collective)
            trajectories = self.online.step_trajectories(step, self.engine.module)
        else:
            trajectories = self.sampler.trajectories_for_step(self.groups, step)
        self.last_trajectories = trajectories  # the self-check's sample is drawn from them
        return trajectories

    def plan_step(self, step: int, rank: int | None = None) -> RankPlan:
        """This rank's items for ``step`` (pure function of the config and the step)."""
        return self.plan_rows(self.step_trajectories(step), rank)

    def plan_rows(self, trajectories: list[Trajectory], rank: int | None = None) -> RankPlan:
        """This rank's items for ``trajectories`` (:func:`~ds_tree.packing.plan.plan_step`)."""
        rank = self.rank if rank is None else rank
        return plan_step(trajectories, self.plan_settings, self.world_size).for_rank(rank)

    def backward_function(self, n_rows: int):
        """``backward(loss)`` for each of ``n_rows`` micro-batches of one optimizer update.

        DeepSpeed's division by the accumulation steps is skipped (``scale_wrt_gas=False``) and its
        average over data-parallel ranks cancelled (the loss times the world size); the last row
        marks the accumulation boundary.

        ZeRO-3 counts micro-steps when a forward follows a backward (its optimizer's
        ``clear_backward_seen_flag``, called by ``engine.forward``) and overwrites the gradient
        partitions in micro-step 0 instead of adding to them. The dfs walk's held forwards make
        backward calls with no forward between them: at a step's start each overwrote the one before
        (a 2-rank step walked in 16-token chunks lost 17% of its gradient). So every backward call is
        preceded by that call, as a forward would; after a forward it changes nothing.
        """
        engine = self.engine
        scale = float(dist.get_world_size())
        remaining = [n_rows]
        stage3 = engine.zero_optimization_stage() == 3

        def backward(loss: torch.Tensor) -> None:
            remaining[0] -= 1
            engine.set_gradient_accumulation_boundary(remaining[0] == 0)
            if stage3:
                engine.optimizer.clear_backward_seen_flag()
            engine.backward(loss * scale, scale_wrt_gas=False)

        return backward

    def forward_backward(
        self, rows: list[PackedRow], normalisers: Normalisers | None = None, router_aux: RouterAuxLoss | None = None
    ) -> StepOutput:
        """The SFT objective's forward and backward of this rank's items, each with its kind's runner."""
        if normalisers is None:
            normalisers = global_normalisers(rows)
        return run_rows(
            self.engine,
            rows,
            normalisers,
            self.config.objective.normalisation,
            self.config.objective.policy,
            backward_for=self.backward_function,
            dfs=self.dfs_settings,
            device=self.engine.device,
            head_chunk=self.config.model.head_chunk,
            router_aux=router_aux,
        )

    def optimizer_step(self) -> None:
        self.engine.step()

    def train_step(self, step: int) -> dict[str, float]:
        started = time.perf_counter()
        lr = float(self.engine.get_lr()[0])  # the rate this step applies (its first update's, for RL)
        router_scalars = {}
        if self.config.objective.is_rl:
            plans, loss, grad_norm, rl_scalars = self.rl_step(step)
        else:
            plan = self.plan_step(step)
            normalisers = global_normalisers(plan.rows)
            if normalisers.target_tokens == 0:
                self.count_untrained(step + 1)
            router_aux = RouterAuxLoss.of_model(self.engine, self.config.model.router_aux_loss_coef, plan.flat_tokens)
            output = self.forward_backward(plan.rows, normalisers, router_aux)
            plans, rl_scalars = [plan], {}
            if output.router_aux is not None:  # every rank alike: MoE or not is the model's
                share = torch.tensor([output.router_aux], dtype=torch.float64)
                dist.all_reduce(share)
                router_scalars["loss/router_aux"] = float(share.item())
            loss, grad_norm = self.apply_update(step + 1, output.loss)
        elapsed = time.perf_counter() - started
        router_scalars.update(self.run_self_check(step, loss))  # after the timing: the check is not training
        peak = (
            torch.cuda.max_memory_allocated()
            if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        flat_tokens = sum(plan.flat_tokens for plan in plans)
        tree_tokens = sum(plan.tree_tokens for plan in plans)
        packed_tokens = sum(plan.packed_tokens for plan in plans)
        return {
            "loss/train": loss,
            "optim/lr": lr,
            "optim/grad_norm": grad_norm if grad_norm is not None else float("nan"),
            "optim/skipped_steps": float(self.skipped_steps),
            "throughput/flat_tokens_per_s": flat_tokens / elapsed,
            "throughput/unique_tokens_per_s": tree_tokens / elapsed,
            "tree/por": 1.0 - tree_tokens / flat_tokens,
            "tree/err": 1.0 - packed_tokens / flat_tokens,
            "tree/micro_batches": float(sum(len(plan.rows) for plan in plans)),
            "time/step_s": elapsed,
            "memory/peak_bytes": float(peak),
            "data/epoch": self.sampler.epoch_of_step(step + 1),
            **rl_scalars,
            **router_scalars,
        }

    def run_self_check(self, step: int, loss: float) -> dict[str, float]:
        """``objective.self_check`` on this step's trajectories (:mod:`ds_tree.engine.self_check`): its
        ``selfcheck/`` scalars, or a :class:`SelfCheckError`; nothing on steps it does not check.

        A due step whose loss is not finite (discarded by ``optimizer.non_finite: skip``) is not a
        tree-vs-flat question: both sides are NaN. The check moves to the next step with a finite loss.
        So does a due warm-up step of a multi-turn RL run (``rollout.env.warmup_steps``, SFT on
        demonstrations): the run's first RL step is checked (``first`` used to check nothing there).
        """
        config = self.config
        deferred = getattr(self, "_self_check_deferred", False)
        if not (deferred or self_check.is_due(config.objective.self_check, step, self.start_step)):
            return {}
        if not math.isfinite(loss):
            self._self_check_deferred = True
            return {}
        self._self_check_deferred = False
        rl, self._self_check_rl = getattr(self, "_self_check_rl", None), None
        if config.objective.is_rl and rl is None:  # RL: its inputs are recorded before the updates
            self._self_check_deferred = True  # a warm-up (SFT) step of an RL run: the next RL step is checked
            return {}
        sample = rl.sample if rl is not None else self_check.sample_groups(self.last_trajectories)
        if not sample:
            return {}
        with self_check.zero3_leaf_hooks_suspended(self.engine.optimizer):
            result = self_check.check_sample(
                self.engine.module,  # the bare module: the engine's backward hooks stay out of the check
                sample,
                plan=self.plan_settings,  # the sample's items: the kinds this run's plan gives them
                normalisation=config.objective.normalisation,
                dfs=self.dfs_settings,
                device=self.engine.device,
                rl=rl,
                sequence_parallel=self.self_check_group(),
                head_chunk=config.model.head_chunk,
                router_aux_loss_coef=config.model.router_aux_loss_coef,
            )
        self.release_partition_cache()
        dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
        self_check.verdict(result, step + 1, dtype)
        return result.scalars()

    def prepare_rl_self_check(self, step: int, trajectories: list, advantages: list) -> None:
        """RL, before the step's updates: the self-check's sample with the step's advantages and old
        log-probs (:func:`~ds_tree.engine.self_check.rl_inputs`), on the steps it checks."""
        config = self.config
        self._self_check_rl = None
        due = self_check.is_due(config.objective.self_check, step, self.start_step)
        if not (due or getattr(self, "_self_check_deferred", False)):
            return
        self._self_check_rl = self_check.rl_inputs(
            self.engine.module,
            trajectories,
            {id(t): a for t, a in zip(trajectories, advantages, strict=True)},
            config.objective.rl_settings(),
            plan=self.plan_settings,
            reference=self.reference,
            dfs=self.dfs_settings,
            sequence_parallel=self.self_check_group(),
            device=self.engine.device,
            head_chunk=config.model.head_chunk,
        )
        self.release_partition_cache()

    def self_check_group(self) -> self_check.SequenceParallel | None:
        """This rank's sequence-parallel group, over which the self-check plans its sample (None without SP)."""
        if self.config.parallel.sequence_parallel_size == 1:
            return None
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        group = self.sequence_parallel
        return self_check.SequenceParallel(group.size, group.position, parallel_state_sp.get_sequence_parallel_group())

    def release_partition_cache(self) -> None:
        """After the self-check's forwards, outside a training step: ZeRO-3 may still hold parameters it
        prefetched for them, in flight. Release them now, or the next gather of a parameter (the vLLM
        weight sync) fails with "Cannot partition a param in flight"."""
        if self.engine.zero_optimization_stage() == 3:
            self.engine.empty_partition_cache()

    def apply_update(self, step: int, local_loss: float) -> tuple[float, float | None]:
        """The optimizer update after a full accumulation: (global loss, gradient norm), or an error.

        The loss is all-reduced first, so every rank sees the same sum and decides alike.
        """
        loss = torch.tensor([local_loss], dtype=torch.float64)
        dist.all_reduce(loss)
        loss = float(loss.item())
        if not math.isfinite(loss) and self.config.optimizer.non_finite == "stop":
            raise NonFiniteError(self.non_finite_message(step, f"the loss is {loss}"))
        self.optimizer_step()
        grad_norm = self.engine.get_global_grad_norm()  # of the gradient this update applied
        grad_norm = float(grad_norm) if grad_norm is not None else None
        self.check_step_applied(step, loss, grad_norm)
        return loss, grad_norm

    def check_step_applied(self, step: int, loss: float, grad_norm: float | None) -> None:
        """Stop, or count a discarded step, when the loss or the gradient was not finite.

        DeepSpeed (ZeRO stages 1-3, bf16) discards a step whose gradient norm is not finite on
        every rank alike: the gradients are zeroed, the parameters, optimizer state and
        learning-rate schedule left as they were. A non-finite loss has non-finite gradients.
        """
        applied = self.engine.was_step_applied()
        finite_norm = grad_norm is None or math.isfinite(grad_norm)
        if applied and math.isfinite(loss) and finite_norm:
            return
        if not math.isfinite(loss):
            what = f"the loss is {loss}"
        else:
            what = "the gradient is not finite" if finite_norm else f"the gradient norm is {grad_norm}"
        if applied:
            raise NonFiniteError(
                f"step {step}: {what}, and DeepSpeed applied the update (it discards such steps only under ZeRO "
                f"stages 1-3 and bf16): the model is no longer finite. {self.last_good()}"
            )
        self.discard_step(step, what)

    def discard_step(self, step: int, what: str) -> None:
        """A non-finite step whose update was not applied: stop (``optimizer.non_finite=stop``), or count it."""
        if self.config.optimizer.non_finite == "stop":
            raise NonFiniteError(self.non_finite_message(step, what))
        self.skipped_steps += 1
        logger.warning(
            "step %d: %s; its update is discarded (optimizer.non_finite=skip; %d step(s) skipped)",
            step,
            what,
            self.skipped_steps,
        )

    def non_finite_message(self, step: int, what: str) -> str:
        return (
            f"step {step}: {what}; stopped without applying its update (optimizer.non_finite=stop). {self.last_good()} "
            "Lower optimizer.lr, check the data, or set optimizer.non_finite=skip to discard such steps"
        )

    def last_good(self) -> str:
        tags = checkpoint.complete_tags(self.checkpoint_dir)
        return f"Nothing was saved: {tags[-1]} stays the newest checkpoint." if tags else "Nothing was saved."

    def count_untrained(self, step: int) -> None:
        self.untrained_steps += 1
        if self.untrained_steps == 1:
            logger.warning(
                "step %d has no trained token (every loss weight is 0): its loss and gradient are 0; "
                "further such steps are counted and reported at the end",
                step,
            )

    def train(self) -> None:
        config = self.config
        bar = None
        if self.rank == 0 and config.logging.progress_bar:
            bar = progress_bar(config.max_steps, self.start_step)  # None unless stderr is a terminal
        for step in range(self.start_step, config.max_steps):
            scalars = self.train_step(step)
            done = step + 1
            if self.reference is not None and done == config.objective.reference_step:  # a collective
                copy_policy(self.reference, self.engine.module)
                logger.info("step %d: the KL reference is now the policy of this step (objective.reference_step)", done)
            if self.rank == 0:
                if done % config.logging.every == 0 or done == config.max_steps:
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
        if self.untrained_steps:
            logger.warning(
                "%d of %d steps had no trained token (every loss weight 0)", self.untrained_steps, config.max_steps
            )
        if self.skipped_steps:
            logger.warning("%d of %d steps were discarded (non-finite)", self.skipped_steps, config.max_steps)
        if self.start_step < config.max_steps:
            self.save(config.max_steps)
        if config.checkpoint.export_hf:
            self.export_hf(self.output_dir / "hf")
        dist.barrier()  # every rank done before any tears its process group down

    def save(self, step: int) -> None:
        client_state = {"step": step, "skipped_steps": self.skipped_steps, "untrained_steps": self.untrained_steps}
        record = {"world_size": self.world_size, "config": config_to_dict(self.config)}
        checkpoint.save(
            self.engine,
            self.checkpoint_dir,
            step,
            client_state,
            record,
            self.config.checkpoint.keep_last,
            exclude_frozen=self.config.model.lora.enabled,
            extra=self.save_reference_copy if self.reference_copied(step) else None,
        )

    def reference_copied(self, step: int) -> bool:
        """Whether the KL reference is the policy's copy after ``step`` steps (``objective.reference_step``)."""
        at = self.config.objective.reference_step
        return self.reference is not None and bool(at) and step >= at

    def save_reference_copy(self, path: Path) -> None:
        """The copied reference's weights into checkpoint directory ``path`` (every rank: a collective)."""
        state = reference_state(self.reference)
        if self.rank == 0:
            torch.save(state, path / REFERENCE_FILE)

    def load_reference_copy(self, path: Path) -> None:
        """The reference copy that checkpoint ``path`` holds back into the reference (every rank)."""
        file = path / REFERENCE_FILE
        at = self.config.objective.reference_step
        if not file.is_file():
            raise checkpoint.CheckpointError(
                f"{path} holds no {REFERENCE_FILE}: objective.reference_step ({at}) makes the KL reference the "
                f"policy of step {at}, and this checkpoint of step {self.start_step} was saved without it (by a run "
                f"without reference_step?). Resume from a checkpoint before step {at}, or set "
                "objective.reference_step: 0"
            )
        # memory-mapped: the ranks of a node share the pages instead of each reading the whole file
        load_reference_state(self.reference, checkpoint.trusted_load(file, map_location="cpu", mmap=True))

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
        if self.online is not None:  # a managed vLLM server stops with the run
            self.online.close()
        run_lock.release(self.output_dir)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
