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
from ds_tree.data.chat_templates import TEMPLATES

VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
"""The vision-language model families (their specs' ``vision``, ds_tree/models/families), copied so that
``--help`` needs no torch; tests/test_vision.py checks the copy."""


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
    parser.add_argument(
        "--vision",
        choices=sorted(VISION_FAMILIES),
        default=None,
        help="write a processor folder for this vision-language family (image tokens, its own chat template, "
        "image processor); not with --chat-format",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.vision and args.chat_format != "hermes":
        parser.error("--vision writes the family's own chat template: leave out --chat-format")
    from ds_tree.data.tokenizer import save_tokenizer
    from ds_tree.data.vision_processor import save_vision_processor

    try:
        if args.vision:
            save_vision_processor(args.output, args.vision, args.vocab_size)
        else:
            save_tokenizer(args.output, args.vocab_size, args.chat_format)
    except FileExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        parser.error(str(error))
    what = f"{args.vision} image tokens and image processor" if args.vision else f"{args.chat_format} chat format"
    print(f"wrote {args.vocab_size}-token tokenizer ({what}) to {args.output}")
    return 0
