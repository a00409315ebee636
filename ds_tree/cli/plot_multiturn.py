"""The multi-turn CPU example's figure (docs/ENVIRONMENTS.md): its learning curve and the sampler's tree reuse.

Reads the run's metrics.jsonl: the warm-up steps (warmup/sft_loss, rollout.env.warmup_steps; SFT
steps after the first RL step are refresh steps, rollout.env.refresh_every) and the RL steps
(rollout/ metrics). Left: rollout/reward_mean per RL step and its running mean over --window
steps, the guessing rate (0.1) and the 0.8 target. Right, per RL step: the tokens the episode trees
sampled (rollout/sampled_tokens) against what independent episodes with the same leaves would
sample (plus rollout/tokens_saved: every leaf's assistant tokens), and the tree tokens trained
against their flat count (tree/por). A run that evaluates held-out tasks (the eval section,
docs/EVAL.md) gets its eval/reward_mean drawn on the left panel too, and a line of its figures. Writes
the figure to --output and prints the figures the docs quote. A run directory without metrics.jsonl, a
malformed record, or a record without those metrics, exits 2 naming the file and line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.cli.common import check_not_input, check_output_path, command_parser
from ds_tree.reports.multiturn import evaluation_summary, plot, read_evaluations, read_metrics, summary


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("run", type=Path, metavar="RUN_DIR", help="the run's output_dir (holds metrics.jsonl)")
    parser.add_argument(
        "--output",
        type=Path,
        required=True,
        metavar="FILE",
        help="the figure to write (PNG, or the format its extension names: pdf, svg); its folder is created",
    )
    parser.add_argument("--title", default="secret tool", help="the task's name in the left panel's title")
    parser.add_argument(
        "--chance",
        type=float,
        default=0.1,
        help="the guessing rate drawn as a dotted line (default 0.1: the secret tool's ten digits)",
    )
    parser.add_argument(
        "--window", type=int, default=5, help="RL steps of the running mean and of the reward figures (default 5)"
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error("--window must be >= 1")
    check_output_path(parser, args.output, "--output")
    check_not_input(parser, "--output", args.output, [args.run / "metrics.jsonl"])
    try:
        warmup, rl, refresh = read_metrics(args.run)
        evaluations = read_evaluations(args.run)
    except ValueError as error:
        print(f"{prog or 'ds-tree plot-multiturn'}: error: {error}", file=sys.stderr)
        return 2
    window = min(args.window, len(rl))
    plot(warmup, rl, window, args.output, args.title, args.chance, evaluations)
    print("\n".join(summary(warmup, rl, refresh, window) + evaluation_summary(evaluations)))
    print(f"wrote {args.output}")
    return 0
