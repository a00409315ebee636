"""Online RL runs read back and drawn (``ds-tree plot-online``): reward curves against steps and against the
tokens the sampler ran, seeds averaged, and a Markdown table of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ds_tree.reports.figures import save_figure
from ds_tree.reports.records import check_numbers, metrics_records

METRICS = ("step", "rollout/reward_mean", "rollout/sampled_tokens", "rollout/forward_tokens")
"""What each record of a run's metrics.jsonl must carry."""
EVAL = "eval/reward_mean"
"""An evaluation's reward on held-out prompts (the records of evaluated steps carry it)."""


def read_run(directory: Path) -> dict[str, np.ndarray]:
    """Per-step rollout metrics of one run, in step order; a ValueError names the file, line and field."""
    path = directory / "metrics.jsonl"
    records, evaluations = [], []
    for number, record in metrics_records(path):
        if EVAL in record:  # an evaluated step (a warm-up one too)
            check_numbers(f"{path}:{number}", record, ("step", EVAL))
            evaluations.append((record["step"], record[EVAL]))
        if "warmup/sft_loss" in record:  # a step of rollout.env.warmup_steps: SFT, nothing sampled
            continue
        if not records and "rollout/reward_mean" not in record:
            raise ValueError(f"{path}: no rollout/ metrics (not an online RL run)")
        check_numbers(f"{path}:{number}", record, METRICS)
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no rollout/ metrics (not an online RL run)")
    records.sort(key=lambda record: record["step"])
    run = {name: np.array([record[name] for record in records], dtype=np.float64) for name in METRICS}
    if evaluations:
        evaluations.sort()
        run["eval_step"] = np.array([step for step, _ in evaluations], dtype=np.float64)
        run[EVAL] = np.array([value for _, value in evaluations], dtype=np.float64)
    return run


def average_runs(runs: list[dict[str, np.ndarray]], label: str) -> dict[str, np.ndarray]:
    """Step-by-step mean of runs with the same steps."""
    if any(not np.array_equal(run["step"], runs[0]["step"]) for run in runs):
        raise ValueError(f"{label}: the runs do not have the same steps")
    if any(not np.array_equal(run.get("eval_step", []), runs[0].get("eval_step", [])) for run in runs):
        raise ValueError(f"{label}: the runs do not evaluate (eval/reward_mean) at the same steps")
    return {name: np.mean([run[name] for run in runs], axis=0) for name in runs[0]} | {"runs": np.array(len(runs))}


def running_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean over the last ``window`` values at each step (fewer at the start)."""
    sums = np.cumsum(np.r_[0.0, values])
    ends = np.arange(1, values.size + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def table(runs: dict[str, dict[str, np.ndarray]], window: int) -> str:
    columns = ["sampler", "runs", "steps", f"reward, first {window} steps", f"reward, last {window} steps"]
    columns += ["sampled tokens", "forward tokens"]
    evaluated = any(EVAL in run for run in runs.values())
    if evaluated:
        columns += ["eval reward, first", "eval reward, last"]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for label, run in runs.items():
        reward = run["rollout/reward_mean"]
        line = (
            f"| {label} | {run['runs']} | {reward.size} | {reward[:window].mean():.3f} | "
            f"{reward[-window:].mean():.3f} | "
            f"{run['rollout/sampled_tokens'].sum():.0f} | {run['rollout/forward_tokens'].sum():.0f} |"
        )
        if evaluated:
            line += f" {evaluation(run, 0)} | {evaluation(run, -1)} |"
        lines.append(line)
    return "\n".join(lines)


def evaluation(run: dict[str, np.ndarray], index: int) -> str:
    """A table cell: the ``index``-th evaluation's reward and its step (empty for a run without any)."""
    if EVAL not in run:
        return ""
    return f"{run[EVAL][index]:.3f} (step {run['eval_step'][index]:.0f})"


def plot(runs: dict[str, dict[str, np.ndarray]], window: int, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for index, (label, run) in enumerate(runs.items()):
        color = f"C{index}"
        reward, smooth = run["rollout/reward_mean"], running_mean(run["rollout/reward_mean"], window)
        tokens = np.cumsum(run["rollout/forward_tokens"])
        name = f"{label} ({run['runs']} run{'s' if run['runs'] > 1 else ''})"
        for axis, x in ((by_step, run["step"]), (by_tokens, tokens)):
            axis.plot(x, reward, color=color, alpha=0.3, linewidth=1)
            axis.plot(x, smooth, color=color, linewidth=2.5, label=name)
        if EVAL in run:  # at the tokens sampled for training up to each evaluated step
            before = np.searchsorted(run["step"], run["eval_step"], side="right") - 1
            at_tokens = np.where(before >= 0, tokens[np.maximum(before, 0)], 0.0)
            for axis, x in ((by_step, run["eval_step"]), (by_tokens, at_tokens)):
                axis.plot(x, run[EVAL], color=color, linestyle="--", marker="o", label=f"{label}: held-out eval")
    by_step.set_xlabel("training step")
    by_tokens.set_xlabel("tokens the sampler ran through the model (cumulative)")
    by_step.set_ylabel(f"mean reward (thin: per step; thick: mean of {window} steps)")
    for axis in (by_step, by_tokens):
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(loc="upper left")
    save_figure(figure, output, dpi=110)
    plt.close(figure)
