"""Run with 2 ranks: online RL under sequence parallelism (one group of 2 ranks).

Trains ``max_steps`` online steps and records, per step, the longest sampled trajectory and how many
sequence-parallel shards the ranks computed (summed over the group); rank 0 writes them with the
run's ``metrics.jsonl`` records to ``--out`` as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ds_tree.packing.sequence_parallel import RowShard
from ds_tree.train import exit_now
from tests.distributed.common import check_arguments, started_trainer


def main() -> None:
    args, config = check_arguments()
    trainer = started_trainer(config)
    steps: dict[int, dict] = {}
    prepare = trainer.objective.prepare_step

    def recording(step, context):
        prepared = prepare(step, context)
        shards = torch.tensor([sum(isinstance(item.row, RowShard) for rows in prepared.rows for item in rows)])
        dist.all_reduce(shards)
        held = prepared.trajectories  # what this rank holds of the step: every rank's together are the step's
        longest = torch.tensor([max((len(t) for t in held), default=0)])
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        with_logprobs = torch.tensor([int(all(getattr(t, "logprobs", None) is not None for t in held))])
        dist.all_reduce(with_logprobs, op=dist.ReduceOp.MIN)
        steps[step + 1] = {
            "longest": int(longest.item()),
            "shards": int(shards.item()),
            "with_logprobs": bool(with_logprobs.item()),
        }
        return prepared

    trainer.objective.prepare_step = recording
    trainer.train()
    trainer.metrics.close()
    if trainer.rank == 0:
        lines = (trainer.output_dir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line]
        Path(args.out).write_text(json.dumps({"steps": steps, "metrics": records}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
