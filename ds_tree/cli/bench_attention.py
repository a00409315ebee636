"""Time the CPU tree-attention engine alone on the packed rows of a data set, tree vs flat.

--data is what ds-tree bench takes. The first step's groups are packed in both modes; every row
gets random q/k/v (--heads x --head-dim, float32) and one forward + backward of the block-sparse
tree attention is timed per row: one attention layer's work for the whole step. The report gives
the minimum and the median (first repeat left out as warm-up) in milliseconds, and per mode the
visible (query, key) pairs and the scores the plan computes (masked-out ones included).
--hub-min-keys larger than any row turns hubs off. --engine flex times the FlexAttention engine
instead, forward only (it has no backward on the CPU; each mode's "timed" says so).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_tree.cli.choices import BLOCK, HUB_MIN_KEYS, HUB_MIN_QUERIES, cpu_attention_engines
from ds_tree.cli.common import POSITIVE_INT, check_not_input, check_output_path, command_parser
from ds_tree.data.jsonl import json_text
from ds_tree.errors import DataError


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--data", required=True, help="tokens JSONL file or converted dataset directory")
    parser.add_argument("--groups-per-step", type=POSITIVE_INT, default=None, help="default: every group")
    parser.add_argument("--budget", type=POSITIVE_INT, default=4096, help="tokens per packed row")
    parser.add_argument("--block", type=POSITIVE_INT, default=BLOCK, help="queries per block (default %(default)s)")
    parser.add_argument(
        "--hub-min-keys",
        type=int,
        default=HUB_MIN_KEYS,
        help="shortest shared run of keys computed as a hub (default %(default)s)",
    )
    parser.add_argument(
        "--hub-min-queries",
        type=int,
        default=HUB_MIN_QUERIES,
        help="fewest queries a hub must serve (default %(default)s)",
    )
    parser.add_argument(
        "--engine",
        choices=cpu_attention_engines(),
        default="torch",
        help="torch (block-sparse, forward+backward) or flex (FlexAttention, forward only: no backward on the CPU)",
    )
    parser.add_argument("--heads", type=POSITIVE_INT, default=4, help="attention heads (default %(default)s)")
    parser.add_argument("--head-dim", type=POSITIVE_INT, default=64, help="dimension of a head (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=8, help="timed calls per row, the first a warm-up (default 8)")
    parser.add_argument("--threads", type=POSITIVE_INT, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (the first is a warm-up for the median)")
    check_not_input(parser, "--json", args.json, [args.data])
    check_output_path(parser, args.json, "--json")
    import torch

    from ds_tree.bench.attention import time_attention
    from ds_tree.data import load_trajectories

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        trajectories = load_trajectories(args.data)
    except (DataError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    modes = time_attention(
        trajectories,
        groups_per_step=args.groups_per_step,
        budget=args.budget,
        block=args.block,
        hub_min_keys=args.hub_min_keys,
        hub_min_queries=args.hub_min_queries,
        heads=args.heads,
        head_dim=args.head_dim,
        repeats=args.repeats,
        engine=args.engine,
    )
    report = {
        "data": args.data,
        "engine": args.engine,
        "block": args.block,
        "hub_min_keys": args.hub_min_keys,
        "hub_min_queries": args.hub_min_queries,
        "threads": torch.get_num_threads(),
        "modes": modes,
        "command": " ".join([prog or "python tools/bench_attention.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    text = json_text(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0
