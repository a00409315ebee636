"""Train the project's byte-level BPE tokenizer and save it as a Hugging Face tokenizer directory.

The result loads offline with transformers' AutoTokenizer.from_pretrained(DIR) and is identical
every run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.cli.choices import TOKENIZER_VOCAB_SIZE
from ds_tree.cli.common import command_parser
from ds_tree.data.chat_templates import TEMPLATES


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--output", required=True, type=Path, metavar="DIR", help="directory to write the tokenizer into"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=TOKENIZER_VOCAB_SIZE, help="exact vocabulary size (default %(default)s)"
    )
    parser.add_argument(
        "--chat-format",
        default="hermes",
        choices=sorted(TEMPLATES),
        help="the chat template and its family's special tokens (default %(default)s, the project's ChatML): "
        + "; ".join(f"{name}: {template.description}" for name, template in sorted(TEMPLATES.items())),
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    from ds_tree.data.tokenizer import save_tokenizer

    try:
        save_tokenizer(args.output, args.vocab_size, args.chat_format)
    except FileExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {args.vocab_size}-token tokenizer ({args.chat_format} chat format) to {args.output}")
    return 0
