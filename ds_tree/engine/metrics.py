"""Step metrics: namespaced TensorBoard scalars, a JSONL record and one console line (rank 0)."""

from __future__ import annotations

import json
from pathlib import Path

from ds_tree.atomic import write_text_atomically
from ds_tree.data.jsonl import json_text


class MetricsLogger:
    """Writes ``metrics.jsonl`` and TensorBoard event files under ``output_dir`` on rank 0."""

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool, resume_step: int) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a resumed run: drop records of steps it will redo
            kept = [
                line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step
            ]
            write_text_atomically(self.path, "".join(line + "\n" for line in kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=resume_step + 1)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """``scalars`` keys are namespaced tags such as ``loss/train`` or ``throughput/tokens_per_s``."""
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json_text({"step": step, **scalars}) + "\n")
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def console_line(step: int, max_steps: int, scalars: dict[str, float]) -> str:
    """One grep-able line per step (RL runs add reward, clip fractions and KL)."""
    rl = ""
    if "rl/reward_mean" in scalars:
        rl = (
            f" reward {scalars['rl/reward_mean']:.4f} clip {scalars['rl/clip_frac_low']:.3f}/"
            f"{scalars['rl/clip_frac_high']:.3f} kl {scalars['rl/approx_kl']:.2e} entropy {scalars['rl/entropy']:.3f}"
        )
    return (
        f"step {step}/{max_steps} loss {scalars['loss/train']:.6f} lr {scalars['optim/lr']:.3e} "
        f"grad_norm {scalars['optim/grad_norm']:.4f} tokens/s {scalars['throughput/flat_tokens_per_s']:.0f} "
        f"(unique {scalars['throughput/unique_tokens_per_s']:.0f}) POR {scalars['tree/por']:.3f} "
        f"ERR {scalars['tree/err']:.3f} step_time {scalars['time/step_s']:.3f}s{rl}"
    )
