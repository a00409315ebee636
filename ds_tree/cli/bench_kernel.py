"""Benchmark the Triton tree-attention kernel: one packed tree row against its flat equivalent.

A random forest (every root-to-leaf path has --depth nodes, inner nodes 1..--branching children,
node lengths uniform in [1, 2 * node-len - 1]) is timed as ds_tree/bench/kernel.py
describes. Without a GPU it runs the same measurement once under the Triton interpreter, as a
smoke test ("smoke": true in the report; the times are meaningless there), for example:

    ds-tree bench-kernel --trees 2 --depth 3 --branching 2 --node-len 8

--flex adds the flex engine (PyTorch's FlexAttention on the same mask) on both rows, as entries
flex_tree and flex_flat; each entry's "timed" says whether the backward was timed (on the CPU
FlexAttention has a forward only, so there it is "forward only").
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path

from ds_tree.cli.choices import KERNEL_DTYPES
from ds_tree.cli.common import NON_NEGATIVE_INT, POSITIVE_INT, check_output_path, command_parser
from ds_tree.data.jsonl import json_text

SMOKE = shutil.which("nvidia-smi") is None
"""No GPU: run under the Triton interpreter, chosen before torch or triton is imported (in main)."""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("--trees", type=POSITIVE_INT, default=8, help="trees in the row (default %(default)s)")
    parser.add_argument("--depth", type=POSITIVE_INT, default=4, help="nodes on every root-to-leaf path")
    parser.add_argument("--branching", type=POSITIVE_INT, default=3, help="most children of an inner node")
    parser.add_argument("--node-len", type=POSITIVE_INT, default=128, help="mean tokens per node")
    # The interpreter takes ~20 s per call at 32 heads of dim 128: smoke runs default smaller.
    parser.add_argument(
        "--heads", type=POSITIVE_INT, default=4 if SMOKE else 32, help="query heads (default %(default)s)"
    )
    parser.add_argument(
        "--kv-heads", type=POSITIVE_INT, default=2 if SMOKE else 8, help="key/value heads (default %(default)s)"
    )
    parser.add_argument(
        "--head-dim", type=POSITIVE_INT, default=64 if SMOKE else 128, help="dimension of a head (default %(default)s)"
    )
    parser.add_argument(
        "--dtype", choices=KERNEL_DTYPES, default="bfloat16", help="dtype of q, k, v (default %(default)s)"
    )
    parser.add_argument("--warmup-ms", type=NON_NEGATIVE_INT, default=25, help="do_bench warm-up time (GPU only)")
    parser.add_argument("--rep-ms", type=POSITIVE_INT, default=100, help="do_bench measuring time (GPU only)")
    parser.add_argument(
        "--flex",
        action="store_true",
        help="also time the flex engine on both rows (a GPU: forward+backward; the CPU: forward only, eager)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the forest and of q, k, v")
    parser.add_argument("--json", type=Path, help="also write the report here")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads} (grouped-query attention)")
    check_output_path(parser, args.json, "--json")
    if SMOKE:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from ds_tree.kernel.tile_lists import resolve_schedule

    try:  # $DS_TREE_TRITON_TILES, checked before the forest is built
        resolve_schedule()
    except ValueError as error:
        parser.error(str(error))

    from ds_tree.bench.kernel import benchmark_kernel
    from ds_tree.trees.random_trees import TreeShape, random_forest

    shape = TreeShape(
        trees=args.trees,
        depth=args.depth,
        children=(1, args.branching),
        node_tokens=(1, 2 * args.node_len - 1),
    )
    trajectories = random_forest(random.Random(args.seed), shape)
    torch.manual_seed(args.seed)
    results = {
        "smoke": SMOKE,
        "device": "cpu (triton interpreter)" if SMOKE else torch.cuda.get_device_name(),
        "config": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        **benchmark_kernel(
            trajectories,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=getattr(torch, args.dtype),
            smoke=SMOKE,
            warmup_ms=args.warmup_ms,
            rep_ms=args.rep_ms,
            flex=args.flex,
        ),
    }
    report = json_text(results, indent=2)
    print(report)
    if args.json:
        args.json.write_text(report + "\n")
    return 0
