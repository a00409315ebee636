"""Run with 2 ranks (torchrun): rank 0 chooses the checkpoint every rank resumes from, and every rank
checks its share of the files against the record. Writes each rank's outcome to ``--out``.RANK.json.

``--dir`` holds complete checkpoints; ``latest`` names one. Each rank would choose differently on its
own (its ``choose`` returns a rank-dependent tag): :func:`checkpoint.agree` must give every rank rank
0's. Then rank 1's share of the files of ``--damaged`` (a tag whose second file, in sorted order, was
changed after its record) is wrong: every rank must raise the same error naming that file. Last, rank
0's choice raises: every rank raises it (no rank is left waiting).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from ds_tree.run import checkpoint
from ds_tree.train import exit_now


def outcome(function) -> dict:
    try:
        return {"value": function()}
    except checkpoint.CheckpointError as error:
        return {"error": str(error)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--damaged", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    directory = Path(args.dir)
    own = checkpoint.resume_tag(directory, "auto") if rank == 0 else "step_9999999"
    report = {"chosen": outcome(lambda: checkpoint.agree(lambda: own, rank))}
    report["verified"] = outcome(lambda: checkpoint.verify(directory, report["chosen"]["value"], rank, world_size))
    report["damaged"] = outcome(lambda: checkpoint.verify(directory, args.damaged, rank, world_size))

    def fails() -> str:
        raise checkpoint.CheckpointError("rank 0 found no usable checkpoint")

    report["failed"] = outcome(lambda: checkpoint.agree(fails, rank))
    Path(f"{args.out}.{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
