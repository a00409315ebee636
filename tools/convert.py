"""Convert chat, tokens or explicit-tree JSONL into a tree dataset (one row per tree).

Usage:
  python tools/convert.py --input FILE [FILE ...] --output DIR --tokenizer DIR
      [--format chat|tokens|tree] [--group-key group_id] [--train-on assistant|last_assistant|all]
      [--merge group|global] [--prefix-policy full|drop|error] [--skip-bad] [--overwrite] [--limit N]

Formats (inputs .jsonl or .jsonl.gz, one record a line):
  chat    {"group_id", "trial"?, "messages": [OpenAI messages], "tools"?, "reward"?}
  tokens  {"group_id", "input_ids", "loss_mask" | "labels", "reward"?, "trial"?}
  tree    {"group_id"?, "tools"?, "nodes": [{"id", "parent", "input_ids" | "messages", ...}]}
A bad line stops the run with its file:line and reason; --skip-bad skips it and counts it by
reason instead. --prefix-policy says what happens to a conversation whose chat template is not
prefix-stable: "full" keeps it with the unstable assistant turns untrained, "drop" skips it,
"error" stops; either way it is counted. The summary goes to stdout as one JSON object and into
ds_tree_meta.json. Nothing is written at --output unless the whole run succeeds.
"""

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from ds_tree.data.chat import TRAIN_ON, render_chat  # noqa: E402
from ds_tree.data.jsonl import read_jsonl  # noqa: E402
from ds_tree.data.tokenizer import tokenizer_identity  # noqa: E402
from ds_tree.data.tokens import trajectory_from_record  # noqa: E402
from ds_tree.data.tree_dataset import check_output_dir, save_tree_dataset  # noqa: E402
from ds_tree.errors import DataError, RecordError  # noqa: E402
from ds_tree.trees.explicit import trajectories_from_explicit_tree  # noqa: E402
from ds_tree.trees.trajectory import Trajectory, check_vocab  # noqa: E402

GLOBAL_GROUP = "all"
"""The group id every trajectory gets with --merge global."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, nargs="+", type=Path, help=".jsonl or .jsonl.gz files")
    parser.add_argument("--output", required=True, type=Path, help="dataset directory to create")
    parser.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer directory")
    parser.add_argument("--format", choices=("chat", "tokens", "tree"), default="chat")
    parser.add_argument("--group-key", default="group_id", help="record field naming the tree a line belongs to")
    parser.add_argument("--train-on", choices=TRAIN_ON, default="assistant")
    parser.add_argument("--merge", choices=("group", "global"), default="group")
    parser.add_argument("--prefix-policy", choices=("full", "drop", "error"), default="full")
    parser.add_argument("--skip-bad", action="store_true", help="skip malformed lines, counted by reason")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --output")
    parser.add_argument("--limit", type=int, default=None, help="read at most N records in total")
    return parser.parse_args(argv)


def read_records(paths: list[Path], limit: int | None) -> Iterator[tuple[str, dict | DataError]]:
    """``(file:line, record)`` over all inputs, at most ``limit`` records; bad lines come as
    errors in place of records so that ``--skip-bad`` can go on past them."""
    count = 0
    for path in paths:
        for where, record in read_jsonl(path, keep_going=True):
            if limit is not None and count >= limit:
                return
            count += 1
            yield where, record


class Converter:
    """Turns records of one format into trajectories and keeps the counts for the summary."""

    def __init__(self, args: argparse.Namespace, tokenizer) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.prefix_unstable = 0  # trajectories kept with unstable turns untrained (policy "full")

    def group_id(self, where: str, record: dict, default: str | None = None) -> str:
        value = record.get(self.args.group_key, default)
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise RecordError("bad_group_id", f"{where}: field {self.args.group_key!r} must be a string")
        return str(value)

    def render(self, where: str, messages: object, tools: object) -> tuple[np.ndarray, np.ndarray]:
        rendered = render_chat(self.tokenizer, messages, tools, where=where, train_on=self.args.train_on)
        if rendered.unstable_turns:
            message = f"{where}: the chat template is not prefix-stable for {rendered.unstable_turns} assistant turn(s)"
            if self.args.prefix_policy != "full":
                raise RecordError("prefix_unstable", message)
            self.prefix_unstable += 1
        return rendered.input_ids, rendered.loss_mask

    def trajectories(self, where: str, record: dict) -> list[Trajectory]:
        form = self.args.format
        if form == "tree":
            group = self.group_id(where, record, default=where)  # a tree line is a group by itself

            def tokenize(messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
                return self.render(where, messages, record.get("tools"))

            trajectories = trajectories_from_explicit_tree(record, where, tokenize)
            for trajectory in trajectories:
                trajectory.group_id = group
            return trajectories
        group = self.group_id(where, record)
        if form == "chat":
            input_ids, loss_mask = self.render(where, record.get("messages"), record.get("tools"))
            # Reuse the tokens reader's field checks (reward, trial) on the rendered record.
            record = {**record, "input_ids": input_ids.tolist(), "loss_mask": loss_mask.tolist()}
        trajectory = trajectory_from_record(where, {**record, "group_id": group})
        return [trajectory]


def convert(args: argparse.Namespace) -> dict:
    """Run the conversion; returns the summary (also written as the dataset's meta file)."""
    from transformers import AutoTokenizer

    output = args.output
    check_output_dir(output, args.overwrite)  # fail before the work, not after
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    converter = Converter(args, tokenizer)
    trajectories: list[Trajectory] = []
    skipped: Counter[str] = Counter()
    lines = 0
    progress = tqdm(read_records(args.input, args.limit), unit=" lines", file=sys.stderr, delay=2.0)
    for where, record in progress:
        lines += 1
        try:
            if isinstance(record, DataError):
                raise record
            trajectories.extend(converter.trajectories(where, record))
        except DataError as error:
            reason = getattr(error, "reason", "bad_record")
            dropped_by_policy = reason == "prefix_unstable" and args.prefix_policy == "drop"
            if not (args.skip_bad or dropped_by_policy):
                raise
            skipped[reason] += 1
    if args.merge == "global":
        for trajectory in trajectories:
            trajectory.group_id = GLOBAL_GROUP
    check_vocab(trajectories, len(tokenizer))
    meta = {
        "tokenizer": tokenizer_identity(tokenizer),
        "inputs": [str(path) for path in args.input],
        "options": {
            "format": args.format,
            "group_key": args.group_key,
            "train_on": args.train_on,
            "merge": args.merge,
            "prefix_policy": args.prefix_policy,
            "limit": args.limit,
        },
        "lines": lines,
        "skipped": dict(sorted(skipped.items())),
        "prefix_unstable_kept": converter.prefix_unstable,
    }
    meta = save_tree_dataset(trajectories, output, meta, overwrite=args.overwrite)
    counts = meta["counts"]
    return {"output": str(output), **meta, "por": 1.0 - counts["tree_tokens"] / counts["flat_tokens"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = convert(args)
    except (DataError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
