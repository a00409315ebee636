"""A multi-turn RL run read back and drawn (``ds-tree plot-multiturn``): its learning curve, the sampler's tree
reuse, and the figures the docs quote."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ds_tree.reports.figures import save_figure
from ds_tree.reports.records import check_numbers, metrics_records

RL_METRICS = (
    "step",
    "rollout/reward_mean",
    "rollout/sampled_tokens",
    "rollout/tokens_saved",
    "tree/por",
    "rollout/parse_errors",
    "rollout/env_errors",
    "time/step_s",
)
"""What an RL step's record (one with rollout/reward_mean) must carry."""
SFT_METRICS = ("step", "warmup/sft_loss", "time/step_s")
"""What a warm-up or refresh step's record (one with warmup/sft_loss) must carry."""
EVAL_METRICS = ("step", "eval/reward_mean", "eval/pass@1")
"""What an evaluated step's record (one with eval/reward_mean) must carry besides its step's own."""


def read_metrics(run: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """The warm-up, RL and refresh records of ``run``'s metrics.jsonl, each in step order; a
    ValueError names the file and line (or the file, when it has no RL step)."""
    path = run / "metrics.jsonl"
    rl, sft = [], []
    for number, record in metrics_records(path):
        if "rollout/reward_mean" in record:
            names, kept = RL_METRICS, rl
        elif "warmup/sft_loss" in record:
            names, kept = SFT_METRICS, sft
        else:  # a step that logged neither (a discarded step): only its step is checked
            names, kept = ("step",), []
        check_numbers(f"{path}:{number}", record, names)
        kept.append(record)
    if not rl:
        raise ValueError(f"{path}: no RL step (rollout/reward_mean) yet")
    rl.sort(key=lambda record: record["step"])
    sft.sort(key=lambda record: record["step"])
    first = rl[0]["step"]
    return [r for r in sft if r["step"] < first], rl, [r for r in sft if r["step"] > first]


def read_evaluations(run: Path) -> list[dict]:
    """The records of ``run``'s evaluated steps (eval/reward_mean), in step order; a ValueError names the file
    and line of one without the figures."""
    path = run / "metrics.jsonl"
    evaluations = []
    for number, record in metrics_records(path):
        if "eval/reward_mean" in record:
            check_numbers(f"{path}:{number}", record, EVAL_METRICS)
            evaluations.append(record)
    return sorted(evaluations, key=lambda record: record["step"])


def evaluation_summary(evaluations: list[dict]) -> list[str]:
    """The held-out evaluation's line: reward and pass@1 at the first and last evaluated steps, the best."""
    if not evaluations:
        return []
    first, last = evaluations[0], evaluations[-1]
    best = max(evaluations, key=lambda record: record["eval/reward_mean"])
    return [
        f"held-out eval ({len(evaluations)} evaluations): reward {first['eval/reward_mean']:.3f} at step "
        f"{first['step']}, {last['eval/reward_mean']:.3f} at step {last['step']} (pass@1 {first['eval/pass@1']:.3f} "
        f"-> {last['eval/pass@1']:.3f}); best {best['eval/reward_mean']:.3f} at step {best['step']}"
    ]


def summary(warmup: list[dict], rl: list[dict], refresh: list[dict], window: int) -> list[str]:
    """The lines the docs quote: step counts, reward gain, sampled tokens, errors and wall time."""
    steps = np.array([r["step"] for r in rl])
    reward = np.array([r["rollout/reward_mean"] for r in rl])
    sampled = np.array([r["rollout/sampled_tokens"] for r in rl])
    independent = sampled + np.array([r["rollout/tokens_saved"] for r in rl])
    por = np.array([r["tree/por"] for r in rl])
    first, last = reward[:window].mean(), reward[-window:].mean()
    ratio = f"{independent.sum() / sampled.sum():.2f}x" if sampled.sum() else "n/a"
    return [
        f"warm-up steps: {len(warmup)}; RL steps: {len(rl)} (steps {steps[0]}-{steps[-1]}); "
        f"refresh steps: {len(refresh)}",
        f"reward: first {window} RL steps {first:.3f}, last {window} {last:.3f} (gain {last - first:+.3f}), "
        f"best step {reward.max():.3f}",
        f"sampled tokens per RL step: trees {sampled.mean():.0f}, independent {independent.mean():.0f} "
        f"({ratio}); trained tree/por {por.mean():.3f}",
        f"parse errors {sum(r['rollout/parse_errors'] for r in rl):.0f}, env errors "
        f"{sum(r['rollout/env_errors'] for r in rl):.0f}; wall: warm-up {sum(r['time/step_s'] for r in warmup):.0f} s, "
        f"RL {sum(r['time/step_s'] for r in rl):.0f} s, "
        f"refresh {sum(r['time/step_s'] for r in refresh):.0f} s (step times)",
    ]


def plot(
    warmup: list[dict],
    rl: list[dict],
    window: int,
    output: Path,
    title: str = "secret tool",
    chance: float = 0.1,
    evaluations: list[dict] = (),
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in rl])
    reward = np.array([r["rollout/reward_mean"] for r in rl])
    smooth = np.convolve(reward, np.ones(window) / window, mode="valid")
    sampled = np.array([r["rollout/sampled_tokens"] for r in rl])
    independent = sampled + np.array([r["rollout/tokens_saved"] for r in rl])
    por = np.array([r["tree/por"] for r in rl])

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, reward, color="tab:blue", alpha=0.35, label="reward, per step")
    left.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"reward, {window}-step mean")
    if evaluations:
        left.plot(
            [r["step"] for r in evaluations],
            [r["eval/reward_mean"] for r in evaluations],
            color="tab:orange",
            linestyle="--",
            marker="o",
            label="held-out eval reward",
        )
    left.axhline(chance, color="grey", linestyle=":", label="guessing (ignores the observation)")
    left.axhline(0.8, color="tab:green", linestyle="--", label="target 0.8")
    if warmup:
        left.axvspan(0.5, len(warmup) + 0.5, color="grey", alpha=0.15, label=f"SFT warm-up ({len(warmup)} steps)")
    left.set(xlabel="training step", ylabel="rollout/reward_mean", ylim=(-0.02, 1.02), title=f"{title}: learning curve")
    left.legend(fontsize=8, loc="lower right")
    right.plot(steps, independent, color="tab:red", label="sampled: independent episodes")
    right.plot(steps, sampled, color="tab:blue", label="sampled: episode trees")
    twin = right.twinx()
    twin.plot(steps, por, color="tab:purple", linestyle="--", label="trained tree/por (right axis)")
    twin.set(ylabel="tree/por (1 - tree tokens / flat tokens)", ylim=(0, 1))
    right.set(
        xlabel="training step",
        ylabel="assistant tokens sampled per step",
        ylim=(0, None),
        title="tree reuse per RL step",
    )
    lines = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    labels = right.get_legend_handles_labels()[1] + twin.get_legend_handles_labels()[1]
    right.legend(lines, labels, fontsize=8, loc="lower right")
    save_figure(figure, output, dpi=110)
    plt.close(figure)
