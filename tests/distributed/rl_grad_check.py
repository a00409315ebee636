"""Run under ``torchrun --nproc_per_node 2`` (or 4): the RL update's gradient vs the single-process flat one.

Every rank prepares the trainer's first RL step (advantages, mini-batches, old log-probs from a
no-grad forward through the DeepSpeed engine), then moves the engine's weights off the old policy
(the same seeded perturbation on every rank, gathered under ZeRO-3), so ratios leave the clip
range on both sides, and runs the first mini-batch's forward and backward with gradient
accumulation. Rank 0 computes the reference in one process, flat layout, plain PyTorch, from the
same old and perturbed weights (the engine's own weights, gathered: under ``model.zero_init`` they
are not those of a model built outside ``zero.Init``) and the KL reference's (gathered when it is
partitioned), and writes the largest relative gradient error, the metrics and their largest
relative error to ``--out`` as JSON. Under sequence parallelism the flat rows hold up to
``S x budget`` tokens.

With ``--dfs-chunk C`` the update is applied and the same case runs again with ``packing.mode: dfs``
in chunks of ``C`` tokens (under sequence parallelism every tree walked by the group, its chunks
sharded over it; the report's ``dfs`` entry). With ``--train-step`` the update is applied and one
ordinary ``train_step`` follows (its scalars reported), in the layout of the last case; when that is a
walk sharded over a sequence-parallel group, the self-check runs once more on the step's sample with a
fault only such a walk has (the report's ``selfcheck_fault``, :func:`walked_shard_fault`). With a reference
model, last, the policy is copied into it (``objective.reference_step``) and its saved state loaded back
(the report's ``reference_copy``).
"""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from ds_tree.engine.reference import reference_module
from ds_tree.engine.runners import RunContext, runner_of
from ds_tree.losses.advantages import estimate
from ds_tree.models.loading import load_model
from ds_tree.objectives.policy_gradient import global_metrics
from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows, run_rl_rows
from ds_tree.packing.dfs_shards import DfsRowShard
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.sequence_parallel import RowShard
from ds_tree.train import exit_now
from ds_tree.trees.trajectory import group_trajectories
from ds_tree.verify.tree_vs_flat import metric_errors, perturb_parameters
from tests.distributed.common import check_arguments, started_trainer
from tests.distributed.grad_check import gather_full_gradients, relative
from tests.distributed.sp_grad_check import full_parameters

PERTURBATION = 0.5
SEED = 7


def reference_copy_differences(trainer) -> dict[str, float]:
    """The policy copied into the reference (:func:`copy_policy`), then the reference's whole state
    (:func:`reference_state`, rank 0's, broadcast) loaded back after the reference was moved by 1: the
    largest differences of the gathered reference from the policy after each (0 when exact)."""
    from ds_tree.engine.reference import copy_policy, load_reference_state, reference_state

    def whole(module) -> dict[str, torch.Tensor]:
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {name: p.detach().clone() for name, p in module.named_parameters()}

    model = trainer.objective.reference.model

    def largest_difference() -> float:
        policy, reference = whole(trainer.engine.module), whole(reference_module(model))
        return max((reference[name].float() - policy[name].float()).abs().max().item() for name in policy)

    copy_policy(model, trainer.engine.module)
    copied = largest_difference()
    state = [reference_state(model)]
    dist.broadcast_object_list(state, src=0)
    reference = reference_module(model)
    with deepspeed.zero.GatheredParameters(list(reference.parameters()), modifier_rank=0), torch.no_grad():
        for parameter in reference.parameters():  # frozen: perturb_parameters moves trainable ones only
            parameter.add_(1.0)
    perturbed = largest_difference()
    load_reference_state(model, state[0])
    return {"copied": copied, "perturbed": perturbed, "reloaded": largest_difference()}


def gathered_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` whole (under ZeRO-3 gathered: a collective)."""
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {name: parameter.detach().float().clone() for name, parameter in module.named_parameters()}


def flat_policy(config, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = load_model(config.model.source, attention="reference", dtype="float32", seed=config.model.seed)
    model.load_state_dict(weights)
    return model


def rl_case(trainer) -> tuple[dict | None, float]:
    """The first mini-batch's gradient and metrics against flat (module docstring): rank 0's report, and
    this rank's loss (for the update that consumes the gradients)."""
    config = trainer.config
    initial = full_parameters(trainer.engine)
    reference = None
    if trainer.objective.reference.model is not None:  # a partitioned reference is built as the initial policy was
        reference = gathered_weights(reference_module(trainer.objective.reference.model))
    rollouts = trainer.objective.prepare_step(0, trainer.context)
    trainer.self_check.release()  # the walks' prefetched parameters, before they are gathered here
    module = trainer.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
        perturb_parameters(module, PERTURBATION, SEED)
    output = trainer.objective.run_update(rollouts.updates[0], trainer.context)
    gradients = gather_full_gradients(trainer.engine)
    metrics = global_metrics(output.metrics)
    rows = rollouts.updates[0].plan.rows
    shards = sum(isinstance(row, (RowShard, DfsRowShard)) and row.n_real > 0 for row in rows)
    micro_batches = torch.tensor([len(rollouts.rows[0]), shards])
    dist.all_reduce(micro_batches, op=dist.ReduceOp.MIN)
    run = RunContext(dfs=trainer.layout.dfs_settings())  # each rank's forwards of one no-grad pass, before any padding
    forwards = [None] * dist.get_world_size()
    dist.all_gather_object(forwards, sum(runner_of(row).forwards(row, run) for row in rows))
    if dist.get_rank() != 0:
        return None, output.loss
    settings = config.objective.rl_settings()
    old, new = flat_policy(config, initial), flat_policy(config, initial)
    perturb_parameters(new, PERTURBATION, SEED)
    old.requires_grad_(False)
    trajectories = trainer.context.trajectories(0)  # the whole step, in the order the planner takes its groups
    groups = group_trajectories(trajectories)
    batch = [t for g in np.array_split(np.arange(len(groups)), config.objective.mini_batches)[0] for t in groups[g]]
    objective = config.objective
    advantages = estimate(  # the whole step's, in one process
        trajectories, objective.estimator, objective.normalise_advantages, tempo_coef=objective.tempo_coef
    ).by_trajectory()
    budget = max(config.packing.budget * config.parallel.sequence_parallel_size, max(len(t) for t in batch))
    rows = pack_trajectories(batch, "flat", budget)  # (a walked tree's paths may be over S x budget)
    flat_reference = None
    if settings.kl_coef:
        flat_reference = flat_policy(config, reference).requires_grad_(False) if reference is not None else old
    prepared = prepare_rl_rows(old, rows, advantages, settings, StepNormalisers.of(batch), reference=flat_reference)
    flat = run_rl_rows(new, prepared, settings, backward=torch.Tensor.backward)
    report = {
        "mode": config.packing.mode,
        "min_micro_batches_per_rank": int(micro_batches[0]),
        "min_sharded_rows_per_rank": int(micro_batches[1]),
        "mini_batches": len(rollouts.rows),
        "forwards_per_rank": forwards,
        "max_rel_grad_err": max(
            relative(gradients[name], p.grad.detach().double().numpy()) for name, p in new.named_parameters()
        ),
        "metrics": metrics,
        "max_rel_metric_err": max(metric_errors(flat.metrics, metrics).values()),
    }
    if reference is not None:
        report["reference_max_abs_diff"] = max(
            (reference[name] - initial[name].float()).abs().max().item() for name in reference
        )
    return report, output.loss


def walked_shard_fault(trainer, step: int) -> dict:
    """The SFT self-check of ``step``'s sample with a fault in the walk sharded over the group alone:
    the tokens of every shard but a chunk's first placed one position deeper (an off-by-one where the
    chunk is cut into shards). Its items and verdict ('' when it passed)."""
    from ds_tree.engine import self_check
    from ds_tree.engine.dfs_sequence_parallel import ShardedChunks
    from ds_tree.objectives.sft import SFTCheck

    exact = ShardedChunks.chunk_inputs

    def shifted(chunks, row, index, cache):
        inputs = exact(chunks, row, index, cache)
        if chunks.position > 0:  # fault injection: the shard's own depths off by one
            inputs.position_ids = inputs.position_ids + 1
        return inputs

    ShardedChunks.chunk_inputs = shifted
    try:
        sample = self_check.sample_groups(trainer.context.trajectories(step))
        with self_check.zero3_leaf_hooks_suspended(trainer.engine.optimizer):
            result = self_check.check_sample(trainer.engine.module, SFTCheck(sample), trainer.self_check.settings())
    finally:
        ShardedChunks.chunk_inputs = exact
    trainer.self_check.release()
    try:
        self_check.verdict(result, 0, torch.float32)
        message = ""
    except self_check.SelfCheckError as error:
        message = str(error)
    return {"items": result.items, "max_grad_rel_err": result.max_grad_rel_err, "message": message}


def main() -> None:
    args, config = check_arguments(
        (("--train-step",), {"action": "store_true"}), (("--dfs-chunk",), {"type": int, "default": 0})
    )
    trainer = started_trainer(config)
    unset_hf_deepspeed_config()  # model.zero_init: rank 0's own models must not be built partitioned
    report, loss = rl_case(trainer)
    step = 1
    if args.dfs_chunk:
        trainer.updates.apply(step, loss)
        step += 1
        config.packing.mode, config.packing.dfs_chunk = "dfs", args.dfs_chunk
        dfs, loss = rl_case(trainer)
        if report is not None:
            report["dfs"] = dfs
    if report is not None:
        report.update(
            world_size=dist.get_world_size(),
            zero_stage=trainer.engine.zero_optimization_stage(),
            reference=type(trainer.objective.reference.model).__name__,
        )
    if args.train_step:
        trainer.updates.apply(step, loss)
        scalars = trainer.train_step(step)
        if report is not None:
            report["train_step"] = scalars
        if config.packing.mode == "dfs" and config.parallel.sequence_parallel_size > 1:
            fault = walked_shard_fault(trainer, step)
            if report is not None:
                report["selfcheck_fault"] = fault
    if (
        trainer.objective.reference.model is not None
    ):  # objective.reference_step's copy, its checkpoint state and reload
        differences = reference_copy_differences(trainer)
        if report is not None:
            report["reference_copy"] = differences
    if report is not None:
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    trainer.close()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
