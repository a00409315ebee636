"""DeepSpeed checkpoints that count only once complete, where a run resumes, and pruning.

Layout of ``<output_dir>/checkpoints``:

- ``step_0000010/``: a complete checkpoint: every rank's DeepSpeed files and ``ds_tree_checkpoint.json``
  (its step, the world size and the run's config);
- ``latest``: the tag of the newest complete checkpoint, nothing else;
- ``.partial-step_0000012/``: a save in progress, or the remains of one that failed or was killed.
  Never read; the next save removes it.

A save: every rank's DeepSpeed files go to ``.partial-<tag>``; after a barrier (every rank done),
rank 0 writes the record into it, renames it to ``<tag>`` (replacing an older directory of that
step), then points ``latest`` at it (atomically) and prunes. A checkpoint is complete when its
directory (a real directory, not a link) is named ``step_<digits>`` and its record names that step.

Pruning deletes only complete checkpoints at or below the step just saved, beyond the newest
``keep_last``: it never touches a checkpoint newer than the one a run resumed from.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from ds_tree.atomic import replace_directory, write_text_atomically
from ds_tree.data.jsonl import json_text

RECORD = "ds_tree_checkpoint.json"
LATEST = "latest"
PARTIAL = ".partial-"
TAG_PATTERN = re.compile(r"^step_(\d+)$")


class CheckpointError(Exception):
    """A checkpoint that cannot be written or resumed from; the message names the path."""


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def step_of(tag: str) -> int | None:
    match = TAG_PATTERN.match(tag)
    return int(match.group(1)) if match else None


def read_record(directory: Path, tag: str) -> dict | None:
    """The record of a complete checkpoint ``tag``; None if it is not one."""
    path = directory / tag
    step = step_of(tag)
    if step is None or path.is_symlink() or not path.is_dir():
        return None
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("step") == step else None


def complete_tags(directory: Path) -> list[str]:
    """Tags of the complete checkpoints in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    tags = [path.name for path in directory.iterdir() if read_record(directory, path.name) is not None]
    return sorted(tags, key=step_of)


def _found(directory: Path) -> str:
    tags = complete_tags(directory)
    return f"complete checkpoints there: {', '.join(tags)}" if tags else "no complete checkpoint there"


def read_latest(directory: Path) -> str | None:
    """The complete checkpoint ``latest`` names; None without a ``latest`` file.

    A ``latest`` that cannot be read or names anything else (a half-written or missing
    checkpoint, ``..``, an absolute path, a link) is an error, never a silent fresh start.
    """
    latest = directory / LATEST
    if not latest.exists() and not latest.is_symlink():
        return None
    try:
        tag = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{latest}: unreadable ({error}); {_found(directory)}") from None
    if read_record(directory, tag) is None:
        raise CheckpointError(
            f"{latest}: names {tag!r}, which is not a complete checkpoint in {directory} ({_found(directory)}). "
            "Repair or delete the file, or set checkpoint.resume=newest_complete to resume from the newest "
            "complete one"
        )
    return tag


def resume_tag(directory: Path, policy: str) -> str | None:
    """The checkpoint a run resumes from under ``checkpoint.resume`` = ``policy`` (None: step 0)."""
    complete = complete_tags(directory)
    if policy == "never":
        if complete:
            raise CheckpointError(
                f"checkpoint.resume=never, but {directory} holds complete checkpoints ({', '.join(complete)}) "
                "that a fresh run would overwrite: choose another output_dir or delete them"
            )
        return None
    if policy == "newest_complete":
        return complete[-1] if complete else None
    latest = read_latest(directory)
    if latest is None and complete:
        raise CheckpointError(
            f"{directory / LATEST}: missing, but {directory} holds complete checkpoints ({', '.join(complete)}). "
            "Restore the file, or set checkpoint.resume=newest_complete to resume from the newest one"
        )
    if latest is None and policy == "latest":
        raise CheckpointError(f"checkpoint.resume=latest, but there is no checkpoint in {directory}")
    return latest


def save(engine, directory: Path, step: int, client_state: dict, record: dict, keep_last: int) -> str:
    """Save ``step`` from every rank; it becomes complete and ``latest`` once every rank is done."""
    tag = tag_for(step)
    partial = directory / f"{PARTIAL}{tag}"
    rank = dist.get_rank()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob(f"{PARTIAL}*"):
            shutil.rmtree(leftover, ignore_errors=True)
    dist.barrier()
    try:
        engine.save_checkpoint(str(directory), tag=partial.name, client_state=client_state, save_latest=False)
    except (OSError, RuntimeError) as error:
        raise CheckpointError(write_failure(directory, tag, error)) from error
    dist.barrier()
    if rank == 0:
        try:
            write_text_atomically(partial / RECORD, json_text({**record, "step": step}, indent=2) + "\n")
            replace_directory(partial, directory / tag)
            write_text_atomically(directory / LATEST, tag)
        except OSError as error:
            raise CheckpointError(write_failure(directory, tag, error)) from error
        prune(directory, keep_last, step)
    dist.barrier()
    return tag


def write_failure(directory: Path, tag: str, error: BaseException) -> str:
    """What went wrong writing checkpoint ``tag``, naming a full disk as such.

    torch's writer reports a full disk as ``basic_ios::clear: iostream error`` (no errno), so
    the free space is checked as well: less than the newest complete checkpoint takes, or under
    1 MiB, counts as full.
    """
    complete = complete_tags(directory)
    existing = directory
    while not existing.exists():  # a rank that found no directory to write into
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    needed = max(_size(directory / complete[-1]) if complete else 0, 1 << 20)
    full = getattr(error, "errno", None) == errno.ENOSPC or free < needed
    kept = f"the last complete checkpoint, {complete[-1]}, is kept" if complete else "no earlier checkpoint exists"
    cause = "no space left on device" if full else "the write failed"
    return (
        f"checkpoint {tag} could not be written to {directory}: {cause} ({free} bytes free; {kept}) "
        f"[{type(error).__name__}: {error}]"
    )


def _size(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def prune(directory: Path, keep_last: int, newest_step: int) -> None:
    """Delete complete checkpoints at or below ``newest_step`` beyond the newest ``keep_last``.

    Checkpoints above ``newest_step`` (written by an earlier run that got further than the one
    this run resumed from) and anything that is not a complete checkpoint are left alone.
    """
    candidates = [tag for tag in complete_tags(directory) if step_of(tag) <= newest_step]
    for tag in candidates[:-keep_last]:
        shutil.rmtree(directory / tag, ignore_errors=True)
