"""Line-by-line JSONL reading (plain or gzip) with errors that name ``file:line``."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from ds_tree.trees.trajectory import DataError


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Yield ``("file:line", object)`` for every non-blank line; bad JSON raises :class:`DataError`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: malformed JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record
