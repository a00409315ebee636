"""Write synthetic agentic tree data (tokens JSONL) with a target prefix overlap ratio.

Usage: ds-tree make-synthetic --output FILE --groups N --por P [--seed S] [--trials T]
       [--vocab-size 1024] [--max-tokens L]
FILE ending in .gz is gzip-compressed. Prints the achieved POR next to the target.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ds_tree.data.jsonl import json_text
from ds_tree.data.synthetic import SyntheticConfig, write_synthetic


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = SyntheticConfig()
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--groups", required=True, type=int, help="number of tasks (trees)")
    parser.add_argument("--por", required=True, type=float, help="target POR in [0, 0.95]")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--trials", type=int, default=None, help="trials per task (default: 8 or what --por needs)")
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="length cap of one trajectory")
    args = parser.parse_args(argv)
    try:
        config = SyntheticConfig(
            groups=args.groups,
            por=args.por,
            trials=args.trials,
            vocab_size=args.vocab_size,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
    except ValueError as error:
        parser.error(str(error))
    print(json_text(write_synthetic(config, args.output)))
    return 0
