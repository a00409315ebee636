"""Predicted peak memory per rank of a training config, and the largest row that fits.

Reads the training YAML (key=value overrides as the trainer takes them), its model config and its
DeepSpeed JSON (ZeRO stage, offload_optimizer / offload_param), and prints per rank: parameters,
gradients and optimizer states, activations of one packed row of packing.budget tokens with and
without activation checkpointing, the LM head's share (model.head_chunk), and the largest
packing.budget whose predicted peak fits --memory-gib of accelerator memory. The row is planned
as if every token were a target (the head's worst case).

A config that walks trees (packing.mode: dfs, or over_budget: dfs) also gets the dfs walk's peak
on a root-to-leaf path of --path-tokens tokens (default: 4 x packing.budget) in chunks of
packing.dfs_chunk, with and without packing.dfs_recompute, and the longest path each trains
within the memory; with parallel.sequence_parallel_size S > 1 (packing.mode: dfs) one rank's share
of the walk its group of S ranks makes, every chunk sharded. The arithmetic and its measured error
are in docs/MEMORY.md.

--explain [STEP] also prints the step plan of step STEP (default 0) of data.path: every rank's work
items, each with its execution kind (packed row, walked tree, sequence-parallel shard), tokens,
trees, trajectories, predicted cost and why it got its kind.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ds_tree.cli.common import command_parser
from ds_tree.config import ConfigError, load_config
from ds_tree.data.jsonl import json_text
from ds_tree.memory_plan import (
    GIB,
    ModelShape,
    StateBytes,
    activation_bytes,
    dfs_activation_bytes,
    largest_budget,
    largest_dfs_path,
    reference_bytes,
    state_bytes,
)


def zero_settings(path: str) -> tuple[int, bool, bool]:
    """ZeRO stage and whether optimizer / parameters are offloaded, from a DeepSpeed JSON."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"deepspeed: {file}: no such DeepSpeed config file")
    try:
        zero = json.loads(file.read_text()).get("zero_optimization", {})
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file}: malformed JSON ({error.msg} at line {error.lineno})") from None

    def offloaded(key: str) -> bool:
        return zero.get(key, {}).get("device", "none") not in ("none", None)

    return int(zero.get("stage", 0)), offloaded("offload_optimizer"), offloaded("offload_param")


def make_plan(config_path: str, overrides: list[str], world_size: int, memory_gib: float, path_tokens: int = 0) -> dict:
    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.models.ulysses import check_sequence_parallel

    config = load_config(config_path, overrides)
    model_config = load_model_config(config.model.source)
    check_sequence_parallel(config, world_size, model_config)  # the dry run's check
    return plan_of(config, config_path, model_config, world_size, memory_gib, path_tokens)


def plan_of(config, config_path: str, model_config, world_size: int, memory_gib: float, path_tokens: int = 0) -> dict:
    """The plan of a loaded config (``make_plan``; the trainer's dry run asks for it too)."""
    from ds_tree.engine.dfs import uses_dfs

    stage, offload_optimizer, offload_param = zero_settings(config.deepspeed)
    shape = ModelShape.of(model_config)
    trained = None
    if config.model.lora.enabled:  # frozen base + adapters; gradients and optimizer states: the adapters'
        from dataclasses import replace

        from ds_tree.models.lora import adapter_parameter_count

        trained = adapter_parameter_count(model_config, config.model.lora)
        shape = replace(shape, parameters=shape.parameters + trained)
    dtype, budget = config.model.dtype, config.packing.budget
    entropy = config.objective.is_rl  # RL computes each target's entropy for its metric
    states = state_bytes(
        shape,
        dtype,
        stage,
        world_size,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        trained=trained,
    )
    objective = config.objective
    reference = reference_bytes(
        shape, dtype, world_size, partitioned=config.model.zero_init, offload=objective.reference_offload
    )
    if not (objective.is_rl and objective.kl_coef):
        reference = StateBytes(0, 0, 0, 0, 0)
    every = config.model.checkpointed_every
    modes = {"without_checkpointing": 0, "with_checkpointing": every or 1}
    resident = states.total + reference.total
    free = int(memory_gib * GIB) - resident
    activations, budgets = {}, {}
    for name, checkpoint_every in modes.items():
        plan = activation_bytes(
            shape, dtype, budget, checkpoint_every=checkpoint_every, head_chunk=config.model.head_chunk, entropy=entropy
        )
        activations[name] = {"layers": plan.layers, "head": plan.head, "recompute": plan.recompute, "peak": plan.peak}
        budgets[name] = largest_budget(
            shape, dtype, free, checkpoint_every=checkpoint_every, head_chunk=config.model.head_chunk, entropy=entropy
        )
    chosen = "with_checkpointing" if every else "without_checkpointing"
    peak = resident + activations[chosen]["peak"]
    dfs = None
    if uses_dfs(config.packing):
        dfs = dfs_plan(config, shape, free, path_tokens or 4 * budget, entropy)
        walked = dfs["with_recompute" if dfs["recompute"] else "without_recompute"]["peak"]
        # mode dfs walks every tree; over_budget dfs packs the others as configured
        peak = resident + (walked if config.packing.mode == "dfs" else max(walked, activations[chosen]["peak"]))
    return {
        "config": config_path,
        "model": config.model.source,
        "parameters": shape.parameters,
        "trained_parameters": shape.parameters if trained is None else trained,
        "dtype": dtype,
        "zero_stage": stage,
        "world_size": world_size,
        "offload_optimizer": offload_optimizer,
        "offload_param": offload_param,
        "budget": budget,
        "checkpoint_every": modes["with_checkpointing"],
        "head_chunk": config.model.head_chunk,
        "states": {
            "parameters": states.parameters,
            "gradients": states.gradients,
            "optimizer": states.optimizer,
            "gathered": states.gathered,
            "reference": reference.total,
            "total": resident,
            "cpu": states.cpu + reference.cpu,
        },
        "activations": activations,
        "config_uses": chosen,
        "peak_bytes": peak,
        "memory_gib": memory_gib,
        "largest_budget": budgets,
        "dfs": dfs,
    }


def check_memory(config, model_config, world_size: int) -> str | None:
    """A warning when the plan's predicted peak does not fit this machine (``None`` when it fits):
    per rank against the GPU's memory, or on the CPU, the ranks of this machine (``LOCAL_WORLD_SIZE``,
    else the world size) together, offloaded states included, against its physical memory. A
    warning, not an error: the dry run also checks configs meant for another machine."""
    import os

    import torch

    if torch.cuda.is_available():
        available = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
        where, ranks = "the GPU's memory", 1
    else:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = "this machine's memory"
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    plan = plan_of(config, "", model_config, world_size, available / GIB)
    needed = ranks * (plan["peak_bytes"] + (0 if torch.cuda.is_available() else plan["states"]["cpu"]))
    if needed <= available:
        return None
    share = f"{ranks} ranks x " if ranks > 1 else ""
    return (
        f"ds-tree plan predicts {share}{plan['peak_bytes'] / GIB:.3g} GiB per rank ({plan['parameters'] / 1e9:.3g} B "
        f"parameters, ZeRO-{plan['zero_stage']} over {world_size} rank(s)), {needed / GIB:.3g} GiB in all, against "
        f"{available / GIB:.3g} GiB of {where}: the run will likely fail for memory (see `ds-tree plan`)"
    )


def dfs_plan(config, shape: ModelShape, free: int, path_tokens: int, entropy: bool) -> dict:
    """The dfs walk of a ``path_tokens``-token path with and without recompute, as configured otherwise."""
    from ds_tree.engine.dfs import settings_of

    settings = settings_of(config.packing)
    # packing.mode dfs with sequence parallelism: each tree walked by a group, every chunk sharded over it
    size = config.parallel.sequence_parallel_size if config.packing.mode == "dfs" else 1
    options = {
        "checkpoint_every": config.model.checkpointed_every,
        "head_chunk": config.model.head_chunk,
        "entropy": entropy,
        "packed_below": True,  # the worst tree: a packed chunk below the path (ds_tree/packing/dfs_chunks.py)
        "sequence_parallel": size,
    }
    plan = {
        "chunk": settings.chunk,
        "recompute": settings.recompute,
        "path_tokens": path_tokens,
        "sequence_parallel_size": size,
    }
    for name, recompute in (("without_recompute", False), ("with_recompute", True)):
        walk = dfs_activation_bytes(
            shape, config.model.dtype, path_tokens, settings.chunk, recompute=recompute, **options
        )
        plan[name] = {
            "held": walk.held,
            "cache": walk.cache,
            "chunk": walk.chunk,
            "peak": walk.peak,
            "largest_path": largest_dfs_path(
                shape, config.model.dtype, free, settings.chunk, recompute=recompute, **options
            ),
        }
    return plan


def format_plan(plan: dict) -> str:
    offload = [name for name in ("optimizer", "param") if plan[f"offload_{name}"]]
    states, activations = plan["states"], plan["activations"]
    rows = [
        ("parameters", states["parameters"]),
        ("gradients", states["gradients"]),
        ("optimizer states (fp32 master, AdamW moments)", states["optimizer"]),
        ("ZeRO-3 gathered module", states["gathered"]),
        ("KL reference model (frozen)", states.get("reference", 0)),
        ("model states", states["total"]),
        ("in CPU memory (offload)", states["cpu"]),
    ]
    packed_parts = (
        ("layers", "kept by the layers"),
        ("head", "head at its backward"),
        ("recompute", "at a layer's recompute"),
        ("peak", "activation peak"),
    )
    for name, label in (
        ("without_checkpointing", "no checkpointing"),
        ("with_checkpointing", f"checkpointing every {plan['checkpoint_every']}"),
    ):
        rows += [(f"{label}: {text}", activations[name][key]) for key, text in packed_parts]
    dfs = plan["dfs"]
    if dfs is not None:
        walk_parts = (
            ("held", "ancestors' held graphs"),
            ("cache", "cached keys, values, gradients"),
            ("chunk", "deepest chunk at its backward"),
            ("peak", "activation peak"),
        )
        for name, label in (("without_recompute", "dfs walk"), ("with_recompute", "dfs walk, recompute")):
            rows += [(f"{label}: {text}", dfs[name][key]) for key, text in walk_parts]
    chosen = plan["config_uses"].replace("_", " ") + (", dfs walk" if dfs is not None else "")
    rows.append((f"predicted peak per rank ({chosen}, as configured)", plan["peak_bytes"]))
    budgets = plan["largest_budget"]
    frozen = plan["trained_parameters"] != plan["parameters"]
    trained = f"; {plan['trained_parameters'] / 1e6:.3f} M trained: LoRA adapters" if frozen else ""
    header = (
        f"{plan['config']}: {plan['parameters'] / 1e9:.3f} B parameters ({plan['model']}{trained}), {plan['dtype']}, "
        f"ZeRO-{plan['zero_stage']} over {plan['world_size']} rank(s), offload: {', '.join(offload) or 'none'}\n"
        f"activations: one row of {plan['budget']} tokens, every token a target, head_chunk {plan['head_chunk']}\n"
    )
    table = [f"{'per rank':<56}{'GiB':>10}"] + [f"{label:<56}{value / GIB:>10.2f}" for label, value in rows]
    footer = (
        f"largest packing.budget within {plan['memory_gib']:g} GiB: {budgets['without_checkpointing']} tokens "
        f"without checkpointing, {budgets['with_checkpointing']} with"
    )
    if dfs is not None:
        sharded = dfs["sequence_parallel_size"]
        header += (
            f"dfs walk: a root-to-leaf path of {dfs['path_tokens']} tokens in chunks of {dfs['chunk']}, "
            f"packing.dfs_recompute {str(dfs['recompute']).lower()}"
            + (f", each chunk sharded over {sharded} ranks (one rank's share)" if sharded > 1 else "")
            + "\n"
        )
        footer += (
            f"\nlongest root-to-leaf path the dfs walk trains within {plan['memory_gib']:g} GiB: "
            f"{dfs['without_recompute']['largest_path']} tokens without recompute, "
            f"{dfs['with_recompute']['largest_path']} with"
        )
    return "\n".join([header, *table, footer])


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("config", help="training YAML")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, as the trainer takes them")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--memory-gib", type=float, default=80.0, help="accelerator memory per rank (default 80)")
    parser.add_argument(
        "--path-tokens",
        type=int,
        default=0,
        help="dfs configs: plan the walk of a root-to-leaf path of this many tokens (default 4 x packing.budget)",
    )
    parser.add_argument(
        "--explain",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="STEP",
        help="also print every rank's work items of step STEP (default 0) of data.path, with kinds and costs",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_intermixed_args(argv)
    if args.world_size < 1 or not (math.isfinite(args.memory_gib) and args.memory_gib > 0) or args.path_tokens < 0:
        parser.error("--world-size must be >= 1, --memory-gib a finite number > 0 and --path-tokens >= 0")
    try:
        plan = make_plan(args.config, args.overrides, args.world_size, args.memory_gib, args.path_tokens)
        steps = None if args.explain is None else step_plan(args.config, args.overrides, args.world_size, args.explain)
    except (ConfigError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json_text(plan | ({} if steps is None else {"step_plan": steps.as_dict()}), indent=2))
    else:
        print(format_plan(plan) + ("" if steps is None else "\n\n" + steps.explain()))
    return 0


def step_plan(config_path: str, overrides: list[str], world_size: int, step: int):
    """The step plan (:mod:`ds_tree.packing.plan`) of ``step`` of the config's data, as the trainer makes it."""
    from ds_tree.data import load_trajectories
    from ds_tree.data.sampler import StepSampler
    from ds_tree.errors import DataError
    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.packing.plan import PlanSettings, plan_step
    from ds_tree.trees.trajectory import group_trajectories

    config = load_config(config_path, overrides)
    if step < 0:
        raise ConfigError(f"--explain: the step must be >= 0, got {step}")
    if not config.data.path:
        raise ConfigError("--explain needs data.path (an online RL config samples its steps' data)")
    try:
        groups = group_trajectories(load_trajectories(config.data.path))
    except DataError as error:
        raise ConfigError(f"data.path: {error}") from None
    sampler = StepSampler(len(groups), config.data.groups_per_step, config.data.seed)
    pad_id = load_model_config(config.model.source).pad_token_id or 0
    settings = PlanSettings.of_config(config, pad_id)
    return plan_step(sampler.trajectories_for_step(groups, step), settings, world_size)
