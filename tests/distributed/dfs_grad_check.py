"""Run under ``torchrun --nproc_per_node 2``: one dfs-mode gradient vs the single-process flat gradient.

Every rank plans and runs the trainer's first step (walked trees and packed rows, per the config)
and gathers the full gradient before the optimizer step. Rank 0 computes the flat baseline in plain
PyTorch, one process, from the same initial weights, with no budget (a walked tree's trajectories
may be longer than ``packing.budget``), and writes the largest relative errors and each rank's
walked and packed rows to ``--out`` as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tree.models.loading import load_model
from ds_tree.packing.dfs_rows import DfsRow
from ds_tree.train import exit_now
from tests.distributed.common import check_arguments, flat_sft, sft_backward, started_trainer
from tests.distributed.grad_check import gather_full_gradients, relative


def main() -> None:
    args, config = check_arguments()
    trainer = started_trainer(config)
    trajectories = trainer.context.trajectories(0)
    plan = trainer.context.plan(trajectories)
    output = sft_backward(trainer, plan.rows)
    gradients = gather_full_gradients(trainer.engine)
    walked = sum(isinstance(row, DfsRow) for row in plan.rows)
    counts = torch.tensor([[walked, len(plan.rows) - walked]])
    every = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(every, counts)
    loss = torch.tensor([output.loss], dtype=torch.float64)
    dist.all_reduce(loss)
    if dist.get_rank() == 0:
        model = load_model(config.model.source, attention="reference", dtype="float32", seed=config.model.seed)
        flat = flat_sft(model, trajectories, config)
        report = {
            "world_size": dist.get_world_size(),
            "zero_stage": trainer.engine.zero_optimization_stage(),
            "walked_and_packed_rows_per_rank": [c[0].tolist() for c in every],
            "rel_loss_err": abs(float(loss.item()) - flat.loss) / abs(flat.loss),
            "max_rel_grad_err": max(
                relative(gradients[n], p.grad.detach().double().numpy()) for n, p in model.named_parameters()
            ),
        }
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    trainer.close()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
