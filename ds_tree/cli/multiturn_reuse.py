"""Tokens the multi-turn sampler draws and runs through the model, episode trees against independent
episodes (docs/ENVIRONMENTS.md, Measured).

Samples the first --count tasks of --tasks with the policy in --model (a Hugging Face directory,
e.g. the runs/multiturn/rl/hf export of configs/multiturn_cpu.yaml) in three modes: episode trees;
the same trees with every turn prefilling its whole path again (keys/values not carried across
turns); independent episodes of the same width. Every mode uses the same sampler and environment
settings (--config's rollout section) and seeds. Prints a Markdown table, a row per mode: leaves, mean
leaf reward, tokens sampled, tokens run through the model, tokens of the trees and of their leaves
laid out flat. Bad input exits 2 with one error line. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys

from ds_tree.cli.common import command_parser
from ds_tree.errors import ConfigError, DataError

HEADER = ("sampling", "leaves", "reward", "sampled tokens", "forward tokens", "tree tokens", "flat tokens")


def markdown_table(rows: list[dict]) -> str:
    """The rows of :func:`ds_tree.bench.multiturn_reuse.measure_reuse` as a Markdown table."""
    lines = ["| " + " | ".join(HEADER) + " |", "|---" * len(HEADER) + "|"]
    for row in rows:
        lines.append(
            f"| {row['sampling']} | {row['leaves']} | {row['reward']:.3f} | {row['sampled_tokens']} | "
            f"{row['forward_tokens']} | {row['tree_tokens']} | {row['flat_tokens']} |"
        )
    return "\n".join(lines)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--model", required=True, metavar="DIR", help="the policy: a Hugging Face model directory")
    parser.add_argument("--tokenizer", required=True, metavar="DIR", help="its tokenizer directory")
    parser.add_argument("--tasks", required=True, metavar="FILE", help="tasks JSONL (one environment task a line)")
    parser.add_argument(
        "--config", required=True, metavar="YAML", help="the run's training config (rollout.env, sampler settings)"
    )
    parser.add_argument("--count", type=int, default=16, help="tasks sampled, the first ones (default %(default)s)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be >= 1")
    from ds_tree.bench.multiturn_reuse import multiturn_reuse

    try:
        rows = multiturn_reuse(args.model, args.tokenizer, args.tasks, args.config, count=args.count)
    except (ConfigError, DataError) as error:
        print(f"{prog or 'ds-tree multiturn-reuse'}: error: {error}", file=sys.stderr)
        return 2
    print(markdown_table(rows))
    return 0
