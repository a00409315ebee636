#!/usr/bin/env python
"""Time the CPU tree-attention engine alone on the packed rows of a data set, tree vs flat.

    python tools/bench_attention.py --data PATH [--groups-per-step 2] [--block 128]
        [--hub-min-keys 64] [--hub-min-queries 128] [--repeats 8] [--json OUT]

PATH is what ``tools/bench.py`` takes. The first step's groups are packed in both modes (as a
training step would pack them); every row gets random q/k/v (``--heads`` x ``--head-dim``, float32)
and one forward + backward of ``blocksparse_tree_attention`` is timed per row: one attention
layer's work for the whole step. Both modes alternate within each repeat; the report gives the
minimum and the median (first repeat left out as warm-up) in milliseconds, and per mode the
visible (query, key) pairs and the scores the plan computes (masked-out ones included).
``--hub-min-keys`` larger than any row turns hubs off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ds_tree.attention.blocksparse import (  # noqa: E402
    DEFAULT_BLOCK,
    HUB_MIN_KEYS,
    HUB_MIN_QUERIES,
    block_plan,
    blocksparse_tree_attention,
)
from ds_tree.data import load_trajectories  # noqa: E402
from ds_tree.data.sampler import StepSampler, group_trajectories  # noqa: E402
from ds_tree.errors import DataError  # noqa: E402
from ds_tree.packing.modes import pack_trajectories  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--groups-per-step", type=int, default=None, help="default: every group")
    parser.add_argument("--budget", type=int, default=4096, help="tokens per packed row")
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="queries per block")
    parser.add_argument("--hub-min-keys", type=int, default=HUB_MIN_KEYS)
    parser.add_argument("--hub-min-queries", type=int, default=HUB_MIN_QUERIES)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (the first is a warm-up for the median)")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        trajectories = load_trajectories(args.data)
    except (DataError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    groups = group_trajectories(trajectories)
    per_step = args.groups_per_step or len(groups)
    batch = [t for g in StepSampler(len(groups), per_step, 0).groups_for_step(0) for t in groups[g]]

    generator = torch.Generator().manual_seed(0)
    inputs = {}
    for mode in ("flat", "tree"):
        inputs[mode] = []
        for row in pack_trajectories(batch, mode, args.budget, 1):
            kv_end = torch.as_tensor(row.kv_end)[None]
            shape = (1, args.heads, row.n_tokens, args.head_dim)
            qkv = [torch.randn(shape, generator=generator) for _ in range(3)]
            grad = torch.randn(1, row.n_tokens, args.heads, args.head_dim, generator=generator)
            inputs[mode].append((kv_end, qkv, grad))

    def attend(q, k, v, kv_end):
        return blocksparse_tree_attention(
            q, k, v, kv_end, block=args.block, hub_min_keys=args.hub_min_keys, hub_min_queries=args.hub_min_queries
        )

    def scores(kv_end):
        """Visible pairs, and scores the engine's plan computes (a task's queries x its keys)."""
        kv_end = kv_end[0].numpy()
        plan = block_plan(kv_end, args.block, args.hub_min_keys, args.hub_min_queries)
        computed = 0
        for task in (*plan.tasks, *plan.hubs):
            keys = task.keys.stop - task.keys.start if isinstance(task.keys, slice) else task.keys.size
            computed += (task.query.stop - task.query.start) * keys
        return int((kv_end - np.arange(kv_end.size)).sum()), computed

    times = {mode: [] for mode in inputs}
    for _ in range(args.repeats):
        for mode, rows in inputs.items():
            elapsed = 0.0
            for kv_end, qkv, grad in rows:
                q, k, v = (x.clone().requires_grad_() for x in qkv)
                started = time.perf_counter()
                attend(q, k, v, kv_end).backward(grad)
                elapsed += time.perf_counter() - started
            times[mode].append(elapsed * 1e3)
    report = {
        "data": args.data,
        "block": args.block,
        "hub_min_keys": args.hub_min_keys,
        "hub_min_queries": args.hub_min_queries,
        "threads": torch.get_num_threads(),
        "modes": {
            mode: {
                "rows": len(inputs[mode]),
                "tokens": sum(kv_end.shape[1] for kv_end, _, _ in inputs[mode]),
                "min_ms": min(ms),
                "median_ms": statistics.median(ms[1:]),
                "visible_pairs": sum(scores(kv_end)[0] for kv_end, _, _ in inputs[mode]),
                "computed_scores": sum(scores(kv_end)[1] for kv_end, _, _ in inputs[mode]),
            }
            for mode, ms in times.items()
        },
        "command": "python tools/bench_attention.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
