"""Training configs and DeepSpeed JSONs written for a test: the tiny Llama on the CPU, one step, ZeRO-3."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.helpers import ROOT
from tests.helpers.data import write_prompts

PARITY = "ds_tree.envs.digit_parity:reward"
"""The online tests' reward: digits of the prompt's parity."""


def write_config(tmp_path: Path, data: Path, **sections) -> Path:
    """``tmp_path/config.yaml``: a one-step run on ``data``; each keyword updates (a dict) or sets a section."""
    config = {
        "model": {"source": str(ROOT / "configs/models/tiny_llama.json"), "seed": 3},
        "data": {"path": str(data), "groups_per_step": 4},
        "deepspeed": str(ROOT / "configs/ds/zero3.json"),
        "output_dir": str(tmp_path / "run"),
        "max_steps": 1,
        "packing": {"budget": 400},
        "optimizer": {"lr": 1e-3, "grad_clip": 1.0, "schedule": "constant"},
        "logging": {"progress_bar": False, "report_to": ["tensorboard"]},
        "checkpoint": {"export_hf": False},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            config.setdefault(name, {}).update(values)
        else:
            config[name] = values
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def write_accumulating_ds_config(path: Path, stage: int) -> Path:
    """A DeepSpeed JSON of ZeRO ``stage`` with 2 accumulation steps on 2 ranks (sizes resolved by ds_tree)."""
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 4,
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
    }
    if stage == 3:
        ds["zero_optimization"].update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    path.write_text(json.dumps(ds))
    return path


def online_config(tmp_path: Path, tokenizer_dir: Path, **sections) -> Path:
    """:func:`write_config` for online GRPO on :func:`~tests.helpers.data.write_prompts`' prompts (no data
    section); a ``rollout`` keyword updates the rollout section, the others replace theirs."""
    rollout = {
        "enabled": True,
        "prompts": str(write_prompts(tmp_path / "prompts.jsonl")),
        "reward": PARITY,
        "prompts_per_step": 2,
        "segment_length": 3,
        "branching": 2,
        "max_depth": 2,
        "width": 4,
        "max_new_tokens": 6,
    }
    rollout.update(sections.pop("rollout", {}))
    sections = {
        "model": {"tokenizer": str(tokenizer_dir)},
        "objective": {"kind": "grpo", "normalise_advantages": True, "eps_high": 0.28},
        "packing": {"budget": 64},
        "rollout": rollout,
        **sections,
    }
    return without_data(write_config(tmp_path, Path(""), **sections))


def without_data(path: Path) -> Path:
    """``path`` (a config written by ``write_config``) without its data section."""
    config = yaml.safe_load(path.read_text())
    del config["data"]
    path.write_text(yaml.safe_dump(config))
    return path
