"""Run with 2 ranks: a training run without its eval section, the same run with it, and (``--resume-max-steps``)
that run resumed to more steps, in one launch.

Every run trains the config's steps from scratch in its own output directory (``<output_dir>_plain`` for the
one without evaluation). Each rank records the eval tasks it sampled. Rank 0 writes, per run, its
``metrics.jsonl``, the tasks every rank sampled, its checkpoints and ``checkpoints/best.json`` (as they are at
the run's end) to ``--out`` as JSON for the test to compare.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch.distributed as dist

from ds_tree.config import EvalConfig
from ds_tree.envs import digit_parity
from ds_tree.rollout.rewards import RewardRequest
from ds_tree.run import checkpoint
from ds_tree.run.best import BEST
from ds_tree.train import exit_now
from tests.distributed.common import check_arguments, started_trainer


def noisy_parity(request: RewardRequest) -> float:
    """The digit-parity reward plus noise from Python's global generator: training and evaluation both draw
    from it, so a run's rewards after an evaluation stay the same only if the evaluation restores it."""
    return digit_parity.reward(request) + random.random() * 1e-3


def recorded_run(config) -> dict:
    """Train ``config``; its metrics, the eval tasks each rank sampled, its checkpoints and best record. Python's
    generator starts each run alike (:func:`noisy_parity` draws from it)."""
    random.seed(1234)
    trainer = started_trainer(config)
    sampled: list[int] = []
    tasks = trainer.evaluator.tasks
    if tasks is not None:
        sample = tasks.sample

        def recording(step, index):
            sampled.append(index)
            return sample(step, index)

        tasks.sample = recording
    trainer.train()
    trainer.metrics.close()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sampled)
    directory = trainer.checkpoint_dir
    run = {"sampled": every, "start_step": trainer.start_step}
    if trainer.rank == 0:
        lines = (trainer.output_dir / "metrics.jsonl").read_text().splitlines()
        run["metrics"] = [json.loads(line) for line in lines if line]
        run["checkpoints"] = checkpoint.complete_tags(directory)
        run["best"] = json.loads((directory / BEST).read_text()) if (directory / BEST).is_file() else None
    dist.barrier()
    return run


def main() -> None:
    args, config = check_arguments((("--resume-max-steps",), {"type": int, "default": 0}))
    plain = dataclasses.replace(
        config,
        output_dir=config.output_dir + "_plain",
        eval=EvalConfig(),
        checkpoint=dataclasses.replace(config.checkpoint, keep_best="", best_mode="auto"),
    )
    runs = {"plain": recorded_run(plain), "eval": recorded_run(config)}
    if args.resume_max_steps:
        runs["resumed"] = recorded_run(dataclasses.replace(config, max_steps=args.resume_max_steps))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
