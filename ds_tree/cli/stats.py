"""Tree statistics of a tokens JSONL file or a converted tree dataset directory.

Trees are merged by group. Prints counts, flat and tree tokens, POR = 1 - tree/flat, the ideal
speedup flat/tree (what computing every distinct token once saves at most), depth (nodes on a
root-to-leaf path) and branching (children per internal node) summaries, and the distribution of
per-tree ideal speedups. --json prints the same as one JSON object; --plot writes histograms to
the file named (PNG). Unreadable input exits 2 with one error line naming the path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ds_tree.cli.common import check_not_input, check_output_path, command_parser
from ds_tree.data import load_trajectories
from ds_tree.data.jsonl import json_text
from ds_tree.errors import DataError
from ds_tree.reports.figures import save_figure
from ds_tree.trees import TokenTree, build_forest
from ds_tree.trees.stats import tree_arrays, tree_stats


def plot(trees: list[TokenTree], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    arrays = tree_arrays(trees)
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("depth", "nodes per root-to-leaf path", "paths"),
        ("branching", "children per internal node", "internal nodes"),
        ("tree_speedup", "ideal speedup per tree (flat / tree tokens)", "trees"),
    )
    for axis, (key, xlabel, ylabel) in zip(axes, panels, strict=True):
        values = arrays[key]
        integer = key != "tree_speedup"
        bins = np.arange(values.min(), values.max() + 2) - 0.5 if integer and values.size else 30
        axis.hist(values, bins=bins)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
    save_figure(figure, path, dpi=100)
    plt.close(figure)


def print_text(stats: dict) -> None:
    print(f"groups {stats['n_groups']}  trees {stats['n_trees']}  trajectories {stats['n_trajectories']}")
    print(f"flat tokens {stats['flat_tokens']}  tree tokens {stats['tree_tokens']}")
    print(f"POR {stats['por']:.4f}  ideal speedup {stats['ideal_speedup']:.2f}x")
    depth = stats["depth"]
    print(f"depth (nodes per path): min {depth['min']:.0f}  mean {depth['mean']:.2f}  max {depth['max']:.0f}")
    branching = stats["branching"]
    if branching is None:
        print("branching: none (every tree is a single path)")
    else:
        print(f"branching (children per internal node): mean {branching['mean']:.2f}  max {branching['max']}")
    speedup = stats["tree_speedup"]
    print(
        "per-tree ideal speedup: "
        + "  ".join(f"{key} {speedup[key]:.2f}" for key in ("min", "p50", "mean", "p90", "max"))
    )
    images = stats.get("images")
    if images:
        print(
            f"images encoded flat {images['images_flat']}  tree {images['images_tree']}  (vision patches "
            f"{images['patches_flat']} / {images['patches_tree']}: {images['patches_saved']:.4f} saved)"
        )


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(prog, __doc__)
    parser.add_argument("path", type=Path, help="tokens JSONL(.gz) file or tree dataset directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help="write depth/branching/speedup histograms to FILE (PNG, or the format its extension names: pdf, svg)",
    )
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    check_output_path(parser, args.plot, "--plot")
    check_not_input(parser, "--plot", args.plot, [args.path])
    try:
        trees = build_forest(load_trajectories(args.path), merge="group")
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stats = tree_stats(trees)
    if args.json:
        print(json_text(stats))
    else:
        print_text(stats)
    if args.plot is not None:
        plot(trees, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
