"""Reward curves of online RL runs, and their sampling cost, from each run's metrics.jsonl.

Several run directories under one label (runs with different seeds) are averaged step by step; they
must have the same steps. Plots rollout/reward_mean against the training step (left) and against
the tokens the sampler ran through the model so far (right, rollout/forward_tokens summed), per
step (thin) and as a running mean over --window steps (thick), into the --output file, and prints
a Markdown table: runs, steps, mean reward of the first and of the last --window steps, and the
tokens the sampler drew and ran through the model in one run (rollout/sampled_tokens,
rollout/forward_tokens). A run that evaluates held-out prompts (the eval section, docs/EVAL.md) also gets
its eval/reward_mean drawn beside the training reward (dashed, with markers) and its last value in the
table. A run directory without metrics.jsonl, or a record without the step or those rollout/ metrics,
exits 2 naming the file and line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.cli.common import check_not_input, check_output_path, command_parser
from ds_tree.reports.online import average_runs, plot, read_run, table


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "runs", nargs="+", metavar="LABEL=RUN_DIR[,RUN_DIR ...]", help="a label and online RL runs' output_dirs"
    )
    parser.add_argument(
        "--output",
        type=Path,
        required=True,
        metavar="FILE",
        help="the figure to write (PNG, or the format its extension names: pdf, svg); its folder is created",
    )
    parser.add_argument("--window", type=int, default=10, help="steps of the running mean and of the table's columns")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error("--window must be >= 1")
    check_output_path(parser, args.output, "--output")
    runs = {}
    for item in args.runs:
        label, separator, directories = item.partition("=")
        if not separator or not label or not directories:
            parser.error(f"{item!r} is not LABEL=RUN_DIR[,RUN_DIR ...]")
        check_not_input(parser, "--output", args.output, [Path(d) / "metrics.jsonl" for d in directories.split(",")])
        try:
            runs[label] = average_runs([read_run(Path(d)) for d in directories.split(",")], label)
        except ValueError as error:
            print(f"ds-tree plot-online: error: {error}", file=sys.stderr)
            return 2
    plot(runs, args.window, args.output)
    print(table(runs, args.window))
    print(f"wrote {args.output}")
    return 0
