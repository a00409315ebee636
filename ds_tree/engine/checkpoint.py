"""DeepSpeed checkpoints that are complete before they count, and Hugging Face export.

DeepSpeed writes each checkpoint under ``<dir>/<tag>``. ds_tree saves with ``save_latest=False``
and only after every rank has finished writing does rank 0 replace ``<dir>/latest`` atomically
(write a temporary file, fsync, rename). A run killed mid-write therefore leaves ``latest``
pointing at the previous complete checkpoint; the half-written directory is removed on resume.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

TAG_PATTERN = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def step_of(tag: str) -> int | None:
    match = TAG_PATTERN.match(tag)
    return int(match.group(1)) if match else None


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def read_latest(directory: Path) -> str | None:
    latest = directory / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag if (directory / tag).is_dir() else None


def save(engine, directory: Path, step: int, client_state: dict, keep_last: int) -> str:
    """Save a checkpoint of ``step`` on every rank; make it ``latest`` once all ranks are done."""
    tag = tag_for(step)
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        write_atomically(directory / "latest", tag)
        prune(directory, keep_last)
    dist.barrier()
    return tag


def prune(directory: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` and any newer than ``latest``."""
    latest = read_latest(directory)
    if latest is None:
        return
    latest_step = step_of(latest)
    steps = sorted(
        (s, path) for path in directory.iterdir() if path.is_dir() and (s := step_of(path.name)) is not None
    )
    complete = [(s, path) for s, path in steps if s <= latest_step]
    for _, path in complete[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    for s, path in steps:
        if s > latest_step:  # written by a run that died before making it latest
            shutil.rmtree(path, ignore_errors=True)
