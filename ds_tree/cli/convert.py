"""Convert chat, tokens or explicit-tree JSONL into a tree dataset (one row per tree).

Usage:
  ds-tree convert --input FILE [FILE ...] --output DIR --tokenizer DIR
      [--format chat|tokens|tree] [--group-key group_id] [--train-on assistant|last_assistant|all]
      [--merge group|global] [--prefix-policy full|drop|error] [--skip-bad] [--overwrite] [--limit N]

The summary goes to stdout as one JSON object and into ds_tree_meta.json. Bad input exits 2
with one error line naming where it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.data import convert as library
from ds_tree.data.chat import TRAIN_ON
from ds_tree.data.convert import FORMATS, MERGES, PREFIX_POLICIES, ConvertOptions, convert
from ds_tree.data.jsonl import json_text
from ds_tree.errors import DataError


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, epilog=library.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = ConvertOptions()
    parser.add_argument("--input", required=True, nargs="+", type=Path, help=".jsonl or .jsonl.gz files")
    parser.add_argument("--output", required=True, type=Path, help="dataset directory to create")
    parser.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    parser.add_argument("--format", choices=FORMATS, default=defaults.format)
    parser.add_argument("--group-key", default=defaults.group_key, help="record field naming a line's tree")
    parser.add_argument("--train-on", choices=TRAIN_ON, default=defaults.train_on)
    parser.add_argument("--merge", choices=MERGES, default=defaults.merge)
    parser.add_argument("--prefix-policy", choices=PREFIX_POLICIES, default=defaults.prefix_policy)
    parser.add_argument("--skip-bad", action="store_true", help="skip malformed lines, counted by reason")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --output")
    parser.add_argument("--limit", type=int, default=None, help="read at most N records in total")
    args = parser.parse_args(argv)
    options = ConvertOptions(
        format=args.format,
        group_key=args.group_key,
        train_on=args.train_on,
        merge=args.merge,
        prefix_policy=args.prefix_policy,
        skip_bad=args.skip_bad,
        limit=args.limit,
    )
    try:
        summary = convert(args.input, args.output, args.tokenizer, options, overwrite=args.overwrite)
    except (DataError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json_text(summary))
    return 0
