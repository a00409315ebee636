"""Which checkpoint a run resumes from, and loading it (``checkpoint.resume``; docs/CHECKPOINTS.md).

Rank 0 alone plans the resume, before any process group exists (:func:`plan`), so a dry run finds what a
run would load and why it may not; every rank then loads the checkpoint rank 0 chose (:func:`load`), once
each of its files matches its record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ds_tree.config import Config
from ds_tree.run import checkpoint, run_dir

logger = logging.getLogger(__name__)


def plan(directory: Path, config: Config, world_size: int, check: Callable[[Path, int], None]) -> str | None:
    """The tag of the checkpoint under ``directory`` this run resumes from (None: it starts at step 0).
    ``check(path, step)``: the objective's own state in that checkpoint (a :class:`CheckpointError` when it
    cannot resume from it). Warns of a changed config, and of newer complete checkpoints left behind."""
    tag = checkpoint.resume_tag(directory, config.checkpoint.resume)
    if tag is None:
        return None
    record = checkpoint.read_record(directory, tag)
    changes = run_dir.resume_changes(record, config, world_size, directory / tag)
    step = checkpoint.step_of(tag)
    check(directory / tag, step)
    if changes:
        logger.warning("resuming from %s with a changed config: %s", tag, "; ".join(changes))
    newer = [other for other in checkpoint.complete_tags(directory) if checkpoint.step_of(other) > step]
    if newer:
        logger.warning(
            "resuming from %s although newer complete checkpoints exist (%s); they are kept until this run "
            "saves the same steps",
            tag,
            ", ".join(newer),
        )
    return tag


def load(engine, directory: Path, tag: str, *, rank: int, world_size: int, frozen_base: bool) -> dict:
    """Checkpoint ``tag`` into ``engine`` on every rank, its files verified first; its client state.
    ``frozen_base`` (``model.lora``): the checkpoint holds the adapters only, the base being rebuilt."""
    checkpoint.verify(directory, tag, rank, world_size, engine.device)
    with checkpoint.weights_only_loads():
        _, client_state = engine.load_checkpoint(str(directory), tag=tag, load_module_strict=not frozen_base)
    return client_state
