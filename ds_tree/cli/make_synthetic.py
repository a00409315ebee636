"""Write synthetic agentic tree data (tokens JSONL) with a target prefix overlap ratio (POR).

Token ids in the shape of ChatML agent conversations (no tokenizer needed): each group is one
task whose trials copy an earlier trial's start and diverge at an assistant token, as sampling
does; --por 0 makes every trial its own group. The --output file is gzip-compressed when its name
ends in .gz; its folder must exist. Prints the achieved POR next to the target as one JSON object.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ds_tree.cli.choices import SYNTHETIC_MAX_TOKENS, SYNTHETIC_SEED, TOKENIZER_VOCAB_SIZE
from ds_tree.cli.common import check_output_file, command_parser
from ds_tree.data.jsonl import json_text


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--output", required=True, type=Path, metavar="FILE", help="tokens JSONL (.gz compresses)")
    parser.add_argument("--groups", required=True, type=int, help="number of tasks (trees)")
    parser.add_argument("--por", required=True, type=float, help="target POR in [0, 0.95]")
    parser.add_argument("--seed", type=int, default=SYNTHETIC_SEED, help="random seed (default %(default)s)")
    parser.add_argument("--trials", type=int, default=None, help="trials per task (default: 8 or what --por needs)")
    parser.add_argument(
        "--vocab-size", type=int, default=TOKENIZER_VOCAB_SIZE, help="token ids are below this (default %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=SYNTHETIC_MAX_TOKENS, help="longest trajectory (default %(default)s)"
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    check_output_file(parser, args.output)
    from ds_tree.data.synthetic import SyntheticConfig, write_synthetic

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
