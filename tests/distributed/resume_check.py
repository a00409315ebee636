"""Run with 2 ranks: a run, and a second one resumed from its middle checkpoint, in one launch.

Trainer A trains ``max_steps`` steps from scratch (the config saves a checkpoint at ``--resume-step``); online,
it samples and scores each step's groups. Trainer B starts in its own output directory that holds a copy of that
checkpoint, resumes from it and trains the remaining steps. Each run's ``metrics.jsonl`` is recorded; online, every
step's sampled trajectories (token ids, rewards, loss masks) and, with a KL reference, the largest difference
between its weights and the policy's as each step starts; with a critic (``estimator: gae``), the largest change of
its weights over each step. Rank 0 writes them to ``--out`` as JSON for the test to compare.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from ds_tree.engine.reference import reference_module
from ds_tree.objectives.policy_gradient import PolicyGradient
from ds_tree.run import checkpoint
from ds_tree.train import exit_now
from tests.distributed.common import check_arguments, started_trainer


def whole(module) -> dict[str, torch.Tensor]:
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {name: p.detach().clone() for name, p in module.named_parameters()}


def largest_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    return max((after[name] - before[name]).abs().max().item() for name in before)


def recorded_run(config, samples: dict[int, list]) -> dict:
    """Train ``config``; every sampled step's (token ids, reward, loss mask) go to ``samples``; its records back."""
    trainer = started_trainer(config)
    reference_gaps, critic_changes = {}, {}
    if trainer.online is not None:
        record_samples(trainer, samples, reference_gaps)
    policy_gradient = isinstance(trainer.objective, PolicyGradient)  # grpo, ppo: a critic with estimator gae
    critic = trainer.objective.critic.engine if policy_gradient else None
    if critic is not None:
        train_step = trainer.train_step

        def recording_step(step):
            before = whole(critic.module)  # a collective under ZeRO-3: every rank
            scalars = train_step(step)
            critic_changes[step + 1] = largest_change(before, whole(critic.module))
            return scalars

        trainer.train_step = recording_step
    trainer.train()
    trainer.metrics.close()
    lines = (trainer.output_dir / "metrics.jsonl").read_text().splitlines() if trainer.rank == 0 else []
    metrics = [json.loads(line) for line in lines if line]
    return {
        "start_step": trainer.start_step,
        "metrics": metrics,
        "reference_gaps": reference_gaps,
        "critic_changes": critic_changes,
    }


def sampled(trajectory) -> list:
    return [trajectory.input_ids.tolist(), trajectory.reward, trajectory.loss_mask.tolist()]


def record_samples(trainer, samples: dict[int, list], reference_gaps: dict[int, float]) -> None:
    """Online: each step's sampled (token ids, reward, loss mask) into ``samples``, the KL reference's gap to the
    policy as the step starts into ``reference_gaps``."""
    sample = trainer.online.step_units
    objective = trainer.objective

    def recording(step, policy):
        reference = objective.reference.model if isinstance(objective, PolicyGradient) else None
        if reference is not None:  # a collective: every rank
            reference_gaps[step + 1] = largest_change(whole(policy), whole(reference_module(reference)))
        data = sample(step, policy)
        mine = {unit: [sampled(t) for t in group] for unit, group in data.units.held.items()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)  # each rank holds its own slots' groups
        held = {unit: group for groups in every for unit, group in groups.items()}
        samples[step + 1] = [pair for unit in sorted(held) for pair in held[unit]]
        return data

    trainer.online.step_units = recording


def main() -> None:
    args, config = check_arguments((("--resume-step",), {"type": int, "required": True}))
    samples_a: dict[int, list] = {}
    run_a = recorded_run(config, samples_a)
    resumed_dir = Path(config.output_dir + "_resumed")
    if dist.get_rank() == 0:
        source = Path(config.output_dir) / "checkpoints" / checkpoint.tag_for(args.resume_step)
        shutil.copytree(source, resumed_dir / "checkpoints" / source.name)
        (resumed_dir / "checkpoints" / "latest").write_text(source.name)
    dist.barrier()
    samples_b: dict[int, list] = {}
    run_b = recorded_run(dataclasses.replace(config, output_dir=str(resumed_dir)), samples_b)
    if dist.get_rank() == 0:
        Path(args.out).write_text(
            json.dumps({"a": {**run_a, "samples": samples_a}, "b": {**run_b, "samples": samples_b}})
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
