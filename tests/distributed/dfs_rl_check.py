"""Run under ``torchrun --nproc_per_node 2``: dfs-mode SFT and RL gradients vs the single-process flat ones.

The trainer's config walks every tree (``packing.mode: dfs``); the two ranks get trees of
different shapes, so their walks make different sequences of calls. For each DeepSpeed JSON of
``--deepspeed`` (ZeRO-2, then ZeRO-3, where the ranks follow one lockstep schedule; a fresh engine
on the same weights each time):

- SFT, without recompute (held forwards, lone backwards): one accumulation of the trainer's
  first step (``sft_backward``);
- RL, with recompute: the objective's rollouts of the step (old log-probs by a no-grad walk,
  ``prepare_step``) and one update's backward (``run_update``).

Every rank gathers the full gradients, then the optimizer steps (ZeRO-3 keeps gradients until a
step); rank 0 computes the same objective in one process, float64, flat layout, from the parameters
the case started from, and records the relative errors and each rank's call kinds.

With ``--partitioned-reference``, under the last engine (ZeRO-3), the RL case once more with a KL term
against a partitioned reference (``objective.kl_coef`` with ``model.zero_init``: a second ZeRO-3
engine, :func:`~ds_tree.engine.reference.build_reference`): the ranks' walks make different numbers
of reference forwards, each gathering the reference's parameters collectively, so the no-grad pass
pads the old policy's walks and then the reference's, each on its own engine. The flat baseline's
reference holds the partitioned one's gathered weights.

Then one whole RL ``train_step`` under the last engine. Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from ds_tree.engine.dfs import row_chunks, settings_of, walk_events
from ds_tree.engine.reference import build_reference
from ds_tree.engine.runners import RunContext, runner_of
from ds_tree.losses.advantages import estimate
from ds_tree.models.loading import load_model
from ds_tree.objectives.policy_gradient import global_metrics
from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows, run_rl_rows
from ds_tree.packing.dfs_rows import DfsRow
from ds_tree.packing.modes import pack_trajectories
from ds_tree.train import exit_now
from tests.distributed.common import check_arguments, flat_sft, rebuild_engine, sft_backward, started_trainer
from tests.distributed.grad_check import gather_full_gradients, relative
from tests.distributed.sp_grad_check import full_parameters


def call_kinds(trainer, rows) -> list[str]:
    """This rank's calls for ``rows`` (before any lockstep padding)."""
    settings = settings_of(trainer.config.packing, trainer.ds_config)
    kinds = []
    for row in rows:
        walked = isinstance(row, DfsRow)
        kinds += walk_events(row_chunks(row, settings.chunk), settings.recompute) if walked else ["update"]
    return kinds


def flat_model(config, parameters):
    model = load_model(config.model.source, attention="reference", dtype="float64", seed=config.model.seed)
    model.load_state_dict({name: value.double() for name, value in parameters.items()})
    return model


def sft_case(trainer, step: int) -> dict:
    config = trainer.config
    parameters = full_parameters(trainer.engine)
    trajectories = trainer.context.trajectories(0)
    plan = trainer.context.plan(trajectories)
    output = sft_backward(trainer, plan.rows)
    gradients = gather_full_gradients(trainer.engine)
    trainer.updates.apply(step, output.loss)  # consumes the gradients (ZeRO-3 keeps them until a step)
    loss = torch.tensor([output.loss], dtype=torch.float64)
    dist.all_reduce(loss)
    result = {"kinds": call_kinds(trainer, plan.rows), "walked": sum(isinstance(r, DfsRow) for r in plan.rows)}
    if dist.get_rank() == 0:
        model = flat_model(config, parameters)
        flat = flat_sft(model, trajectories, config)
        result.update(
            loss_rel_err=abs(float(loss.item()) - flat.loss) / abs(flat.loss),
            max_rel_grad_err=max(relative(gradients[n], p.grad.numpy()) for n, p in model.named_parameters()),
        )
    return result


def rl_case(trainer, step: int) -> dict:
    config = trainer.config
    parameters = full_parameters(trainer.engine)
    reference = None
    if trainer.objective.reference.model is not None:  # the partitioned reference's weights, gathered
        module = trainer.objective.reference.model.module
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            reference = {name: p.detach().clone() for name, p in module.named_parameters()}
    rollouts = trainer.objective.prepare_step(0, trainer.context)
    (rows,), (update,) = rollouts.rows, rollouts.updates
    output = trainer.objective.run_update(update, trainer.context)
    gradients = gather_full_gradients(trainer.engine)
    trainer.updates.apply(step, output.loss)
    loss = torch.tensor([output.loss], dtype=torch.float64)
    dist.all_reduce(loss)
    result = {"kinds": call_kinds(trainer, [item.row for item in rows])}
    if reference is not None:  # the no-grad forwards of each model a rank's rows need, before padding
        run = RunContext(dfs=trainer.layout.dfs_settings())
        result["forwards"] = sum(runner_of(item.row).forwards(item.row, run) for item in rows)
        result["kl_ref"] = global_metrics(output.metrics)["kl_ref"]
    if dist.get_rank() == 0:
        model = flat_model(config, parameters)
        trajectories = trainer.context.trajectories(0)  # the whole step prepared above (one mini-batch), in order
        objective = config.objective
        advantages = estimate(  # the whole step's, in one process
            trajectories, objective.estimator, objective.normalise_advantages, tempo_coef=objective.tempo_coef
        ).by_trajectory()
        settings = config.objective.rl_settings()
        flat_rows = pack_trajectories(trajectories, "flat", max(len(t) for t in trajectories))
        flat_reference = flat_model(config, reference).requires_grad_(False) if reference is not None else None
        with torch.no_grad():
            prepared = prepare_rl_rows(
                model, flat_rows, advantages, settings, StepNormalisers.of(trajectories), reference=flat_reference
            )
        flat = run_rl_rows(model, prepared, settings, backward=torch.Tensor.backward)
        result.update(
            loss_rel_err=abs(float(loss.item()) - flat.loss) / abs(flat.loss),
            max_rel_grad_err=max(relative(gradients[n], p.grad.numpy()) for n, p in model.named_parameters()),
        )
    return result


def partitioned_reference(trainer):
    """The KL reference that ``objective.kl_coef`` with ``model.zero_init`` builds: a ZeRO-3 engine, partitioned."""
    config = replace(trainer.config, model=replace(trainer.config.model, zero_init=True))
    return build_reference(config, trainer.ds_config, torch.float32, trainer.engine.device)


def main() -> None:
    args, config = check_arguments(
        (("--deepspeed",), {"nargs": "+", "required": True}), (("--partitioned-reference",), {"action": "store_true"})
    )
    config.deepspeed = args.deepspeed[0]
    trainer = started_trainer(config)
    weights = full_parameters(trainer.engine)
    report = {"world_size": dist.get_world_size(), "runs": []}
    step = 0
    for ds_path in args.deepspeed:
        if ds_path != args.deepspeed[0]:
            rebuild_engine(trainer, ds_path, weights)
        stage = trainer.engine.zero_optimization_stage()
        for objective, case in (("sft", sft_case), ("grpo", rl_case)):
            trainer.config.objective.kind = objective  # the config's is grpo (its data checks ran)
            trainer.config.packing.dfs_recompute = objective == "grpo"
            step += 1
            result = case(trainer, step)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, result.pop("kinds"))
            report["runs"].append({"stage": stage, "objective": objective, "kinds_per_rank": every, **result})
    if args.partitioned_reference:  # under the last engine (ZeRO-3)
        trainer.config.objective.kl_coef = 0.05
        chunk, trainer.config.packing.dfs_chunk = trainer.config.packing.dfs_chunk, 16  # 49 and 45 chunks (64: 18, 18)
        trainer.objective.reference.model = partitioned_reference(trainer)
        step += 1
        result = rl_case(trainer, step)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (result.pop("kinds"), result.pop("forwards")))
        report["partitioned_reference"] = {
            "reference": type(trainer.objective.reference.model).__name__,
            "kinds_per_rank": [kinds for kinds, _ in every],
            "forwards_per_rank": [forwards for _, forwards in every],
            **result,
        }
        trainer.config.packing.dfs_chunk = chunk
    scalars = trainer.train_step(0)  # a whole RL step (objective.kind is grpo again)
    report["train_step"] = {"loss": scalars["loss/train"], "grad_norm": scalars["optim/grad_norm"]}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(report, indent=2))
    dist.barrier()
    trainer.close()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the trainer leaves: past the finalisers that abort a rank now and then (ds_tree/train.py)
