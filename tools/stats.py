"""Tree statistics of a tokens JSONL file or a converted tree dataset directory.

Usage: python tools/stats.py PATH [--json] [--plot FILE.png]

Trees are merged by group. Prints counts, flat and tree tokens, POR = 1 - tree/flat, the ideal
speedup flat/tree (what computing every distinct token once saves at most), depth (nodes on a
root-to-leaf path) and branching (children per internal node) summaries, and the distribution of
per-tree ideal speedups. --json prints the same as one JSON object; --plot writes histograms.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from ds_tree.data import load_trajectories  # noqa: E402
from ds_tree.errors import DataError  # noqa: E402
from ds_tree.trees import TokenTree, build_forest  # noqa: E402


def _summary(values: np.ndarray) -> dict:
    return {
        "min": float(values.min()),
        "mean": float(values.mean()),
        "p50": float(np.percentile(values, 50)),
        "p90": float(np.percentile(values, 90)),
        "max": float(values.max()),
    }


def tree_arrays(trees: list[TokenTree]) -> dict[str, np.ndarray]:
    """Per-path depths, per-internal-node child counts and per-tree ideal speedups."""
    depths, branching = [], []
    for tree in trees:
        depths.append(tree.node_depths()[tree.end_node])
        children = tree.num_children()
        branching.append(children[children > 0])
    return {
        "depth": np.concatenate(depths),
        "branching": np.concatenate(branching) if branching else np.zeros(0, dtype=np.int64),
        "tree_speedup": np.array([tree.flat_tokens / tree.n_tokens for tree in trees]),
    }


def tree_stats(trees: list[TokenTree]) -> dict:
    """All statistics as a JSON-ready dict."""
    flat = sum(tree.flat_tokens for tree in trees)
    tree_tokens = sum(tree.n_tokens for tree in trees)
    arrays = tree_arrays(trees)
    branching = arrays["branching"]
    return {
        "n_groups": len({trajectory.group_id for tree in trees for trajectory in tree.trajectories}),
        "n_trees": len(trees),
        "n_trajectories": sum(len(tree.trajectories) for tree in trees),
        "flat_tokens": flat,
        "tree_tokens": tree_tokens,
        "por": 1.0 - tree_tokens / flat,
        "ideal_speedup": flat / tree_tokens,
        "depth": _summary(arrays["depth"]),
        # A forest of single paths has no internal node: no branching to summarise.
        "branching": {"mean": float(branching.mean()), "max": int(branching.max())} if branching.size else None,
        "tree_speedup": _summary(arrays["tree_speedup"]),
    }


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
    figure.tight_layout()
    figure.savefig(path, dpi=100)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="tokens JSONL(.gz) file or tree dataset directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, default=None, help="write depth/branching/speedup histograms (PNG)")
    args = parser.parse_args(argv)
    try:
        trees = build_forest(load_trajectories(args.path), merge="group")
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    stats = tree_stats(trees)
    if args.json:
        print(json.dumps(stats))
    else:
        print_text(stats)
    if args.plot is not None:
        plot(trees, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
