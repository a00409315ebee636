"""The run's output directory: writable before anything starts, what a resume may change, and
the history of the configs that trained into it.

``config.yaml`` is the config of the first run; a resumed run whose config differs from the last
recorded one adds ``config.1.yaml``, ``config.2.yaml``, ... (each headed by the step it resumed
from), so the history is never overwritten. A resume is refused when the world size differs from
the checkpoint's (DeepSpeed partitions the ZeRO optimizer state per rank and cannot load it at
another world size) or when ``max_steps`` is below the checkpoint's step; any other difference
(a new ``data.path``, a longer ``max_steps``, ...) is listed as a warning; a new ``optimizer.lr``,
``betas``, ``eps`` or ``weight_decay`` is listed as not used, since the optimizer and schedule state
the checkpoint restores holds the old ones.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import yaml

from ds_tree.atomic import write_text_atomically
from ds_tree.config import Config, ConfigError, config_to_dict

logger = logging.getLogger(__name__)

HISTORY = re.compile(r"^config(?:\.(\d+))?\.yaml$")
# Written inside a run's output_dir and replaced or deleted by it: another output_dir there is lost.
REPLACED_BY_A_RUN = ("checkpoints", "hf")
# What a killed run leaves: a save in progress (checkpoint.PARTIAL), a directory renamed aside while
# its replacement moved in (atomic.replace_directory), a half-written file (atomic.write_text_atomically),
# an export in progress (export.export_hf).
LEFTOVER = re.compile(r"^(\.partial-.+|\..+\.replaced-\d+|\..+\.tmp-\d+|hf\.partial)$")
REPLACED = re.compile(r"^\.(.+)\.replaced-\d+$")
# AdamW's hyperparameters live in the optimizer and schedule state that a resume loads.
RESTORED = {"optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay"}
TRAINED_SHAPE = ("model.lora.rank", "model.lora.target_modules", "model.lora.modules_to_save")
"""Fields that decide which parameters are trained and their shapes: a checkpoint's weights and optimizer
state fit only the values it was saved with (a changed rank failed on a tensor size, deep in the load)."""


def check_writable(output_dir: str | Path) -> None:
    """``output_dir`` is a directory, or can be created, and a file can be written there."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir: {path} exists and is not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"output_dir: {path} cannot be created: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(f"output_dir: {path} cannot be written ({existing}: {error.strerror})") from None


def _is_run_dir(path: Path) -> bool:
    from ds_tree.run.run_lock import LOCK_FILE

    checkpoints = path / "checkpoints"
    return (
        (path / LOCK_FILE).exists()
        or (checkpoints / "latest").exists()
        or any(checkpoints.glob("step_*/ds_tree_checkpoint.json"))
    )


def check_not_nested(output_dir: str | Path) -> None:
    """Refuse an ``output_dir`` that another run deletes or replaces (inside its ``checkpoints`` or
    ``hf``), and one whose ``checkpoints`` holds another run's output_dir."""
    from ds_tree.run.run_lock import LOCK_FILE

    path = Path(output_dir).resolve()
    for inner in (path, *path.parents):
        if inner.name in REPLACED_BY_A_RUN and _is_run_dir(inner.parent):
            raise ConfigError(
                f"output_dir: {output_dir} lies inside {inner}, which the run in {inner.parent} prunes and replaces "
                "(its checkpoints and export): this run's files would be deleted with them. Choose a directory "
                "outside it"
            )
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir():
        for lock in checkpoints.rglob(LOCK_FILE):
            raise ConfigError(
                f"output_dir: {lock.parent}, the output_dir of another run, lies inside {checkpoints}, whose "
                "checkpoints this run prunes and replaces: move that run out first"
            )


def _size(path: Path) -> tuple[int, int]:
    """(files, bytes) of a file or directory."""
    if path.is_symlink() or not path.is_dir():
        return 1, path.lstat().st_size
    sizes = [item.lstat().st_size for item in path.rglob("*") if not item.is_dir() or item.is_symlink()]
    return len(sizes), sum(sizes)


def remove_leftovers(output_dir: str | Path) -> list[str]:
    """Remove what a killed run left in ``output_dir`` and its ``checkpoints`` (call with the lock held).

    ``.partial-*`` saves, ``.NAME.replaced-PID`` directories (put back as ``NAME`` where a kill
    between the two renames left ``NAME`` missing), ``.NAME.tmp-PID`` files, ``hf.partial`` and empty
    copies of DeepSpeed's recovery scripts; one log line says what and how much. Returns that list.
    """
    from ds_tree.run.checkpoint import RECOVERY_SCRIPTS, harden_recovery_scripts

    output_dir = Path(output_dir)
    removed, restored, total = [], [], 0
    for directory in (output_dir, output_dir / "checkpoints"):
        if not directory.is_dir():
            continue
        for item in sorted(directory.iterdir()):
            name = item.relative_to(output_dir).as_posix()
            replaced = REPLACED.match(item.name)
            if replaced and not (directory / replaced.group(1)).exists() and not item.name.endswith(".tmp"):
                os.rename(item, directory / replaced.group(1))
                restored.append(f"{name} -> {replaced.group(1)}")
                continue
            empty_script = item.name in RECOVERY_SCRIPTS and item.is_file() and item.stat().st_size == 0
            if not (LEFTOVER.match(item.name) or empty_script):
                continue
            files, size = _size(item)
            total += size
            removed.append(f"{name} ({files} file{'s' if files != 1 else ''}, {size} bytes)")
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item)
            else:
                item.unlink()
    if removed or restored:
        what = f"removed {len(removed)} ({total} bytes): {', '.join(removed)}" if removed else ""
        back = f"put back {', '.join(restored)}" if restored else ""
        done = "; ".join(part for part in (what, back) if part)
        logger.warning("output_dir %s: leftovers of an earlier run that was killed: %s", output_dir, done)
    harden_recovery_scripts(output_dir / "checkpoints")  # a copy DeepSpeed wrote just before a kill
    return removed + restored


def resume_changes(record: dict, config: Config, world_size: int, where: Path) -> list[str]:
    """What differs between the checkpoint ``record`` (at ``where``) and this run: ``key: old -> new``.

    Raises :class:`ConfigError` for the differences a resume cannot take.
    """
    step = record["step"]
    if record.get("world_size") != world_size:
        raise ConfigError(
            f"{where} was written by {record.get('world_size')} ranks, this run has {world_size}: DeepSpeed "
            "cannot load ZeRO optimizer state partitioned for another world size. Resume with "
            f"{record.get('world_size')} ranks, or start a new output_dir"
        )
    if config.max_steps < step:
        raise ConfigError(
            f"max_steps ({config.max_steps}) is below the step of {where} ({step}); raise max_steps to resume "
            "from it, or start a new output_dir"
        )
    before = _flatten(record.get("config", {}))
    after = _flatten(config_to_dict(config))
    keys = sorted((set(before) | set(after)) - {"output_dir"})
    for key in TRAINED_SHAPE:
        if key in before and before[key] != after.get(key):
            raise ConfigError(
                f"{key} changed from {before[key]!r} to {after.get(key)!r}: {where} holds the trained parameters "
                f"(and their optimizer state) of {before[key]!r}. Resume with {key.rpartition('.')[2]}: "
                f"{before[key]!r}, or start a new output_dir"
            )
    changes = []
    for key in (key for key in keys if before.get(key) != after.get(key)):
        note = " (not used: the checkpoint's optimizer state holds the old value)" if key in RESTORED else ""
        changes.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}{note}")
    return changes


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def record_config(output_dir: Path, config: Config, resumed_step: int) -> Path | None:
    """Add this run's config to the history unless it equals the last recorded one; the file written."""
    values = config_to_dict(config)
    history = sorted(
        (int(match.group(1) or 0), path)
        for path in output_dir.glob("config*.yaml")
        if (match := HISTORY.match(path.name))
    )
    if history:
        if yaml.safe_load(history[-1][1].read_text()) == values:
            return None
        number = history[-1][0] + 1
        path = output_dir / f"config.{number}.yaml"
        header = f"# run {number + 1}: started at step {resumed_step}; config.yaml holds the first run's config\n"
    else:
        path = output_dir / "config.yaml"
        header = ""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, header + yaml.safe_dump(values, sort_keys=False))
    return path
