"""JSONL files (plain or gzip): reading line by line with errors that name ``file:line``, and
writing atomically."""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from ds_tree.atomic import remove
from ds_tree.errors import DataError, RecordError


def read_jsonl(path: str | Path, keep_going: bool = False) -> Iterator[tuple[str, dict | RecordError]]:
    """Yield ``("file:line", object)`` for every non-blank line.

    A line that is not a JSON object raises a :class:`RecordError`, or with ``keep_going`` is
    yielded as one in place of the object (a generator cannot resume after raising, and
    ``--skip-bad`` must go on past bad lines).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        handle = opener(path, "rb")
    except OSError as error:  # a file without read permission, ...
        raise DataError(f"{path}: cannot be read ({error.strerror or error})") from None
    with handle:  # bytes, decoded line by line: a bad byte names its line
        for number, raw in _lines(path, handle):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            error = None
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as bad:
                error = RecordError(
                    "not_utf8", f"{where}: not UTF-8 text (byte 0x{raw[bad.start]:02x} at byte {bad.start + 1})"
                )
            except json.JSONDecodeError as bad:
                error = RecordError("malformed_json", f"{where}: malformed JSON ({bad.msg} at column {bad.colno})")
            except RecursionError:
                error = RecordError("too_deep", f"{where}: JSON nested too deeply to read (over ~{MAX_DEPTH} levels)")
            if error is None and not isinstance(record, dict):
                error = RecordError("not_an_object", f"{where}: expected a JSON object, got {type(record).__name__}")
            if error is not None and not keep_going:
                raise error
            yield where, error or record


MAX_DEPTH = sys.getrecursionlimit()
"""About how deep Python's ``json`` reads nesting before it raises ``RecursionError``."""


def _lines(path: Path, handle) -> Iterator[tuple[int, bytes]]:
    """``(number, raw line)`` of an open file; a damaged or truncated gzip stream is a :class:`DataError`
    naming the file and the last line read whole, not ``EOFError`` or ``zlib.error``."""
    number = 0
    try:
        for number, raw in enumerate(handle, start=1):
            yield number, raw
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        reason = str(error).strip() or type(error).__name__
        raise DataError(f"{path}: damaged or truncated gzip file after line {number} ({reason})") from None


def finite(value: object) -> object:
    """``value`` with every non-finite float (NaN, infinities) replaced by ``None``, in nested dicts,
    lists and tuples: JSON has no NaN or Infinity, and Python's ``json`` would write them as bare
    ``NaN`` / ``Infinity``, which other readers (and ours) refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def json_text(value: object, **options) -> str:
    """``json.dumps`` for everything ds_tree writes (stdout reports, metrics.jsonl, records, meta
    files): non-finite floats become ``null`` (:func:`finite`), so the output is always valid JSON."""
    return json.dumps(finite(value), allow_nan=False, **options)


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    """Write one compact JSON object a line (gzip when ``path`` ends in ``.gz``).

    The lines go to a hidden sibling file that is renamed into place at the end, so a failed or
    interrupted write never leaves a partial file at ``path``.
    """
    path = Path(path)
    temporary = path.parent / f".{path.name}.partial-{os.getpid()}"
    remove(temporary)  # a leftover, or a link planted under its name: created anew ("x"), never followed
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(temporary, "xt", encoding="utf-8") as handle:
            for record in records:
                handle.write(json_text(record, separators=(",", ":")) + "\n")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def slice_groups(source: str | Path, output: str | Path, groups: int, per_group: int, key: str = "group_id") -> Path:
    """Write the first ``per_group`` lines of each of the first ``groups`` groups of ``source``.

    A slice of real data that keeps its sharing: trials of one task may be interleaved with other
    tasks' (tau2), so the file's first lines alone would be a slice without trees.
    """
    chosen: dict[str, list[dict]] = {}
    for _, record in read_jsonl(source):
        group = record.get(key)
        if group not in chosen and len(chosen) == groups:
            continue
        members = chosen.setdefault(group, [])
        if len(members) < per_group:
            members.append(record)
    return write_jsonl(output, (record for members in chosen.values() for record in members))
