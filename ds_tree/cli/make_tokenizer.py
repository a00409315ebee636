"""Train the project's byte-level BPE tokenizer and save it as a Hugging Face tokenizer directory.

The result loads offline with transformers' AutoTokenizer.from_pretrained(DIR) and is identical
every run. With --vision FAMILY the folder is a processor folder: the tokenizer plus the family's
image tokens and chat template, and its image processor config (ds_tree/vocab/vision_processor.py).

An existing --output is replaced only with --overwrite, and only when make-tokenizer wrote it (it holds
the ds_tree_tokenizer.json this command writes and nothing but a tokenizer or processor folder's files):
never a model, a dataset, another tokenizer or the current directory. The folder is written beside the
output and moved into place when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ds_tree.atomic import remove, replace_directory
from ds_tree.cli.choices import TOKENIZER_VOCAB_SIZE
from ds_tree.cli.common import command_parser, output_folder_problem
from ds_tree.vocab.chat_templates import TEMPLATES

VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
"""The vision-language model families (their specs' ``vision``, ds_tree/models/families), copied so that
``--help`` needs no torch; tests/test_vision.py checks the copy."""
MARKER = "ds_tree_tokenizer.json"
"""Written into every folder make-tokenizer makes (what it built): ``--overwrite`` replaces only such a folder."""
WRITTEN = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "ds_tree_vision.json",
    MARKER,
}
"""The files of a folder make-tokenizer writes (a processor folder's included)."""


def made_by_make_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds :data:`MARKER` and nothing but the files make-tokenizer writes (no folder, no link)."""
    items = list(folder.iterdir())
    return any(item.name == MARKER for item in items) and all(
        item.name in WRITTEN and item.is_file() and not item.is_symlink() for item in items
    )


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
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --output that make-tokenizer wrote (only such)"
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.vision and args.chat_format != "hermes":
        parser.error("--vision writes the family's own chat template: leave out --chat-format")
    problem = output_folder_problem(args.output, made_by_make_tokenizer, "make-tokenizer", args.overwrite)
    here = Path.cwd().resolve()
    if not problem and (args.output.resolve() == here or args.output.resolve() in here.parents):
        problem = f"{args.output}: is the current directory or holds it, which the folder would replace; name a new one"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        write_folder(args)
    except OSError as error:  # what the checks before the work could not foresee (a full disk, ...)
        print(f"error: {error.filename or args.output}: {error.strerror or error}", file=sys.stderr)
        return 2
    except ValueError as error:
        parser.error(str(error))
    what = f"{args.vision} image tokens and image processor" if args.vision else f"{args.chat_format} chat format"
    print(f"wrote {args.vocab_size}-token tokenizer ({what}) to {args.output}")
    return 0


def write_folder(args: argparse.Namespace) -> None:
    """The tokenizer (or processor) folder built in a temporary sibling of ``--output``, then moved into place
    (:func:`~ds_tree.atomic.replace_directory`): a failure leaves the previous folder as it was."""
    from ds_tree.vocab.tokenizer import save_tokenizer
    from ds_tree.vocab.vision_processor import save_vision_processor

    target = args.output.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f".{target.name}.partial-{os.getpid()}"
    remove(temporary)
    try:
        if args.vision:
            save_vision_processor(temporary, args.vision, args.vocab_size)
        else:
            save_tokenizer(temporary, args.vocab_size, args.chat_format)
        built = {"vocab_size": args.vocab_size, "chat_format": None if args.vision else args.chat_format}
        (temporary / MARKER).write_text(json.dumps({**built, "vision": args.vision}, indent=2) + "\n")
        replace_directory(temporary, target)
    finally:
        remove(temporary)
