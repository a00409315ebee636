"""Convert chat, tokens or explicit-tree records into a tree dataset (one row per tree).

Inputs: .jsonl or .jsonl.gz files (one record a line), .parquet files and Hugging Face datasets folders
(Dataset.save_to_disk; one record a row, its columns the fields, a null field left out), all streamed.
Formats:
  chat    {"group_id", "trial"?, "messages": [OpenAI messages], "tools"?, "reward"?}
  tokens  {"group_id", "input_ids", "loss_mask" | "labels", "reward"?, "trial"?, "logprobs"?, "advantages"?,
           "images"?, "image_index"?}   (processed images, with a processor folder: docs/DATA.md "Images")
  tree    {"group_id"?, "tools"?, "nodes": [{"id", "parent", "input_ids" | "messages", ...}]}
  preference  {"prompt"?, "chosen", "rejected", "tools"?, "group_id"?}
          (TRL's preference format, text or conversational: each record a tree of its prompt and two
          answers, chosen reward 1, rejected 0, trained on the answers; records sharing --group-key merge;
          the pairs objective.kind dpo trains, docs/RL.md "DPO")
The RL rollout fields logprobs and advantages (one entry per token) pass through the tokens and
tree formats; a chat record cannot carry them, since its tokens are known only after rendering.
--prefix-policy says what happens to a conversation whose chat template is not prefix-stable:
full keeps it with the unstable assistant turns untrained, drop skips it, error stops; either way
it is counted.

The summary goes to stdout as one JSON object and into ds_tree_meta.json. A bad line stops the run
with its file:line and reason (exit 2; --skip-bad skips and counts it instead), and nothing is
written at --output unless the whole run succeeds. --output may not be an input or hold one, and
--overwrite replaces only a dataset that convert wrote (never a folder holding anything else).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.cli.choices import CONVERT_DEFAULTS, CONVERT_FORMATS, MERGES, PREFIX_POLICIES
from ds_tree.cli.common import POSITIVE_INT, command_parser
from ds_tree.data.chat import TRAIN_ON
from ds_tree.data.jsonl import json_text
from ds_tree.errors import DataError


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    defaults = CONVERT_DEFAULTS
    parser.add_argument(
        "--input",
        required=True,
        nargs="+",
        type=Path,
        metavar="FILE",
        help=".jsonl, .jsonl.gz or .parquet files, or datasets folders (save_to_disk)",
    )
    parser.add_argument("--output", required=True, type=Path, metavar="DIR", help="dataset directory to create")
    parser.add_argument("--tokenizer", required=True, metavar="DIR", help="Hugging Face tokenizer directory")
    parser.add_argument(
        "--format", choices=CONVERT_FORMATS, default=defaults["format"], help="input format (default %(default)s)"
    )
    parser.add_argument(
        "--group-key", default=defaults["group_key"], help="record field naming a line's tree (default %(default)s)"
    )
    parser.add_argument(
        "--train-on",
        choices=TRAIN_ON,
        default=defaults["train_on"],
        help="chat: which assistant turns are trained (default %(default)s)",
    )
    parser.add_argument(
        "--merge",
        choices=MERGES,
        default=defaults["merge"],
        help="group: one tree per group; global: every trajectory in one tree (default %(default)s)",
    )
    parser.add_argument(
        "--prefix-policy",
        choices=PREFIX_POLICIES,
        default=defaults["prefix_policy"],
        help="chat templates that are not prefix-stable, see above (default %(default)s)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=POSITIVE_INT,
        default=defaults["max_image_pixels"],
        metavar="N",
        help="largest image (width x height) read from an image part; refused from its header, before decoding "
        "(default %(default)s: an 8K screenshot is 33 M)",
    )
    parser.add_argument("--skip-bad", action="store_true", help="skip malformed lines, counted by reason")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --output that a previous convert wrote (only such)",
    )
    parser.add_argument("--limit", type=int, default=None, help="read at most N records in total")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    marks = ("state.json", "dataset_dict.json")  # what Dataset / DatasetDict.save_to_disk write
    folders = [str(p) for p in args.input if p.is_dir() and not any((p / mark).is_file() for mark in marks)]
    if folders:
        parser.error(
            f"--input {', '.join(folders)}: is a directory but not a datasets folder (no state.json, which "
            "Dataset.save_to_disk writes); give the JSONL or Parquet files in it"
        )
    from ds_tree.data.convert import ConvertOptions, convert

    options = ConvertOptions(
        format=args.format,
        group_key=args.group_key,
        train_on=args.train_on,
        merge=args.merge,
        prefix_policy=args.prefix_policy,
        skip_bad=args.skip_bad,
        limit=args.limit,
        max_image_pixels=args.max_image_pixels,
    )
    try:
        summary = convert(args.input, args.output, args.tokenizer, options, overwrite=args.overwrite)
    except (DataError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # what the checks before the work could not foresee (a full disk, ...)
        print(f"error: {error.filename or args.output}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(json_text(summary))
    return 0
