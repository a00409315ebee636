"""The multi-turn CPU example's figure (docs/ENVIRONMENTS.md): its learning curve and the sampler's tree reuse.

python tools/plot_multiturn.py runs/multiturn/rl --output docs/bench/multiturn_rl.png

Reads the run's metrics.jsonl: the warm-up steps (``warmup/sft_loss``, rollout.env.warmup_steps) and
the RL steps (``rollout/`` metrics). Left: ``rollout/reward_mean`` per RL step and its 5-step running
mean, the guessing rate (0.1) and the 0.8 target. Right, per RL step: the tokens the episode trees
sampled (``rollout/sampled_tokens``) against what independent episodes with the same leaves would
sample (``+ rollout/tokens_saved``: every leaf's assistant tokens), and the tree tokens trained
against their flat count (``tree/por``). Prints the figures the docs quote.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="the run's output_dir")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = sorted((r for r in records if "rollout/reward_mean" in r), key=lambda r: r["step"])
    if not rl:
        raise SystemExit(f"{args.run}/metrics.jsonl: no RL step (rollout/reward_mean) yet")
    sft = [r for r in records if "warmup/sft_loss" in r]
    warmup = [r for r in sft if r["step"] < rl[0]["step"]]  # the rest: refresh steps (rollout.env.refresh_every)
    refresh = [r for r in sft if r["step"] > rl[0]["step"]]
    steps = np.array([r["step"] for r in rl])
    reward = np.array([r["rollout/reward_mean"] for r in rl])
    window = min(args.window, len(reward))
    smooth = np.convolve(reward, np.ones(window) / window, mode="valid")
    sampled = np.array([r["rollout/sampled_tokens"] for r in rl])
    independent = sampled + np.array([r["rollout/tokens_saved"] for r in rl])
    por = np.array([r["tree/por"] for r in rl])

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, reward, color="tab:blue", alpha=0.35, label="reward, per step")
    left.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"reward, {window}-step mean")
    left.axhline(0.1, color="grey", linestyle=":", label="guessing (ignores the observation)")
    left.axhline(0.8, color="tab:green", linestyle="--", label="target 0.8")
    if warmup:
        left.axvspan(0.5, len(warmup) + 0.5, color="grey", alpha=0.15, label=f"SFT warm-up ({len(warmup)} steps)")
    left.set(
        xlabel="training step", ylabel="rollout/reward_mean", ylim=(-0.02, 1.02), title="secret tool: learning curve"
    )
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
    figure.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.output, dpi=110)
    first, last = reward[:window].mean(), reward[-window:].mean()
    print(
        f"warm-up steps: {len(warmup)}; RL steps: {len(rl)} (steps {steps[0]}-{steps[-1]}); "
        f"refresh steps: {len(refresh)}"
    )
    print(
        f"reward: first {window} RL steps {first:.3f}, last {window} {last:.3f} (gain {last - first:+.3f}), "
        f"best step {reward.max():.3f}"
    )
    print(
        f"sampled tokens per RL step: trees {sampled.mean():.0f}, independent {independent.mean():.0f} "
        f"({independent.sum() / sampled.sum():.2f}x); trained tree/por {por.mean():.3f}"
    )
    print(
        f"parse errors {sum(r['rollout/parse_errors'] for r in rl):.0f}, env errors "
        f"{sum(r['rollout/env_errors'] for r in rl):.0f}; wall: warm-up {sum(r['time/step_s'] for r in warmup):.0f} s, "
        f"RL {sum(r['time/step_s'] for r in rl):.0f} s, "
        f"refresh {sum(r['time/step_s'] for r in refresh):.0f} s (step times)"
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
