"""DeepSpeed checkpoints that count only once complete, where a run resumes, and pruning.

Layout of ``<output_dir>/checkpoints``:

- ``step_0000010/``: a complete checkpoint: every rank's DeepSpeed files and ``ds_tree_checkpoint.json``
  (its step, the world size and the run's config);
- ``latest``: the tag of the newest complete checkpoint, nothing else;
- ``.partial-step_0000012/``: a save in progress, or the remains of one that failed or was killed.
  Never read; the next save removes it.

A save: every rank's DeepSpeed files go to ``.partial-<tag>`` (a symbolic link in ``checkpoints``
under the name of anything a save writes is removed first, never written through: nothing a run
writes lands outside its directory); after a barrier (every rank done),
rank 0 writes the record into it, renames it to ``<tag>`` (replacing an older directory of that
step), then points ``latest`` at it (atomically) and prunes. A checkpoint is complete when its
directory (a real directory, not a link) is named ``step_<digits>`` and its record names that step.

The record lists every file of the checkpoint (every rank's) with its size and sha256, hashed by
all ranks in shares once every rank has written: a checkpoint is complete only when each listed
file is there with its recorded size. Before a resume loads one, every file is checked against its
sha256 (and no unlisted file may sit beside them), and DeepSpeed's ``torch.load`` calls run with
``weights_only=True`` (:func:`weights_only_loads`), so a replaced file is refused, and a pickle
that would run code cannot, even where its record was rewritten to match (docs/LAUNCH.md, "Trust").

Pruning deletes only complete checkpoints at or below the step just saved, beyond the newest
``keep_last``: it never touches a checkpoint newer than the one a run resumed from. The one it
resumed from is loaded by every rank before the first save's barriers, so a prune never reaches
it before it is loaded, and no other run prunes it meanwhile: rank 0 holds the output directory's
lock (:mod:`ds_tree.run.run_lock`) and chose it for every rank (:func:`agree`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import pickle
import re
import shutil
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import torch
import torch.distributed as dist

from ds_tree.atomic import remove, replace_directory, write_text_atomically
from ds_tree.data.jsonl import json_text

logger = logging.getLogger(__name__)

RECORD = "ds_tree_checkpoint.json"
LATEST = "latest"
PARTIAL = ".partial-"
TAG_PATTERN = re.compile(r"^step_(\d+)$")
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


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
    if not isinstance(record, dict) or record.get("step") != step or not _files_present(path, record):
        return None
    return record


def _safe_name(name: object) -> bool:
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    return bool(parts) and not PurePosixPath(name).is_absolute() and ".." not in parts and name != RECORD


def _files_present(path: Path, record: dict) -> bool:
    """Every file the record lists (every rank's) is there with its recorded size."""
    return _missing_file(path, record) is None


def _missing_file(path: Path, record: dict) -> str | None:
    """The first listed file that is not there at its recorded size, or what is wrong with the list."""
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return f"{path / RECORD} lists no files"
    for name, entry in files.items():
        if not _safe_name(name) or not isinstance(entry, dict):
            return f"{path / RECORD} lists {name!r}, not a file of the checkpoint"
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{path / name} is missing"
        if size != entry.get("size"):
            return f"{path / name} holds {size} bytes, its record says {entry.get('size')}"
    return None


def why_incomplete(directory: Path, tag: str) -> str:
    """Why ``tag`` in ``directory`` is not a complete checkpoint (for error messages)."""
    path = directory / tag
    if step_of(tag) is None or path.is_symlink() or not path.is_dir():
        return f"{path} is not a checkpoint directory"
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return f"{path / RECORD} is missing or unreadable"
    if not isinstance(record, dict) or record.get("step") != step_of(tag):
        return f"{path / RECORD} is not the record of step {step_of(tag)}"
    return _missing_file(path, record) or "complete"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def listing(path: Path) -> list[str]:
    """The files under ``path`` (relative POSIX names, sorted), its record left out."""
    names = (item.relative_to(path).as_posix() for item in path.rglob("*") if item.is_file() or item.is_symlink())
    return sorted(name for name in names if name != RECORD)


def describe_files(path: Path, names: list[str]) -> dict[str, dict]:
    return {name: {"size": (path / name).stat().st_size, "sha256": sha256_of(path / name)} for name in names}


def verify_files(path: Path, record: dict, names: list[str]) -> list[str]:
    """Which of ``names`` (listed in ``record``) differ from their recorded size and sha256."""
    problems = []
    for name in names:
        entry = record["files"][name]
        file = path / name
        if file.is_symlink() or not file.is_file():
            problems.append(f"{file}: missing (or not a regular file)")
        elif file.stat().st_size != entry.get("size") or sha256_of(file) != entry.get("sha256"):
            problems.append(f"{file}: its content differs from the sha256 recorded in {path / RECORD}")
    return problems


def unlisted_files(path: Path, record: dict) -> list[str]:
    """Files in the checkpoint that its record does not list (DeepSpeed would load some by name)."""
    return [f"{path / name}: not listed in {path / RECORD}" for name in listing(path) if name not in record["files"]]


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
        why = f": {why_incomplete(directory, tag)}" if step_of(tag) is not None else ""
        raise CheckpointError(
            f"{latest}: names {tag!r}, which is not a complete checkpoint in {directory}{why} ({_found(directory)}). "
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


def save(
    engine,
    directory: Path,
    step: int,
    client_state: dict,
    record: dict,
    keep_last: int,
    exclude_frozen: bool = False,
    extra: Callable[[Path], None] | None = None,
    keep: Collection[str] = (),
) -> str:
    """Save ``step`` from every rank; it becomes complete and ``latest`` once every rank is done.
    ``exclude_frozen``: the frozen parameters are left out (LoRA: adapters and their optimizer state only).
    ``extra(path)``: called on every rank after DeepSpeed's files are written, to add files of its own
    under ``path`` (listed in the record and verified on resume like DeepSpeed's). ``keep``: tags the
    rotation leaves alone (the best checkpoint, :mod:`ds_tree.run.best`)."""
    tag = tag_for(step)
    partial = directory / f"{PARTIAL}{tag}"
    rank = dist.get_rank()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob(f"{PARTIAL}*"):
            remove(leftover)  # a link under that name too: DeepSpeed would write through it
        for script in RECOVERY_SCRIPTS:  # DeepSpeed copies them with shutil.copyfile, which follows a link
            if (directory / script).is_symlink():
                (directory / script).unlink()
    dist.barrier()
    try:
        engine.save_checkpoint(
            str(directory),
            tag=partial.name,
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=exclude_frozen,
        )
        if extra is not None:
            extra(partial)
    except (OSError, RuntimeError) as error:
        raise CheckpointError(write_failure(directory, tag, error)) from error
    dist.barrier()
    files = _collective_describe(partial, rank, dist.get_world_size())
    if rank == 0:
        try:
            text = json_text({**record, "step": step, "files": files}, indent=2) + "\n"
            write_text_atomically(partial / RECORD, text)
            replace_directory(partial, directory / tag)
            write_text_atomically(directory / LATEST, tag)
        except OSError as error:
            raise CheckpointError(write_failure(directory, tag, error)) from error
        harden_recovery_scripts(directory)
        prune(directory, keep_last, step, keep)
    dist.barrier()
    return tag


def _collective_describe(path: Path, rank: int, world_size: int) -> dict[str, dict]:
    """Sizes and sha256 of every file under ``path`` (rank 0 lists them, each rank hashes a share)."""
    names = [listing(path) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    shares: list = [None] * world_size
    dist.all_gather_object(shares, describe_files(path, names[0][rank::world_size]))
    return {name: share[name] for share in shares for name in sorted(share)}


def agree(choose: Callable[[], str | None], rank: int, device=None) -> str | None:
    """Rank 0's ``choose()`` for every rank (the checkpoint to resume from): the other ranks never
    choose for themselves, and an error rank 0 meets is raised on every rank alike."""
    payload: list = [None]
    if rank == 0:
        try:
            payload = [("tag", choose())]
        except (CheckpointError, ValueError) as error:  # ValueError: ConfigError, a resume the config forbids
            payload = [("error", f"{type(error).__name__}", str(error))]
    dist.broadcast_object_list(payload, src=0, device=device)
    if payload[0][0] == "error":
        raise CheckpointError(f"rank 0: {payload[0][2]}" if rank else payload[0][2])
    return payload[0][1]


def verify(directory: Path, tag: str, rank: int, world_size: int, device=None) -> None:
    """Check every file of checkpoint ``tag`` against its record (each rank a share, all ranks the
    verdict): a :class:`CheckpointError` naming each file that differs, is missing or is unlisted."""
    path = directory / tag
    record = read_record(directory, tag)
    if record is None:
        problems = [f"{path}: not a complete checkpoint (its record, or a file it lists, is missing)"]
    else:
        names = sorted(record["files"])
        problems = verify_files(path, record, names[rank::world_size])
        if rank == 0:
            problems += unlisted_files(path, record)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, problems)
    found = [problem for share in gathered for problem in share]
    if found:
        raise CheckpointError(
            f"refusing to load {path}: {'; '.join(found)}. A file that does not match the record of its "
            'checkpoint is never loaded (docs/LAUNCH.md, "Trust"): restore it, or resume from another '
            "checkpoint (write its tag to latest)"
        )


def allowed_globals() -> list:
    """The classes in DeepSpeed's checkpoint state that ``weights_only`` loading must admit."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler]


_TORCH_LOAD = torch.load  # torch's own, before weights_only_loads() replaces it for a block


def trusted_load(f, *args, **kwargs):
    """The one way the project loads a torch file (DeepSpeed's through :func:`weights_only_loads`,
    the trainer's ``reference_policy.pt``): ``weights_only=True`` with :func:`allowed_globals`, so a
    pickle that would run code is refused as a :class:`CheckpointError` naming the file, not a raw
    ``UnpicklingError`` traceback."""
    kwargs["weights_only"] = True
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return _TORCH_LOAD(f, *args, **kwargs)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"refusing to load {f}: it holds more than tensors and DeepSpeed's state, and loading it would "
            f"run pickled code ({reason})"
        ) from None


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every ``torch.load`` inside runs as :func:`trusted_load` (DeepSpeed 0.19.8 passes ``weights_only=False``).

    Scoped to the ``with`` block (a resume's ``engine.load_checkpoint``): torch's restricted
    unpickler builds tensors, containers and the :func:`allowed_globals` only, so no pickled
    ``__reduce__`` runs. A file that needs anything else is refused with its path.
    """
    original = torch.load
    torch.load = trusted_load
    try:
        yield
    finally:
        torch.load = original


_HARDENED = "# ds_tree: checkpoints load with weights_only=True"


def harden_recovery_scripts(directory: Path) -> None:
    """DeepSpeed copies ``zero_to_fp32.py`` (which loads with ``weights_only=False``) beside the
    checkpoints: rewrite it to load with ``weights_only=True`` and DeepSpeed's two state classes."""
    script = directory / "zero_to_fp32.py"
    if script.is_symlink():  # not DeepSpeed's copy: never read or written through (save() removes it)
        return
    try:
        text = script.read_text()
    except OSError:
        return
    anchor = "from deepspeed.utils import logger\n"
    if _HARDENED in text or anchor not in text:
        return
    allow = (
        f"{anchor}{_HARDENED} (ds_tree/run/checkpoint.py); DeepSpeed's state classes are allowed by name.\n"
        "from deepspeed.runtime.fp16.loss_scaler import LossScaler  # noqa: E402\n"
        "from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402\n"
        "torch.serialization.add_safe_globals([ZeroStageEnum, LossScaler])\n"
    )
    text = text.replace(anchor, allow, 1).replace("weights_only=False", "weights_only=True")
    try:
        write_text_atomically(script, text)
    except OSError as error:  # the checkpoint itself is complete: say so, and go on
        logger.warning("%s still loads with weights_only=False: rewriting it failed (%s)", script, error)


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


def prune(directory: Path, keep_last: int, newest_step: int, keep: Collection[str] = ()) -> None:
    """Delete complete checkpoints at or below ``newest_step`` beyond the newest ``keep_last``, but those
    named in ``keep``.

    Checkpoints above ``newest_step`` (written by an earlier run that got further than the one
    this run resumed from) and anything that is not a complete checkpoint are left alone.
    """
    candidates = [tag for tag in complete_tags(directory) if step_of(tag) <= newest_step]
    for tag in (tag for tag in candidates[:-keep_last] if tag not in keep):
        shutil.rmtree(directory / tag, ignore_errors=True)
