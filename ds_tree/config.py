"""Training configuration: a YAML file mapped onto typed dataclasses.

Every section is a dataclass with a docstring under each field; validation lives in
``__post_init__``. An unknown key is an error that names it (with the file), never a silent
default. Command-line overrides are dotted ``key=value`` pairs (``optimizer.lr=1e-3``,
``max_steps=5``) whose values are parsed as YAML scalars.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration mistake; the message names the file and the offending key."""


@dataclass
class ModelConfig:
    source: str = ""
    """Model config JSON (random init from ``seed``) or a local Hugging Face directory."""
    dtype: str = "float32"
    """Parameter dtype: ``float32`` or ``bfloat16`` (DeepSpeed's bf16 mode)."""
    attention: str = "torch"
    """Tree attention engine: ``torch`` (CPU block-sparse), ``triton`` (GPU) or ``reference``."""
    seed: int = 0
    """Seed of the random init."""
    zero_init: bool = False
    """Build the model inside ``deepspeed.zero.Init`` (ZeRO-3: for models that do not fit one rank)."""
    tokenizer: str = ""
    """Optional tokenizer directory, saved beside the exported Hugging Face model."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("model.source is required (a config JSON or a model directory)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"model.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.attention not in ("torch", "triton", "reference"):
            raise ConfigError(f"model.attention must be torch, triton or reference, got {self.attention!r}")


@dataclass
class DataConfig:
    path: str = ""
    """Tokens JSONL file or a dataset directory written by ``tools/convert.py``."""
    groups_per_step: int = 8
    """Trees (groups of trajectories) per optimizer step, over all ranks."""
    merge: str = "group"
    """``group``: one tree per group id; ``global``: one trie over each step's trajectories."""
    seed: int = 0
    """Seed of the per-epoch shuffle; with the step number it fixes every step's data."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("data.path is required")
        if self.groups_per_step < 1:
            raise ConfigError(f"data.groups_per_step must be >= 1, got {self.groups_per_step}")
        if self.merge not in ("group", "global"):
            raise ConfigError(f"data.merge must be group or global, got {self.merge!r}")


@dataclass
class PackingConfig:
    mode: str = "tree"
    """``tree`` (tree packing, the default) or ``flat`` (the baseline: every trajectory alone)."""
    budget: int = 2048
    """Tokens of one packed row (one micro-batch). Larger trees are split into parts."""
    block: int = 1
    """Pad each row to a multiple of this (the GPU kernel's block size; 1 on the CPU)."""
    cost_per_token: float = 1.0
    """Balancing cost model: cost = cost_per_token * tokens + cost_per_pair * visible pairs."""
    cost_per_pair: float = 0.002
    """See ``cost_per_token``; attention's share of the work grows with visible pairs."""

    def __post_init__(self) -> None:
        if self.mode not in ("tree", "flat"):
            raise ConfigError(f"packing.mode must be tree or flat, got {self.mode!r}")
        if self.budget < 1 or self.block < 1:
            raise ConfigError("packing.budget and packing.block must be >= 1")


@dataclass
class ObjectiveConfig:
    normalisation: str = "token_mean"
    """``token_mean`` (over the global batch), ``sequence_mean`` or ``sum``."""
    policy: str = "exact"
    """``exact`` (the flat baseline's objective) or ``dedup`` (each distinct token once)."""

    def __post_init__(self) -> None:
        from ds_tree.losses.sft import check_objective

        try:
            check_objective(self.normalisation, self.policy)
        except ValueError as error:
            raise ConfigError(f"objective: {error}") from None


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables); resolves DeepSpeed's ``gradient_clipping: auto``."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr``."""
    schedule: str = "cosine"
    """``cosine`` decay to ``min_lr_ratio * lr`` at ``max_steps``, or ``constant``."""
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.lr <= 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError("optimizer.lr must be > 0, warmup_steps and grad_clip >= 0")
        if self.schedule not in ("cosine", "constant"):
            raise ConfigError(f"optimizer.schedule must be cosine or constant, got {self.schedule!r}")


@dataclass
class LoggingConfig:
    every: int = 1
    """Console line and TensorBoard scalars every N steps."""
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every N steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept on disk (older ones are deleted once a newer one is complete)."""
    resume: bool = True
    """Resume from ``<output_dir>/checkpoints/latest`` when it exists."""
    export_hf: bool = True
    """Write the final model as a Hugging Face directory (safetensors) in ``<output_dir>/hf``."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep_last >= 1")


@dataclass
class Config:
    model: ModelConfig
    data: DataConfig
    deepspeed: str = "configs/ds/zero3.json"
    """DeepSpeed JSON; its ``auto`` values are resolved from this config."""
    output_dir: str = "runs/default"
    """TensorBoard logs, metrics.jsonl, checkpoints and the exported model go here."""
    max_steps: int = 100
    """Optimizer steps."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")


def _build(cls: type, values: Any, where: str, prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: {prefix or 'the top level'} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        name = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{where}: unknown key {name!r} (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        dotted = f"{prefix}.{name}" if prefix else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, where, dotted)
        else:
            kwargs[name] = _coerce(hint, value, where, dotted)
    missing = [n for n, f in fields.items() if dataclasses.is_dataclass(hints[n]) and n not in values]
    for name in missing:
        if fields[name].default_factory is dataclasses.MISSING:  # a required section
            raise ConfigError(f"{where}: missing section {(prefix + '.' if prefix else '') + name!r}")
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _coerce(hint: Any, value: Any, where: str, dotted: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: {dotted} must be a list, got {value!r}")
        return tuple(float(v) for v in value)
    expected = hint if isinstance(hint, type) else None
    if expected is not None and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: {dotted} must be {expected.__name__}, got {value!r}")
    return value


def _apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key=value")
    key, raw = override.split("=", 1)
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw else ""


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (YAML), apply dotted ``key=value`` overrides, and validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: malformed YAML ({error})") from None
    for override in overrides:
        _apply_override(tree, override)
    return _build(Config, tree, str(path), "")


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)
