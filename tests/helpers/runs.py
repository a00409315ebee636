"""A training run's checks in this process: the trainer prepared (what a dry run checks), the dry run itself."""

from __future__ import annotations

import os
from pathlib import Path

from ds_tree import train
from ds_tree.config import load_config
from ds_tree.engine.trainer import Trainer
from tests.helpers import ROOT


def prepare(config: Path, *overrides: str, world_size: int = 1) -> Trainer:
    """A :class:`Trainer` of ``config`` prepared as rank 0 of ``world_size`` (the rank variables are unset after)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    try:
        trainer = Trainer(load_config(config, overrides))
        trainer.prepare()
        return trainer
    finally:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)


def dry_run_in_process(monkeypatch, capsys, world_size: int, config: str, *overrides: str) -> tuple[int, str, str]:
    """``train.main --dry-run`` as rank 0 of ``world_size``, from the repository: (exit code, stdout, stderr)."""
    monkeypatch.chdir(ROOT)
    # RANK as well: without it the trainer's single-process fallback sets WORLD_SIZE=1.
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size)}.items():
        monkeypatch.setenv(name, value)
    code = train.main(["--config", config, "--dry-run", *overrides])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def dry_run(monkeypatch, capsys, config: Path, *overrides: str) -> tuple[int, str]:
    """:func:`dry_run_in_process` on 2 ranks: (exit code, stderr)."""
    code, _, err = dry_run_in_process(monkeypatch, capsys, 2, str(config), *overrides)
    return code, err
