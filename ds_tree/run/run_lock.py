"""One run per output directory: an exclusive lock on ``<output_dir>/.ds_tree.lock``.

Rank 0 of a run takes it (``fcntl.flock``, exclusive, non-blocking) before the run writes
anything into the directory and keeps it until the process ends; the other ranks follow rank 0
(it chooses the checkpoint they resume from and tells them, :func:`ds_tree.run.checkpoint.agree`).
The lock file records the holder (host, pid, start time) for the error a second run gets.

- Released on exit: the kernel drops a ``flock`` when its last descriptor closes, so a run that
  is killed (SIGKILL included) leaves no lock, only a file whose record is stale. Processes that a
  rank forks close their copy of the descriptor (``os.register_at_fork``), so none keeps the lock
  after the rank is gone.
- Stale holders: a lock that is held while its record names a pid on this host that no longer
  runs (a probe between two runs, or a process that inherited the descriptor) is tried again for a
  moment before it is reported, with the pid named as not running.
- A filesystem without ``flock`` (some parallel filesystems unless mounted with ``-o flock``) gets a
  warning and no lock. On NFS, Linux emulates ``flock`` with byte-range locks across clients.
- A dry run only probes (:func:`holder`): it creates nothing and leaves no lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

from ds_tree.errors import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = ".ds_tree.lock"
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
_RETRIES = 40  # x 50 ms: how long a lock held under a stale record is tried again before it is reported

_held: dict[str, tuple[int, int]] = {}
"""Locks this process holds: resolved output_dir -> (descriptor, references)."""


def _close_in_child() -> None:
    # A forked child closes its copies without unlocking: the lock stays with the parent alone.
    for descriptor, _ in _held.values():
        try:
            os.close(descriptor)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _key(output_dir: Path) -> str:
    return str(Path(output_dir).resolve())


def _read_record(path: Path) -> dict:
    try:
        line = path.read_text().split("\n", 1)[0]
        record = json.loads(line)
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


def _pid_running(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _stale(record: dict) -> bool:
    """The record names no holder, or one on this host that is not running."""
    if not record:
        return True
    return record.get("host") == socket.gethostname() and not _pid_running(record.get("pid"))


def _describe(path: Path, record: dict) -> str:
    if not record:
        return f"by a process that left no record in {path}"
    pid, host = record.get("pid"), record.get("host")
    where = f"pid {pid} on host {host}"
    if record.get("started"):
        where += f", started {record['started']}"
    if _stale(record):
        where += (
            "; that pid is not running on this host, so a process it started may still hold the lock "
            f"(find it with: fuser -v {path})"
        )
    return where


def busy_error(output_dir: Path, record: dict) -> ConfigError:
    path = Path(output_dir) / LOCK_FILE
    return ConfigError(
        f"output_dir: {output_dir} is in use by another run ({_describe(path, record)}; lock file {path}). "
        "Two runs on one output_dir would corrupt its checkpoints: wait for that run to end or stop it, "
        "or choose another output_dir"
    )


def _unsupported(output_dir: Path, error: OSError) -> None:
    logger.warning(
        "output_dir: %s: this filesystem does not support flock (%s): the directory is not locked, so "
        "nothing stops a second run from using it at the same time",
        output_dir,
        error.strerror,
    )


def acquire(output_dir: str | Path) -> bool:
    """Lock ``output_dir`` (created if missing) for this process; a :class:`ConfigError` naming the
    holder if another run has it. True when locked (or already locked by this process)."""
    output_dir = Path(output_dir)
    key = _key(output_dir)
    if key in _held:
        descriptor, references = _held[key]
        _held[key] = (descriptor, references + 1)
        return True
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_FILE
    if path.is_symlink():  # the lock writes its holder into the file: never through a link to one elsewhere
        raise ConfigError(
            f"{path}: a symbolic link (to {os.readlink(path)}); the run writes its lock file itself, never through "
            "a link: remove it"
        )
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        for attempt in range(_RETRIES + 1):
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in _BUSY:
                    _unsupported(output_dir, error)
                    os.close(descriptor)
                    return False
                record = _read_record(path)
                if not _stale(record) or attempt == _RETRIES:
                    raise busy_error(output_dir, record) from None
                time.sleep(0.05)
        started = datetime.now(UTC).isoformat(timespec="seconds")
        line = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}) + "\n"
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, line.encode(), 0)
    except BaseException:
        os.close(descriptor)
        raise
    _held[key] = (descriptor, 1)
    return True


def release(output_dir: str | Path) -> None:
    """Drop one reference to this process's lock of ``output_dir``; the last one unlocks it."""
    key = _key(Path(output_dir))
    if key not in _held:
        return
    descriptor, references = _held.pop(key)
    if references > 1:
        _held[key] = (descriptor, references - 1)
        return
    try:
        os.ftruncate(descriptor, 0)  # no record of a holder that is gone
    except OSError:
        pass
    os.close(descriptor)  # closing the last descriptor releases the flock


def held(output_dir: str | Path) -> bool:
    """Whether this process holds the lock of ``output_dir``."""
    return _key(Path(output_dir)) in _held


def holder(output_dir: str | Path) -> dict | None:
    """The record of another process holding ``output_dir``'s lock, or None if it is free.

    Creates nothing: a missing directory or lock file is a free one. Probes with a shared lock
    that is dropped at once, so a dry run leaves no lock behind.
    """
    output_dir = Path(output_dir)
    if held(output_dir):
        return None
    path = output_dir / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in _BUSY:
            return _read_record(path)
        return None
    finally:
        os.close(descriptor)  # also drops the probe's shared lock
    return None


def check_free(output_dir: str | Path) -> None:
    """A :class:`ConfigError` naming the holder if another run holds ``output_dir``."""
    record = holder(output_dir)
    if record is not None:
        raise busy_error(Path(output_dir), record)
