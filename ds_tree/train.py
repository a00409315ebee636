"""Entry point: ``python -m ds_tree.train --config configs/X.yaml [key=value ...]``.

Runs under ``deepspeed --num_gpus N --module ds_tree.train``, ``torchrun`` and ``srun`` alike.
``--dry-run`` validates the config, the data and the DeepSpeed JSON without starting anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from ds_tree.config import load_config
from ds_tree.engine.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    # DeepSpeed 0.19 calls collectives torch 2.13 has renamed: one warning per call, every step.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning
    )
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="training YAML")
    parser.add_argument("--dry-run", action="store_true", help="validate everything, print the resolved configs")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        trainer = Trainer(config)
        trainer.prepare()
    except (ValueError, FileNotFoundError) as error:  # ConfigError, DataError, malformed model JSON
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps({"world_size": trainer.world_size, "deepspeed": trainer.ds_config}, indent=2))
        return 0
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
