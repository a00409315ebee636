"""Records from Arrow inputs, streamed: Parquet files and Hugging Face ``datasets`` folders (``save_to_disk``).

``ds-tree convert`` reads the same record formats from these as from JSONL (one record a row, the columns its
fields). Neither is held whole: a Parquet file is read a batch of rows at a time (``ParquetFile.iter_batches``),
a datasets folder is memory-mapped by ``load_from_disk`` and iterated in Arrow batches. A row is named
``PATH:row N`` (0-based, as ``dataset[N]``) in errors. A field that is null in a row is left out of its record
(Arrow gives every row every column, and a struct every field: a message without ``tool_calls`` comes as
``"tool_calls": None``), so a null means "absent", as a missing JSON key does. Columns are read as stored:
``datasets`` features such as ``Image`` are not decoded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from ds_tree.data.tree_dataset import META_FILE
from ds_tree.errors import DataError

BATCH_ROWS = 256
"""Rows decoded into Python records at a time."""
DATASET_STATE = "state.json"
"""What ``Dataset.save_to_disk`` writes beside its Arrow files (a ``DatasetDict`` writes ``dataset_dict.json``)."""


def is_arrow_input(path: Path) -> bool:
    """Whether ``path`` is read by this module (a ``.parquet`` file or a directory) rather than as JSONL."""
    return path.suffix == ".parquet" or path.is_dir()


def read_arrow_records(path: Path) -> Iterator[tuple[str, dict]]:
    """``(PATH:row N, record)`` for every row of a Parquet file or a datasets folder (module docstring)."""
    batches = _dataset_batches(path) if path.is_dir() else _parquet_batches(path)
    number = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield f"{path}:row {number}", _without_nulls(row)
            number += 1


def _parquet_batches(path: Path) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        yield from pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
    except (OSError, pa.ArrowException) as error:
        raise DataError(f"{path}: not a readable Parquet file ({type(error).__name__}: {error})") from None


def _dataset_batches(path: Path) -> Iterator[pa.Table]:
    from datasets import load_from_disk

    if (path / META_FILE).is_file():
        raise DataError(f"{path}: already a converted tree dataset (train on it: data.path={path})")
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{path}: a DatasetDict of splits {', '.join(splits)}: give one split's folder ({path}/SPLIT)")
    if not (path / DATASET_STATE).is_file():
        raise DataError(
            f"{path}: a directory that is not a datasets folder (no {DATASET_STATE}, which Dataset.save_to_disk "
            "writes); give the JSONL or Parquet files in it"
        )
    try:
        dataset = load_from_disk(str(path))
    except (OSError, ValueError, pa.ArrowException) as error:
        raise DataError(f"{path}: damaged datasets folder ({type(error).__name__}: {error})") from None
    yield from dataset.with_format("arrow").iter(batch_size=BATCH_ROWS)


def _without_nulls(value: object) -> object:
    """``value`` with every null-valued key of every dict in it left out (lists keep their nulls: per-token
    log-probs mark tokens not sampled with them)."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value
