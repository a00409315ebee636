"""What every distributed check script starts with: its arguments and a set-up trainer."""

from __future__ import annotations

import argparse

from ds_tree.config import Config, load_config
from ds_tree.engine.trainer import Trainer


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
