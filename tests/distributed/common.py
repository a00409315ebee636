"""What every distributed check script starts with: its arguments and a set-up trainer."""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from ds_tree.config import Config, load_config
from ds_tree.engine.build import build_engine
from ds_tree.engine.runners import StepOutput
from ds_tree.engine.trainer import Trainer
from ds_tree.losses.sft import Normalisers
from ds_tree.models.loading import load_model
from ds_tree.objectives.sft import global_normalisers, run_rows
from ds_tree.packing.modes import pack_trajectories
from ds_tree.run.ds_config import resolve_deepspeed_config


def check_arguments(*extra: tuple[tuple[str, ...], dict]) -> tuple[argparse.Namespace, Config]:
    """``--config``, ``--out``, any ``extra`` ``(flags, kwargs)`` options and ``key=value`` overrides."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    for flags, options in extra:
        parser.add_argument(*flags, **options)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    return args, load_config(args.config, args.overrides)


def started_trainer(config: Config) -> Trainer:
    """A trainer past ``prepare`` and ``setup``: process group, engine, resume."""
    trainer = Trainer(config)
    trainer.prepare()
    trainer.setup()
    return trainer


def sft_backward(trainer: Trainer, rows) -> StepOutput:
    """The SFT objective's forward and backward of this rank's ``rows`` through the trainer's engine, their
    normalisers summed over the ranks (one update's gradient, without an MoE model's router loss)."""
    objective = trainer.config.objective
    return run_rows(
        trainer.engine,
        rows,
        global_normalisers(rows),
        objective.normalisation,
        objective.policy,
        backward_for=trainer.updates.backward_for,
        dfs=trainer.layout.dfs_settings(),
        device=trainer.engine.device,
        head_chunk=trainer.config.model.head_chunk,
    )


def flat_sft(model, trajectories, config: Config, budget: int | None = None) -> StepOutput:
    """The SFT objective of ``trajectories`` in the flat layout, one process, gradients left on ``model``
    (``budget``: of a flat row; default the longest trajectory)."""
    rows = pack_trajectories(trajectories, "flat", budget or max(len(t) for t in trajectories))
    objective = config.objective
    normalisers = Normalisers.from_rows(rows)
    return run_rows(model, rows, normalisers, objective.normalisation, objective.policy, backward=torch.Tensor.backward)


def rebuild_engine(trainer: Trainer, ds_path: str, weights: dict[str, torch.Tensor], prepare=None) -> None:
    """A fresh DeepSpeed engine from ``ds_path`` on a model holding ``weights`` (``prepare(model)`` first), and
    what a step needs around it."""
    config = trainer.config
    config.deepspeed = ds_path
    trainer.ds_config = resolve_deepspeed_config(config, trainer.world_size, trainer.model_config.hidden_size)
    trainer.layout = replace(trainer.layout, ds_config=trainer.ds_config)
    model = load_model(config.model.source, attention=config.model.attention, seed=config.model.seed)
    model.load_state_dict(weights)
    if prepare is not None:
        prepare(model)
    trainer.engine = build_engine(model, config, trainer.ds_config)
    trainer.connect()
