"""Step metrics: a JSONL record, the same scalars to each experiment tracker (TensorBoard by default;
:mod:`ds_tree.run.trackers`) and one console line (rank 0)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ds_tree.atomic import write_text_atomically
from ds_tree.config import ConfigError
from ds_tree.data.jsonl import json_text
from ds_tree.run.trackers import Tracker, close_all

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Writes ``metrics.jsonl`` under ``output_dir`` and hands the same scalars to ``trackers`` (opened
    by the caller, rank 0 only: :func:`~ds_tree.run.trackers.open_trackers`); closes them."""

    def __init__(self, output_dir: Path, enabled: bool, resume_step: int, trackers: Sequence[Tracker] = ()) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.trackers = list(trackers)
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if self.path.is_symlink():  # written by the run, never through a link to a file elsewhere
            logger.warning(
                "%s: a symbolic link (to %s); replaced by the run's own file", self.path, os.readlink(self.path)
            )
            self.path.unlink()
        if self.path.exists():  # a resumed run: drop records of steps it will redo
            kept = [line for line, record in self.read_records() if record["step"] <= resume_step]
            write_text_atomically(self.path, "".join(line + "\n" for line in kept))

    def read_records(self) -> list[tuple[str, dict]]:
        """The (line, record) pairs of ``metrics.jsonl``. A last line without its newline that does not
        parse (a kill or a full disk during the append) is dropped with a warning; any other line that
        does not parse is an error naming the file and line."""
        text = self.path.read_text()
        lines = text.split("\n")
        torn = lines.pop()  # the text after the last newline: empty unless an append was cut short
        records = []
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    raise ValueError("no integer 'step'")
            except ValueError as error:
                message = f"{self.path}:{number}: not a metrics record ({error}); repair or remove the line"
                raise ConfigError(message) from None
            records.append((line, record))
        if torn:
            try:
                record = json.loads(torn)
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    raise ValueError("no integer 'step'")
                records.append((torn, record))
            except ValueError:
                logger.warning(
                    "%s:%d: dropped a half-written last line (%d bytes; a run was killed while appending it)",
                    self.path,
                    len(lines) + 1,
                    len(torn.encode()),
                )
        return records

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """``scalars`` keys are namespaced tags such as ``loss/train`` or ``throughput/tokens_per_s``.

        One ``write`` of the whole line on an ``O_APPEND`` descriptor, then fsync'd: a kill leaves
        the line whole or absent, a full disk at worst a torn last line that a resume drops."""
        if not self.enabled:
            return
        line = (json_text({"step": step, **scalars}) + "\n").encode()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        descriptor = os.open(self.path, flags, 0o644)
        try:
            written = os.write(descriptor, line)
            if written != len(line):
                raise OSError(f"{self.path}: wrote {written} of {len(line)} bytes of step {step}'s record")
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        for tracker in self.trackers:
            tracker.log(step, scalars)

    def close(self) -> None:
        close_all(self.trackers)
        self.trackers = []


def console_line(step: int, max_steps: int, scalars: dict[str, float]) -> str:
    """One grep-able line per step (RL runs add reward, clip fractions (CPPO: the masked fraction) and KL;
    distillation its divergence and the reward, where there is one; DPO the margin and the accuracy)."""
    rl = ""
    if "rl/reward_mean" in scalars:
        trust = f"clip {scalars['rl/clip_frac_low']:.3f}/{scalars['rl/clip_frac_high']:.3f}"
        if "rl/cppo_masked_frac" in scalars:  # CPPO's mask replaces the clip
            trust = f"masked {scalars['rl/cppo_masked_frac']:.3f}"
        rl = (
            f" reward {scalars['rl/reward_mean']:.4f} {trust} kl {scalars['rl/approx_kl']:.2e}"
            f" entropy {scalars['rl/entropy']:.3f}"
        )
    if "distill/divergence" in scalars:
        reward = scalars.get("rollout/reward_mean", scalars.get("distill/reward_mean"))
        rl = f" divergence {scalars['distill/divergence']:.4f}" + (
            f" reward {reward:.4f}" if reward is not None else ""
        )
    if "dpo/margin" in scalars:
        rl = f" margin {scalars['dpo/margin']:.4f} accuracy {scalars['dpo/accuracy']:.3f}"
    plan = ""
    if "time/plan_s" in scalars:  # the host work of the step, and what the step waited for it
        plan = f" plan {scalars['time/plan_s']:.3f}s (waited {scalars['time/plan_wait_s']:.3f}s)"
    return (
        f"step {step}/{max_steps} loss {scalars['loss/train']:.6f} lr {scalars['optim/lr']:.3e} "
        f"grad_norm {scalars['optim/grad_norm']:.4f} tokens/s {scalars['throughput/flat_tokens_per_s']:.0f} "
        f"(unique {scalars['throughput/unique_tokens_per_s']:.0f}) POR {scalars['tree/por']:.3f} "
        f"ERR {scalars['tree/err']:.3f} step_time {scalars['time/step_s']:.3f}s{plan}{rl}"
    )
