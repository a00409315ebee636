"""A run's metrics.jsonl read back: its records with their line numbers, and the checks that name the file, line
and field of a bad one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


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
        if name not in record:
            raise ValueError(f"{where}: the record has no {name!r}")
        value = record[name]
        if value is None:  # metrics.jsonl writes null for a value that was not finite
            raise ValueError(f"{where}: {name} is null: the run logged a value that was not finite (NaN or inf)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: {name} must be a number, got {value!r}")
