"""Resolving a DeepSpeed JSON against the training config, the way Hugging Face users expect.

``"auto"`` values are filled from the training config and the model; explicit values are kept
but checked, and anything that cannot work is rejected with a message naming the file and key,
before any process group starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_tree.config import Config, ConfigError

AUTO = "auto"


def _is_auto(value) -> bool:
    return value == AUTO


def resolve_deepspeed_config(config: Config, world_size: int, hidden_size: int | None = None) -> dict:
    """The DeepSpeed config dict for ``deepspeed.initialize``.

    Micro-batches are packed rows: one row per micro-batch (``train_micro_batch_size_per_gpu``
    = 1). The number of rows per step varies with the data, so ds_tree marks the accumulation
    boundary itself; ``gradient_accumulation_steps`` only has to be consistent with
    ``train_batch_size`` (``auto``: 1).
    """
    path = Path(config.deepspeed)
    if not path.is_file():
        raise ConfigError(f"deepspeed: {path}: no such DeepSpeed config file")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: malformed JSON ({error.msg} at line {error.lineno})") from None
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ConfigError(
                f"{path}: remove the {key!r} section; ds_tree builds AdamW and its schedule from the "
                "training config's optimizer section"
            )
    if "fp16" in ds and ds["fp16"].get("enabled") not in (False, AUTO):
        raise ConfigError(f"{path}: fp16 is not supported; use model.dtype: bfloat16")

    micro = ds.get("train_micro_batch_size_per_gpu", AUTO)
    if _is_auto(micro):
        micro = 1
    if micro != 1:
        raise ConfigError(
            f"{path}: train_micro_batch_size_per_gpu must be 1 or auto (a micro-batch is one packed row "
            f"of packing.budget tokens), got {micro}"
        )
    accumulation = ds.get("gradient_accumulation_steps", AUTO)
    total = ds.get("train_batch_size", AUTO)
    if _is_auto(accumulation):
        accumulation = 1 if _is_auto(total) else total // (micro * world_size)
    if _is_auto(total):
        total = micro * accumulation * world_size
    if not isinstance(accumulation, int) or accumulation < 1 or total != micro * accumulation * world_size:
        raise ConfigError(
            f"{path}: batch sizes do not multiply out: train_batch_size ({total}) must equal "
            f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({accumulation}) x "
            f"world size ({world_size})"
        )
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = accumulation
    ds["train_batch_size"] = total

    if _is_auto(ds.get("gradient_clipping", AUTO)):
        ds["gradient_clipping"] = config.optimizer.grad_clip
    bf16 = ds.setdefault("bf16", {})
    if _is_auto(bf16.get("enabled", AUTO)):
        bf16["enabled"] = config.model.dtype == "bfloat16"
    elif bool(bf16["enabled"]) != (config.model.dtype == "bfloat16"):
        raise ConfigError(f"{path}: bf16.enabled={bf16['enabled']} contradicts model.dtype={config.model.dtype}")

    zero = ds.setdefault("zero_optimization", {})
    if config.optimizer.non_finite == "skip" and not zero.get("stage", 0) and not bf16["enabled"]:
        raise ConfigError(
            f"{path}: optimizer.non_finite=skip needs ZeRO stage 1-3 or bf16, where DeepSpeed discards a step whose "
            "gradient norm is not finite; at stage 0 in float32 it applies it"
        )
    offloaded = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    if offloaded and ds.get("zero_force_ds_cpu_optimizer", True) is not False:
        raise ConfigError(
            f'{path}: zero_optimization.offload_optimizer needs "zero_force_ds_cpu_optimizer": false; ds_tree gives '
            "DeepSpeed a torch AdamW (fused), which DeepSpeed otherwise refuses to offload (docs/MEMORY.md)"
        )
    sizes = {
        "reduce_bucket_size": lambda h: h * h,
        "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    for key, rule in sizes.items():
        if _is_auto(zero.get(key)):
            if hidden_size is None:
                raise ConfigError(f"{path}: zero_optimization.{key} is auto but the model's hidden size is unknown")
            zero[key] = rule(hidden_size)
    leftover = [key for key, value in _walk(ds) if _is_auto(value)]
    if leftover:
        raise ConfigError(f"{path}: ds_tree cannot resolve 'auto' for {', '.join(leftover)}; set a value")
    ds.setdefault("steps_per_print", 1_000_000)
    return ds


def _walk(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _walk(value, name + ".")
        else:
            yield name, value
