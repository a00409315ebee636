"""The predicted memory of a training config: what ``ds-tree plan`` prints and the trainer's dry run checks.

From the loaded config, its model config and its DeepSpeed JSON (ZeRO stage, offload_optimizer /
offload_param): model states per rank (a KL reference's included), the activations of one packed
row of ``packing.budget`` tokens with and without activation checkpointing, the LM head's share, the
largest budget that fits, and for configs that walk trees the dfs walk's peak
(:mod:`ds_tree.memory.predict` does the arithmetic; docs/MEMORY.md its measured error).
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

from ds_tree.config import ConfigError
from ds_tree.memory.predict import (
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


def plan_of(config, config_path: str, model_config, world_size: int, memory_gib: float, path_tokens: int = 0) -> dict:
    """The plan of a loaded config (``ds-tree plan``'s, :func:`ds_tree.cli.plan.make_plan`; the trainer's dry run
    asks for it too, :func:`check_memory`)."""
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
    free = int(Fraction(memory_gib) * GIB) - resident  # exact: memory_gib * GIB overflows a float past 1.6e299
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
    if config.packing.uses_dfs:
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
    # dfs walks with sequence parallelism (mode dfs, or over_budget dfs): each walked tree walked by a group,
    # every chunk sharded over it
    size = config.parallel.sequence_parallel_size
    options = {
        "checkpoint_every": config.model.checkpointed_every,
        "head_chunk": config.model.head_chunk,
        "entropy": entropy,
        "packed_below": True,  # the worst tree: a packed chunk below the path (ds_tree/packing/dfs_chunks.py)
        "sequence_parallel": size,
    }
    plan = {
        "chunk": min(settings.chunk, path_tokens),  # a chunk longer than the path walks the path in one
        "configured_chunk": settings.chunk,
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
