"""Multi-turn preference pairs that share long histories, from chat trials, for ``ds-tree bench --objective dpo``.

    python tools/history_pairs.py --trials ../shared/data/tau2-telecom/trials.jsonl --output pairs.jsonl \
        [--pairs 3] [--max-message-chars N]

Writes TRL preference records (conversational, explicit prompt, with the trial's group_id) at --pairs
assistant turns of every group's first trial, each message cut to its first N characters with
--max-message-chars (ds_tree/bench/preference_pairs.py), and prints the counts as one JSON object. Then
``ds-tree convert --format preference --group-key group_id`` makes one tree per conversation
(docs/RL.md, "Timing distill and dpo steps"). A bad record stops it with ``error: file:line ...``, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.cli.common import POSITIVE_INT, check_output_file, command_parser
from ds_tree.data.jsonl import json_text
from ds_tree.errors import DataError


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--trials", required=True, type=Path, help="chat JSONL: {group_id, messages, ...} a line")
    parser.add_argument("--output", required=True, type=Path, help="preference JSONL to write")
    parser.add_argument("--pairs", type=POSITIVE_INT, default=3, help="pairs per conversation (default %(default)s)")
    parser.add_argument(
        "--max-message-chars", type=POSITIVE_INT, default=None, metavar="N", help="cut each message's text to N"
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    check_output_file(parser, args.output, [args.trials])
    from ds_tree.bench.preference_pairs import write_history_pairs

    try:
        counts = write_history_pairs(args.trials, args.output, args.pairs, args.max_message_chars)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json_text(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
