"""Train the project's byte-level BPE tokenizer and save it as a Hugging Face tokenizer directory.

The result loads offline with transformers' AutoTokenizer.from_pretrained(DIR) and is identical
every run. With --vision FAMILY the folder is a processor folder: the tokenizer plus the family's
image tokens and chat template, and its image processor config (ds_tree/data/vision_processor.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.cli.choices import TOKENIZER_VOCAB_SIZE
from ds_tree.cli.common import command_parser

VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument(
        "--output", required=True, type=Path, metavar="DIR", help="directory to write the tokenizer into"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=TOKENIZER_VOCAB_SIZE, help="exact vocabulary size (default %(default)s)"
    )
    parser.add_argument(
        "--vision",
        choices=sorted(VISION_FAMILIES),
        default=None,
        help="write a processor folder for this vision-language family (image tokens, template, image processor)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    from ds_tree.data.tokenizer import save_tokenizer
    from ds_tree.data.vision_processor import save_vision_processor

    try:
        if args.vision:
            save_vision_processor(args.output, args.vision, args.vocab_size)
        else:
            save_tokenizer(args.output, args.vocab_size)
    except FileExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        parser.error(str(error))
    extra = f" with {args.vision} image tokens and image processor" if args.vision else ""
    print(f"wrote {args.vocab_size}-token tokenizer{extra} to {args.output}")
    return 0
