"""Writing files and directories so that a crash never leaves a half-written one in place.

``write_text_atomically`` writes a hidden temporary sibling, fsyncs it and renames it over the
target (a rename within one directory is atomic on POSIX filesystems). ``replace_directory``
moves a fully written directory into place: the old one is renamed aside first, the new one
renamed in, and only then is the old one deleted, so at every moment either the old or the new
directory sits at the target path (or, between the two renames, the old one under its aside name).
Neither writes through a symbolic link: a link at the target is replaced (its target untouched), and
the temporary file is created new (``O_EXCL``), never opened through a link planted under its name.
:func:`remove` deletes a file, a directory or a link (the link only, never what it points to).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_text_atomically(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text``: readers see the old content or the new one, never a part."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    remove(temporary)  # a stale one, or a link planted under its name: created anew, never followed
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def replace_directory(temporary: str | Path, target: str | Path) -> None:
    """Move the finished directory ``temporary`` to ``target``, replacing what is there.

    ``temporary`` must be on the filesystem of ``target`` (a sibling, in practice). A previous
    ``target`` (a directory, or a file) is renamed to a hidden sibling, ``temporary`` renamed to
    ``target``, and the previous one deleted last.
    """
    temporary, target = Path(temporary), Path(target)
    if not target.exists() and not target.is_symlink():
        temporary.rename(target)
        return
    retired = target.with_name(f".{target.name}.replaced-{os.getpid()}")
    remove(retired)
    target.rename(retired)
    try:
        temporary.rename(target)
    except OSError:
        retired.rename(target)  # put the previous one back
        raise
    remove(retired)


def remove(path: str | Path) -> None:
    """Delete ``path`` whatever it is: a directory (with its content), a file, or a symbolic link
    (the link alone: ``shutil.rmtree`` refuses a link, and leaving it would let the next write
    through its name land wherever it points)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
