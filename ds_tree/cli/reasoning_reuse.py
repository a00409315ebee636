"""Tokens an episode of reasoning turns costs to train: the episode tree against per-turn samples and
re-rendered sequences (docs/ENVIRONMENTS.md, *Reasoning turns as trees*).

The CPU multi-turn example's task (the secret-tool environment, one call turn then --width answers)
with a scripted policy that thinks --reasoning-tokens tokens before each turn, rendered with each
--template's tokenizer (made here, as make-tokenizer does with that chat format). Prints a Markdown table, a
row per template, of per-episode means: answers, rewritten turns (a new branch each), tokens of the
tree, of its paths laid out flat, of every turn as its own sample, of the final conversations
re-rendered. A benchmark, not a test: its time grows with --width x --episodes (--width 100000 takes
minutes), so once a template takes over 2 s a progress line counts its episodes on stderr.
"""

from __future__ import annotations

import argparse

from ds_tree.cli.common import command_parser

HEADER = ("template", "answers", "rewritten", "tree", "paths flat", "turn samples", "re-rendered")


def markdown_table(rows: list[dict]) -> str:
    """The rows of :func:`ds_tree.bench.reasoning_trees.measure_templates` as a Markdown table."""
    lines = ["| " + " | ".join(HEADER) + " |", "|---" * len(HEADER) + "|"]
    for row in rows:
        lines.append(
            f"| {row['template']} | {row['leaves']:.0f} | {row['rewritten']:.0f} | {row['tree']:.0f} | "
            f"{row['turn_samples']:.0f} | {row['independent']:.0f} | {row['re_rendered']:.0f} |"
        )
    return "\n".join(lines)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--template", action="append", default=None, help="chat template with <think> reasoning (qwq, qwen3; repeat)"
    )
    parser.add_argument("--episodes", type=int, default=16, help="tasks, one episode each (default %(default)s)")
    parser.add_argument("--reasoning-tokens", type=int, default=64, help="thinking a turn (default %(default)s)")
    parser.add_argument("--width", type=int, default=16, help="answers after the call (default %(default)s)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    for name in ("episodes", "reasoning_tokens", "width"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    from ds_tree.bench.reasoning_trees import measure_templates

    try:
        rows = measure_templates(
            tuple(args.template or ("qwq", "qwen3")), args.episodes, args.reasoning_tokens, args.width
        )
    except ValueError as error:
        parser.error(str(error))
    print(markdown_table(rows))
    return 0
