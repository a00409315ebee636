"""What the commands share: a parser whose ``--help`` shows the command's plain-text description,
and the checks of an output path that run before any work is done (no command writes over one of
its inputs: :func:`check_not_input`)."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``; anything else is a usage error (exit 2) naming the
    option, never a number reinterpreted (``--limit -1`` dropping the last trajectory, ``0`` a default)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


POSITIVE_INT = int_at_least(1)
NON_NEGATIVE_INT = int_at_least(0)


def finite_float(text: str) -> float:
    """An argparse ``type``: a finite number (``inf`` and ``nan`` are usage errors naming the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _unwritable_folder(path: Path, folder: Path) -> str | None:
    """Why no file (``path``) can be created in the existing directory ``folder`` (tried with a temporary
    file removed at once), or ``None``."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return f"{path}: cannot write in {folder} ({error.strerror or error})"
    return None


def _unwritable_file(path: Path) -> str | None:
    """Why the existing file ``path`` cannot be written over, or ``None``."""
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path}: cannot be written (no permission)"
    return None


def command_parser(prog: str | None, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """A command's parser: ``description`` (and ``epilog``) printed as written, after the usage line."""
    return argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def output_file_problem(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (an existing directory, or a folder that does not
    exist), or ``None``: checked before a command spends its time on what it would write there."""
    if path.is_dir():
        return f"{path}: is a directory; give a file name"
    folder = path.parent
    if not folder.exists():
        return f"{path}: no such directory {str(folder)!r}"
    if not folder.is_dir():
        return f"{path}: {folder} is not a directory"
    return _unwritable_file(path) or _unwritable_folder(path, folder)


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name the same file or directory: equal once resolved (symlinks
    followed), or one file under two names (a hard link)."""
    a, b = Path(a), Path(b)
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        return False


def input_problem(path: Path, inputs: Iterable[str | Path | None]) -> str | None:
    """Why ``path`` may not be written: it is one of ``inputs`` (:func:`same_path`); ``None`` otherwise."""
    for source in inputs:
        if source is not None and str(source) and same_path(path, source):
            return f"{path}: is the input {source}; write the output elsewhere"
    return None


def check_not_input(
    parser: argparse.ArgumentParser, option: str, path: Path | None, inputs: Iterable[str | Path | None]
) -> None:
    """A usage error (exit 2) where the output ``path`` of ``option`` is one of the command's
    ``inputs`` (resolved, links followed): no command writes over what it reads."""
    problem = path is not None and input_problem(path, inputs)
    if problem:
        parser.error(f"{option} {problem}")


def check_output_file(
    parser: argparse.ArgumentParser,
    path: Path,
    inputs: Iterable[str | Path | None] = (),
    overwrite: bool = True,
    option: str = "--output",
) -> None:
    """A usage error (exit 2) on ``option`` where no file can be written at ``path``
    (:func:`output_file_problem`), where it is one of ``inputs``, or, unless ``overwrite``, where a
    file is there already."""
    problem = output_file_problem(path) or input_problem(path, inputs)
    if not problem and not overwrite and (path.exists() or path.is_symlink()):
        problem = f"{path}: exists (pass --overwrite to replace it)"
    if problem:
        parser.error(f"{option} {problem}")


def output_plot_problem(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` once its missing folders are created (an existing
    directory, an ancestor that is a file, a folder that cannot be written), or ``None``."""
    if path.is_dir():
        return f"{path}: is a directory; give a file name"
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{path}: {ancestor} is not a directory"
    return _unwritable_file(path) or _unwritable_folder(path, ancestor)


def output_folder_problem(
    path: Path, owned: Callable[[Path], bool], command: str, overwrite: bool = True
) -> str | None:
    """Why a command may not write its output folder at ``path`` (replacing what is there), or ``None``:
    a file at ``path``, a folder that cannot be created or written (``/proc/x``), an existing non-empty
    folder that this command did not write (``owned(path)`` false: a model, a dataset, another tool's
    files, a repository folder) and, unless ``overwrite``, any existing non-empty folder."""
    if path.exists() and not path.is_dir():
        return f"{path}: exists and is not a directory"
    if path.is_dir() and any(path.iterdir()):
        if not owned(path):
            return (
                f"{path}: exists and holds files that {command} did not write (it replaces only its own output); "
                "choose a new folder, or empty it yourself"
            )
        if not overwrite:
            return f"{path}: exists (pass --overwrite to replace it)"
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{path}: {ancestor} is not a directory"
    folders = (path, ancestor) if path.is_dir() else (ancestor,)  # written in, and beside (a temporary sibling)
    return next(filter(None, (_unwritable_folder(path, folder) for folder in folders)), None)


def check_output_path(parser: argparse.ArgumentParser, path: Path | None, option: str) -> None:
    """A usage error (exit 2) on ``option`` where ``path`` (its missing folders created) cannot be written:
    checked before a command spends its time on what it would write there."""
    problem = path is not None and output_plot_problem(path)
    if problem:
        parser.error(f"{option} {problem}")
