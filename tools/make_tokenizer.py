"""Train the project's byte-level BPE tokenizer and save it as a Hugging Face tokenizer directory.

Usage: python tools/make_tokenizer.py --output DIR [--vocab-size 1024]
The result loads offline with ``AutoTokenizer.from_pretrained(DIR)`` and is identical every run.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_tree.data.tokenizer import DEFAULT_VOCAB_SIZE, save_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, type=Path, help="directory to write the tokenizer into")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="exact vocabulary size")
    args = parser.parse_args(argv)
    try:
        save_tokenizer(args.output, args.vocab_size)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {args.vocab_size}-token tokenizer to {args.output}")


if __name__ == "__main__":
    main()
