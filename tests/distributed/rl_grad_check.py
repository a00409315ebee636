"""Run under ``torchrun --nproc_per_node 2``: the RL update's gradient vs the single-process flat one.

Every rank prepares the trainer's first RL step (advantages, mini-batches, old log-probs from a
no-grad forward through the DeepSpeed engine), then moves the engine's weights off the old policy
(the same seeded perturbation on every rank, gathered under ZeRO-3), so ratios leave the clip
range on both sides, and runs the first mini-batch's forward and backward with gradient
accumulation. Rank 0 computes the reference in one process, flat layout, plain PyTorch, from the
same old and perturbed weights, and writes the largest relative gradient error and the clip
counts to ``--out`` as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from ds_tree.engine.rl_step import StepNormalisers, prepare_rl_rows, run_rl_rows
from ds_tree.models.loading import load_model
from ds_tree.packing.modes import pack_trajectories
from ds_tree.verification import perturb_parameters
from tests.distributed.common import check_arguments, started_trainer
from tests.distributed.grad_check import gather_full_gradients, relative

PERTURBATION = 0.5
SEED = 7


def main() -> None:
    args, config = check_arguments()
    trainer = started_trainer(config)
    rollouts = trainer.rl_rollouts(0)
    module = trainer.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
        perturb_parameters(module, PERTURBATION, SEED)
    output = trainer.rl_backward(rollouts.prepared[0])
    gradients = gather_full_gradients(trainer.engine)
    metrics = trainer.global_metrics(output.metrics)
    micro_batches = torch.tensor([len(rollouts.prepared[0])])
    dist.all_reduce(micro_batches, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        settings = config.objective.rl_settings()
        old = load_model(config.model.source, attention="reference", dtype="float32", seed=config.model.seed)
        new = load_model(config.model.source, attention="reference", dtype="float32", seed=config.model.seed)
        perturb_parameters(new, PERTURBATION, SEED)
        old.requires_grad_(False)
        batch = rollouts.batches[0]
        advantages = {id(t): a for t, a in zip(rollouts.trajectories, rollouts.advantages, strict=True)}
        rows = pack_trajectories(batch, "flat", config.packing.budget)
        reference = old if settings.kl_coef else None
        prepared = prepare_rl_rows(old, rows, advantages, settings, StepNormalisers.of(batch), reference=reference)
        run_rl_rows(new, prepared, settings, backward=torch.Tensor.backward)
        report = {
            "world_size": dist.get_world_size(),
            "zero_stage": trainer.engine.zero_optimization_stage(),
            "min_micro_batches_per_rank": int(micro_batches.item()),
            "mini_batches": len(rollouts.prepared),
            "max_rel_grad_err": max(
                relative(gradients[name], p.grad.detach().double().numpy()) for name, p in new.named_parameters()
            ),
            "metrics": metrics,
        }
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    trainer.close()


if __name__ == "__main__":
    main()
