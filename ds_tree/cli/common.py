"""What the commands share: a parser whose ``--help`` shows the command's plain-text description,
and the checks of an output path that run before any work is done (no command writes over one of
its inputs: :func:`check_not_input`)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path


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
    return None


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
    """Why a figure cannot be saved at ``path`` (an existing directory), or ``None``; a missing
    folder is created when the figure is saved."""
    return f"{path}: is a directory; give a file name" if path.is_dir() else None


def save_figure(figure, path: Path, dpi: int) -> Path:
    """Save a matplotlib figure at exactly ``path``, creating its folder, and return ``path``.

    matplotlib appends ``.png`` to a name without an extension it knows (``plot`` becomes
    ``plot.png``), so the format is given: the suffix's when matplotlib has it (pdf, svg, ...),
    PNG otherwise."""
    suffix = path.suffix.removeprefix(".").lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi, format=suffix if suffix in figure.canvas.get_supported_filetypes() else "png")
    return path


def metrics_records(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` of each non-blank line of a run's metrics.jsonl; a ValueError names the
    file (missing) or the file and line (not UTF-8, malformed JSON, not a JSON object)."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{path}:{number}: not UTF-8 text") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: malformed JSON ({error.msg}; a truncated line?)") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a record must be a JSON object")
        yield number, record


def check_numbers(where: str, record: dict, names) -> None:
    """A ValueError at ``where`` (``file:line``) unless each of ``names`` is a number in ``record``."""
    for name in names:
        value = record.get(name)
        if value is None:
            raise ValueError(f"{where}: the record has no {name!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {name} must be a number, got {value!r}")
