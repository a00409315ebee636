"""What the commands share: a parser whose ``--help`` shows the command's plain-text description,
and the checks of an output path that run before any work is done."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
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


def check_output_file(parser: argparse.ArgumentParser, path: Path, option: str = "--output") -> None:
    """A usage error (exit 2) on ``option`` where no file can be written at ``path`` (:func:`output_file_problem`)."""
    problem = output_file_problem(path)
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


def check_output_path(parser: argparse.ArgumentParser, path: Path | None, option: str) -> None:
    """A usage error (exit 2) on ``option`` where ``path`` (its missing folders created) cannot be written:
    checked before a command spends its time on what it would write there."""
    problem = path is not None and output_plot_problem(path)
    if problem:
        parser.error(f"{option} {problem}")


def save_figure(figure, path: Path, dpi: int) -> Path:
    """Save a matplotlib figure at exactly ``path``, creating its folder, and return ``path``.

    matplotlib appends ``.png`` to a name without an extension it knows (``plot`` becomes
    ``plot.png``), so the format is given: the suffix's when matplotlib has it (pdf, svg, ...),
    PNG otherwise."""
    suffix = path.suffix.removeprefix(".").lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi, format=suffix if suffix in figure.canvas.get_supported_filetypes() else "png")
    return path
