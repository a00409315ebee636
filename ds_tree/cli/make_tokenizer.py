"""Train the project's byte-level BPE tokenizer and save it as a Hugging Face tokenizer directory.

Usage: ds-tree make-tokenizer --output DIR [--vocab-size 1024]
The result loads offline with ``AutoTokenizer.from_pretrained(DIR)`` and is identical every run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.data.tokenizer import DEFAULT_VOCAB_SIZE, save_tokenizer


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", required=True, type=Path, help="directory to write the tokenizer into")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="exact vocabulary size")
    args = parser.parse_args(argv)
    try:
        save_tokenizer(args.output, args.vocab_size)
    except FileExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {args.vocab_size}-token tokenizer to {args.output}")
    return 0
