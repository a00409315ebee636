"""Reward curves of online RL runs, and their sampling cost, from each run's ``metrics.jsonl``.

Usage: ds-tree plot-online LABEL=RUN_DIR [LABEL=RUN_DIR ...] --output FILE.png [--window N]

Plots ``rollout/reward_mean`` per step for every run (thin) with its running mean over ``--window``
steps (thick), and prints a Markdown table: steps, reward of the first and last ``--window`` steps,
and the tokens the sampler drew and ran through the model (``rollout/sampled_tokens``,
``rollout/forward_tokens``, summed over the run). A run directory without ``metrics.jsonl`` or
without ``rollout/`` metrics exits 2 naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def read_run(directory: Path) -> dict[str, np.ndarray]:
    """Per-step rollout metrics of one run, in step order."""
    path = directory / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records or "rollout/reward_mean" not in records[0]:
        raise ValueError(f"{path}: no rollout/ metrics (not an online RL run)")
    records.sort(key=lambda record: record["step"])
    names = ("step", "rollout/reward_mean", "rollout/sampled_tokens", "rollout/forward_tokens")
    return {name: np.array([record[name] for record in records], dtype=np.float64) for name in names}


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean over the last ``window`` values at each step (fewer at the start)."""
    sums = np.cumsum(np.r_[0.0, values])
    ends = np.arange(1, values.size + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def table(runs: dict[str, dict[str, np.ndarray]], window: int) -> str:
    columns = ["run", "steps", f"reward, first {window} steps", f"reward, last {window} steps"]
    columns += ["sampled tokens", "forward tokens"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for label, run in runs.items():
        reward = run["rollout/reward_mean"]
        lines.append(
            f"| {label} | {reward.size} | {reward[:window].mean():.3f} | {reward[-window:].mean():.3f} | "
            f"{run['rollout/sampled_tokens'].sum():.0f} | {run['rollout/forward_tokens'].sum():.0f} |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, np.ndarray]], window: int, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for index, (label, run) in enumerate(runs.items()):
        color = f"C{index}"
        tokens = run["rollout/forward_tokens"].sum()
        axes.plot(run["step"], run["rollout/reward_mean"], color=color, alpha=0.3, linewidth=1)
        axes.plot(
            run["step"],
            running_mean(run["rollout/reward_mean"], window),
            color=color,
            linewidth=2.5,
            label=f"{label} ({tokens:.0f} sampler forward tokens)",
        )
    axes.set_xlabel("training step")
    axes.set_ylabel(f"mean reward (thin: per step; thick: mean of {window})")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left")
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR", help="a label and an online RL run's output_dir")
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--window", type=int, default=10, help="steps of the running mean and of the table's columns")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error("--window must be >= 1")
    runs = {}
    for item in args.runs:
        label, separator, directory = item.partition("=")
        if not separator or not label or not directory:
            parser.error(f"{item!r} is not LABEL=RUN_DIR")
        try:
            runs[label] = read_run(Path(directory))
        except ValueError as error:
            print(f"ds-tree plot-online: error: {error}", file=sys.stderr)
            return 2
    plot(runs, args.window, args.output)
    print(table(runs, args.window))
    print(f"wrote {args.output}")
    return 0
