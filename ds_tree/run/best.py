"""The best checkpoint (``checkpoint.keep_best``): the checkpoint that scored best on an ``eval/`` metric, kept
beside the newest ones and never deleted by rotation (docs/EVAL.md).

``<output_dir>/checkpoints/best.json`` names it: ``{"tag", "step", "metric", "mode", "value"}``. A save passes
:meth:`BestCheckpoint.kept` to the rotation, so the best is never pruned; once a checkpoint is complete and
scored better, the record names it (written atomically), and only then is the one it replaces pruned: a kill at
any point leaves a record naming a complete checkpoint. A resumed run reads the record back; one that names a
step above the resumed one is dropped (the run saves those steps again, with other weights), as is one of
another metric or mode (the new setting starts afresh) or one whose checkpoint is gone.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from ds_tree.atomic import write_text_atomically
from ds_tree.data.jsonl import json_text
from ds_tree.run import checkpoint

logger = logging.getLogger(__name__)

BEST = "best.json"


class BestCheckpoint:
    """The record of ``directory`` (a run's ``checkpoints``) for ``metric``, better by ``mode`` (max or min).
    Rank 0 alone reads and writes it (it alone prunes)."""

    def __init__(self, directory: Path, metric: str, mode: str) -> None:
        self.directory = directory
        self.metric = metric
        self.mode = mode
        self.record: dict | None = None
        """The best so far: ``tag``, ``step``, ``metric``, ``mode``, ``value``."""

    @property
    def path(self) -> Path:
        return self.directory / BEST

    def load(self, resume_step: int) -> None:
        """The record a run resuming at ``resume_step`` continues from (module docstring)."""
        self.record = None
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as error:
            logger.warning("%s: unreadable (%s); the best checkpoint is chosen afresh", self.path, error)
            return
        why = self.stale(record, resume_step)
        if why:
            logger.warning("%s: %s; the best checkpoint is chosen afresh", self.path, why)
            return
        self.record = record

    def stale(self, record: object, resume_step: int) -> str | None:
        """Why ``record`` cannot be continued from, or None."""
        if not isinstance(record, dict) or not isinstance(record.get("value"), int | float):
            return "not a best-checkpoint record"
        if (record.get("metric"), record.get("mode")) != (self.metric, self.mode):
            return f"it scores {record.get('metric')} ({record.get('mode')}), this run {self.metric} ({self.mode})"
        if not isinstance(record.get("step"), int) or record["step"] > resume_step:
            return f"it names step {record.get('step')}, after the step this run resumes from ({resume_step})"
        if checkpoint.read_record(self.directory, str(record.get("tag"))) is None:
            return f"its checkpoint {record.get('tag')} is not a complete checkpoint"
        return None

    def kept(self) -> tuple[str, ...]:
        """The tags rotation must not delete."""
        return (self.record["tag"],) if self.record else ()

    def better(self, value: float) -> bool:
        """Whether ``value`` beats the best so far (a first finite value always does; NaN never)."""
        if not math.isfinite(value):
            return False
        if self.record is None:
            return True
        best = self.record["value"]
        return value > best if self.mode == "max" else value < best

    def consider(self, step: int, value: float, keep_last: int) -> bool:
        """Checkpoint ``step`` (complete) scored ``value``: if better, record it and prune the one it replaces
        (``keep_last`` kept as in every save). Whether it is the best now."""
        if not self.better(value):
            return False
        tag = checkpoint.tag_for(step)
        self.record = {"tag": tag, "step": step, "metric": self.metric, "mode": self.mode, "value": value}
        write_text_atomically(self.path, json_text(self.record, indent=2) + "\n")
        checkpoint.prune(self.directory, keep_last, step, keep=(tag,))
        logger.info("best checkpoint: %s (%s %.6g)", tag, self.metric, value)
        return True
