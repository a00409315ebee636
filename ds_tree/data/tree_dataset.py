"""Converted tree datasets on disk: a Hugging Face ``datasets.Dataset``, one row per tree (group).

Columns: ``group_id`` (string; ``integer_group_id``, bool, marks the rows whose id was an integer,
kept apart from the string of its digits; without that column every id is a string), ``input_ids``
(list of int32 lists, one per trajectory), ``loss_mask`` (list of float32 lists, or float64 when a
mask value is not exactly a float32, so masks always round-trip bit for bit), ``reward`` (list of
float64, null when missing), ``trial`` (list of int64, -1 when missing), ``logprobs`` and
``advantages`` (list of float64 lists, a null list for a trajectory without them; NaN log-probs mark
tokens not sampled). Beside it, ``ds_tree_meta.json`` records the format version, the tokenizer
identity and the counts (groups, trajectories, flat and tree tokens, skipped lines). Version 1
datasets, written before the rollout columns existed, still load (their trajectories have neither).

One row per tree keeps a group together for the packer (a tree is never split across workers by
accident) and stores trajectories rather than the trie: the trie is rebuilt on load in seconds
and the stored form stays readable by anything that reads Arrow.

Writing goes to a hidden sibling directory that is renamed into place at the end, so a failed or
interrupted run never leaves a partial dataset at the output path.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from ds_tree.atomic import replace_directory
from ds_tree.data.jsonl import json_text
from ds_tree.data.records import group_id as group_id_of
from ds_tree.errors import DataError
from ds_tree.trees.images import TrajectoryImage
from ds_tree.trees.stats import token_counts
from ds_tree.trees.trajectory import Trajectory, group_trajectories

FORMAT_VERSION = 2
IMAGES_FORMAT_VERSION = 3
"""Written when the trajectories hold images (older readers must refuse such a dataset, not drop its images)."""
READABLE_VERSIONS = (1, 2, 3)
META_FILE = "ds_tree_meta.json"
IMAGES_FILE = "ds_tree_images.npz"
"""Each distinct image once (by identity): keys, grids, merge sizes and the processed pixels, concatenated."""
IMAGE_COLUMNS = ("image_keys", "image_index")
"""Per trajectory: the keys of its images in order, and per token its image (-1 text); null without images."""
ROLLOUT_COLUMNS = ("logprobs", "advantages")
"""The per-token RL columns, new in format version 2."""
COLUMNS = ("group_id", "input_ids", "loss_mask", "reward", "trial", *ROLLOUT_COLUMNS)
SCALAR_COLUMNS = ("group_id", "reward", "trial")
"""Columns with one value per trajectory (the group id: one per row); the others hold one list per trajectory."""


def _features(mask_dtype: str, with_images: bool = False):
    from datasets import Features, List, Value

    images = {"image_keys": List(List(Value("string"))), "image_index": List(List(Value("int32")))}
    return Features(
        {
            **(images if with_images else {}),
            "group_id": Value("string"),
            "integer_group_id": Value("bool"),
            "input_ids": List(List(Value("int32"))),
            "loss_mask": List(List(Value(mask_dtype))),
            "reward": List(Value("float64")),
            "trial": List(Value("int64")),
            **{name: List(List(Value("float64"))) for name in ROLLOUT_COLUMNS},
        }
    )


def dataset_counts(trajectories: list[Trajectory]) -> dict:
    """Group, trajectory and token counts of what a dataset holds (trees merged by group)."""
    groups = group_trajectories(trajectories)
    counts = [token_counts(group, merge="group") for group in groups]  # one group's trees at a time
    return {
        "groups": len(groups),
        "trajectories": len(trajectories),
        "flat_tokens": sum(count.flat_tokens for count in counts),
        "tree_tokens": sum(count.tree_tokens for count in counts),
    }


DATASET_FILE = re.compile(
    rf"^(data-\d+-of-\d+\.arrow|dataset_info\.json|state\.json|{re.escape(META_FILE)}|{re.escape(IMAGES_FILE)})$"
)
"""The files of a dataset :func:`save_tree_dataset` writes (``datasets``' Arrow shards and their
descriptions, and the meta file): ``--overwrite`` replaces a directory holding only these."""


def is_tree_dataset_dir(path: Path) -> bool:
    """Whether ``path`` is a directory written by :func:`save_tree_dataset`: a meta file, and nothing
    but the files such a directory holds (no folder, no link, no file of anything else)."""
    if path.is_symlink() or not path.is_dir() or not (path / META_FILE).is_file():
        return False
    return all(DATASET_FILE.match(item.name) and item.is_file() and not item.is_symlink() for item in path.iterdir())


def check_output_dir(output_dir: Path, overwrite: bool, inputs: tuple[Path, ...] | list[Path] = ()) -> None:
    """Where a dataset may be written; converters call it before working.

    Refused: an output that is one of ``inputs`` or holds one (resolved, links followed), the
    current directory or one holding it, an existing file, a folder that cannot be written, and an
    existing non-empty directory unless ``overwrite`` and it is a dataset this module wrote
    (:func:`is_tree_dataset_dir`): ``--overwrite`` never deletes anything else.
    """
    resolved = output_dir.resolve()
    for source in inputs:
        source_path = Path(source).resolve()
        if source_path == resolved or resolved in source_path.parents:
            what = "is" if source_path == resolved else "holds"
            raise DataError(f"--output {output_dir}: {what} the input {source}; write the dataset elsewhere")
    here = Path.cwd().resolve()
    if resolved == here or resolved in here.parents:
        raise DataError(
            f"--output {output_dir}: is the current directory or holds it, which the dataset would replace; "
            "give the name of a new directory"
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir}: exists and is not a directory (the output is a dataset directory)")
    if output_dir.is_dir() and any(output_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{output_dir}: exists and is not empty (pass --overwrite to replace it)")
        if not is_tree_dataset_dir(output_dir):
            raise FileExistsError(
                f"{output_dir}: exists and is not a dataset written by ds-tree convert (it holds other files); "
                "--overwrite replaces only such a dataset: choose another --output, or empty it yourself"
            )
    existing = resolved.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise DataError(f"--output {output_dir}: cannot be created ({existing} is not a directory)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise DataError(f"--output {output_dir}: cannot be written ({existing}: {error.strerror})") from None


def save_tree_dataset(
    trajectories: list[Trajectory],
    output_dir: str | Path,
    meta: dict,
    overwrite: bool = False,
    inputs: tuple[Path, ...] | list[Path] = (),
) -> dict:
    """Write ``trajectories`` as a tree dataset; returns the meta dict written beside it.

    ``meta`` is merged into ``ds_tree_meta.json`` (tokenizer identity, skip counts, options);
    counts and the format version are added here. Refuses what :func:`check_output_dir` refuses
    (``inputs``: the files the dataset was made from, never written over).
    """
    from datasets import Dataset, DatasetInfo
    from datasets.table import InMemoryTable

    output_dir = Path(output_dir).resolve()  # "." and "dir/.." name a directory by its real name
    check_output_dir(output_dir, overwrite, inputs)
    if not trajectories:
        raise DataError(f"{output_dir}: nothing to write (no trajectories)")
    top = max(int(t.input_ids.max()) for t in trajectories)
    if top > np.iinfo(np.int32).max:
        raise DataError(f"token id {top} does not fit the int32 input_ids column")
    masks_fit_float32 = all(np.array_equal(t.loss_mask.astype(np.float32), t.loss_mask) for t in trajectories)
    mask_dtype = "float32" if masks_fit_float32 else "float64"

    with_images = any(t.images for t in trajectories)
    features = _features(mask_dtype, with_images)
    groups = group_trajectories(trajectories)
    table = pa.Table.from_batches(
        [_record_batch(batch, features, mask_dtype) for batch in _write_batches(groups)], features.arrow_schema
    )
    full_meta = {
        "format_version": IMAGES_FORMAT_VERSION if with_images else FORMAT_VERSION,
        "loss_mask_dtype": mask_dtype,
        "counts": dataset_counts(trajectories),
        **meta,
    }
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = output_dir.parent / f".{output_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        Dataset(InMemoryTable(table), info=DatasetInfo(features=features)).save_to_disk(str(temporary))
        if with_images:
            save_images(trajectories, temporary / IMAGES_FILE)
        (temporary / META_FILE).write_text(json_text(full_meta, indent=2) + "\n")
        replace_directory(temporary, output_dir)  # the old output aside, the new one in, the old one deleted
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return full_meta


WRITE_BATCH_GROUPS = 1024
WRITE_BATCH_TOKENS = 1 << 28
"""A record batch holds at most this many groups, or tokens (Arrow's int32 list offsets end at 2**31)."""


def _write_batches(groups: list[list[Trajectory]]) -> Iterator[list[list[Trajectory]]]:
    batch, tokens = [], 0
    for group in groups:
        size = sum(len(t) for t in group)
        if batch and (len(batch) == WRITE_BATCH_GROUPS or tokens + size > WRITE_BATCH_TOKENS):
            yield batch
            batch, tokens = [], 0
        batch.append(group)
        tokens += size
    if batch:
        yield batch


def _record_batch(groups: list[list[Trajectory]], features, mask_dtype: str) -> pa.RecordBatch:
    """One row per group, built from the trajectories' numpy arrays and Arrow offsets (no Python list per
    token: ``Dataset.from_dict`` took about 70 bytes a token more at its peak)."""
    schema = features.arrow_schema
    counts = [len(group) for group in groups]
    trajectories = [t for group in groups for t in group]

    def per_trajectory(name: str, values: list) -> pa.Array:
        kind = schema.field(name).type
        return _lists(counts, pa.array(values, type=kind.value_type), kind)

    def per_token(name: str, arrays: list[np.ndarray | None], dtype) -> pa.Array:
        kind = schema.field(name).type
        inner = _nested_values(arrays, dtype, kind.value_type)
        return _lists(counts, inner, kind)

    columns = {
        "group_id": pa.array([str(group[0].group_id) for group in groups], pa.string()),
        "integer_group_id": pa.array([isinstance(group[0].group_id, int) for group in groups], pa.bool_()),
        "input_ids": per_token("input_ids", [t.input_ids for t in trajectories], np.int32),
        "loss_mask": per_token("loss_mask", [t.loss_mask for t in trajectories], mask_dtype),
        "reward": per_trajectory("reward", [t.reward for t in trajectories]),
        "trial": per_trajectory("trial", [-1 if t.trial is None else t.trial for t in trajectories]),
        **{name: per_token(name, [getattr(t, name) for t in trajectories], np.float64) for name in ROLLOUT_COLUMNS},
    }
    if "image_keys" in schema.names:
        columns["image_keys"] = per_trajectory(
            "image_keys", [[image.key for image in t.images] if t.images else None for t in trajectories]
        )
        columns["image_index"] = per_token(
            "image_index", [t.image_index if t.images else None for t in trajectories], np.int32
        )
    return pa.RecordBatch.from_arrays([columns[name] for name in schema.names], schema=schema)


def _offsets(lengths: list[int] | np.ndarray) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32))


def _lists(counts: list[int], values: pa.Array, kind: pa.DataType) -> pa.Array:
    """Row ``r`` is the next ``counts[r]`` entries of ``values``."""
    return pa.ListArray.from_arrays(_offsets(counts), values, type=kind)


def _nested_values(arrays: list[np.ndarray | None], dtype, kind: pa.DataType) -> pa.Array:
    """One list per array (a null list for None) of ``arrays`` cast to ``dtype``."""
    present = [array for array in arrays if array is not None]
    values = np.concatenate([np.asarray(a, dtype=dtype) for a in present]) if present else np.zeros(0, dtype)
    lengths = [0 if array is None else array.size for array in arrays]
    nulls = pa.array([array is None for array in arrays]) if len(present) < len(arrays) else None
    return pa.ListArray.from_arrays(_offsets(lengths), pa.array(values, type=kind.value_type), type=kind, mask=nulls)


def save_images(trajectories: list[Trajectory], path: Path) -> None:
    """Each distinct image of ``trajectories`` once, in order of first appearance (:data:`IMAGES_FILE`)."""
    distinct = {}
    for trajectory in trajectories:
        for image in trajectory.images:
            distinct.setdefault(image.key, image)
    images = list(distinct.values())
    np.savez(
        path,
        keys=np.array([image.key for image in images]),
        grids=np.array([image.grid_thw for image in images], dtype=np.int64),
        merge_sizes=np.array([image.merge_size for image in images], dtype=np.int64),
        offsets=np.cumsum([0] + [image.pixel_values.shape[0] for image in images]),
        pixels=np.concatenate([image.pixel_values for image in images]),
    )


def load_images(dataset_dir: Path) -> dict[str, TrajectoryImage]:
    """The images of a dataset by key, each checked against its key (a changed pixel is a damaged file)."""
    path = dataset_dir / IMAGES_FILE
    if not path.is_file():
        raise DataError(f"{dataset_dir}: the dataset has image columns but no {IMAGES_FILE}")
    try:
        with np.load(path, allow_pickle=False) as stored:
            fields = {name: stored[name] for name in ("keys", "grids", "merge_sizes", "offsets", "pixels")}
    except (OSError, ValueError, KeyError) as error:
        raise DataError(f"{path}: damaged images file ({type(error).__name__}: {error})") from None
    images = {}
    for index, key in enumerate(fields["keys"].tolist()):
        start, end = fields["offsets"][index], fields["offsets"][index + 1]
        try:  # a dataset written before non-finite pixels were refused, or a damaged one
            image = TrajectoryImage.of(
                fields["pixels"][start:end], fields["grids"][index], int(fields["merge_sizes"][index])
            )
        except DataError as error:
            raise DataError(f"{path}: image {index}: {error} (convert the data again)") from None
        if image.key != key:
            raise DataError(f"{path}: image {index} does not match its key (damaged file)")
        images[key] = image
    return images


def read_meta(dataset_dir: str | Path) -> dict:
    """The ``ds_tree_meta.json`` of a tree dataset, checked for the format version."""
    path = Path(dataset_dir) / META_FILE
    if not path.is_file():
        raise DataError(f"{dataset_dir}: not a tree dataset (no {META_FILE}; write one with tools/convert.py)")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise DataError(f"{path}: damaged meta file ({type(error).__name__}: {error})") from None
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise DataError(
            f"{path}: format_version {meta.get('format_version')!r}, this code reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    return meta


class _NestedLists:
    """A list<list<x>> column (one list per trajectory, grouped by row) read through Arrow offsets.

    Reading offsets and value buffers instead of Python lists keeps loading at numpy speed.
    """

    def __init__(self, column: pa.ChunkedArray) -> None:
        outer = column.combine_chunks()
        inner = outer.flatten()
        self.rows = outer.offsets.to_numpy() - outer.offsets[0].as_py()
        self.lists = inner.offsets.to_numpy()  # into inner.values (a null list may still span values)
        self.values = inner.values.to_numpy(zero_copy_only=False)
        self.valid = inner.is_valid().to_numpy(zero_copy_only=False)

    def count(self, row: int) -> int:
        """How many lists row ``row`` holds."""
        return int(self.rows[row + 1] - self.rows[row])

    def get(self, row: int, j: int) -> np.ndarray | None:
        """List ``j`` of row ``row`` as a numpy view, ``None`` where it is null."""
        k = self.rows[row] + j
        return self.values[self.lists[k] : self.lists[k + 1]] if self.valid[k] else None


def open_table(dataset_dir: Path, meta: dict) -> pa.Table:
    """The dataset's Arrow table as ``datasets.load_from_disk`` opens it (its files memory-mapped: nothing is
    read until a row is), its columns checked against the format version."""
    from datasets import load_from_disk

    try:
        table = load_from_disk(str(dataset_dir)).data.table
    except (OSError, ValueError, pa.ArrowException) as error:  # a truncated or corrupt Arrow file
        raise DataError(f"{dataset_dir}: damaged dataset ({type(error).__name__}: {error})") from None
    missing = [name for name in required_columns(meta) if name not in table.column_names]
    if missing:
        raise DataError(f"{dataset_dir}: missing column(s) {', '.join(missing)}")
    return table


def required_columns(meta: dict) -> list[str]:
    """The columns a dataset of ``meta``'s version holds (version 1: no rollout columns)."""
    version_1 = meta["format_version"] == 1
    return [name for name in COLUMNS if not (version_1 and name in ROLLOUT_COLUMNS)]


def table_groups(
    table: pa.Table, rows: Sequence[int], dataset_dir: Path, meta: dict, images: dict[str, TrajectoryImage] | None
) -> list[list[Trajectory]]:
    """The trajectories of every row of ``table`` (a dataset's table, or the rows ``rows`` taken from it,
    which name them in errors and sources: ``DIR:row R:trajectory j``), validated; ``images``: the dataset's
    (:func:`load_images`), None for a dataset without images."""
    required = required_columns(meta)
    per_token = {name: _NestedLists(table.column(name)) for name in required if name not in SCALAR_COLUMNS}
    if images is not None:
        image_keys = table.column("image_keys").to_pylist()
        image_index = _NestedLists(table.column("image_index"))
    group_ids = table.column("group_id").to_pylist()
    if "integer_group_id" in table.column_names:  # written since integer ids are kept apart from strings
        marks = table.column("integer_group_id").to_pylist()
        group_ids = [int(v) if mark and v is not None else v for v, mark in zip(group_ids, marks, strict=True)]
    rewards = table.column("reward").to_pylist()
    trials = table.column("trial").to_pylist()
    groups = []
    for index, (row, group_id) in enumerate(zip(rows, group_ids, strict=True)):
        where = f"{dataset_dir}:row {row}"
        count = len(trials[index])
        if {len(rewards[index]), *(column.count(index) for column in per_token.values())} != {count}:
            raise DataError(f"{where}: the columns {', '.join(required[1:])} hold different numbers of trajectories")
        group = []
        for j in range(count):
            reward, trial = rewards[index][j], trials[index][j]
            extra = {}
            if images is not None and image_keys[index][j]:
                missing_keys = [key for key in image_keys[index][j] if key not in images]
                if missing_keys:
                    raise DataError(f"{where}:trajectory {j}: image {missing_keys[0]} is not in {IMAGES_FILE}")
                extra = {
                    "images": tuple(images[key] for key in image_keys[index][j]),
                    "image_index": image_index.get(index, j),
                }
            group.append(
                Trajectory(
                    group_id=group_id_of(where, group_id),
                    reward=None if reward is None or math.isnan(reward) else reward,
                    trial=None if trial < 0 else trial,
                    source=f"{where}:trajectory {j}",
                    **{name: column.get(index, j) for name, column in per_token.items()},
                    **extra,
                )
            )
        groups.append(group)
    return groups


def dataset_images(dataset_dir: Path, meta: dict) -> dict[str, TrajectoryImage] | None:
    """The dataset's images by key (:func:`load_images`), None for a dataset without images."""
    return load_images(dataset_dir) if meta["format_version"] >= IMAGES_FORMAT_VERSION else None


def check_count(dataset_dir: Path, meta: dict, found: int) -> None:
    expected = meta["counts"]["trajectories"]
    if found != expected:
        raise DataError(f"{dataset_dir}: holds {found} trajectories, its meta file says {expected}")


def load_tree_dataset(dataset_dir: str | Path) -> list[Trajectory]:
    """All trajectories of a tree dataset, validated, with ``source`` = ``DIR:row R:trajectory j`` (read whole:
    :class:`~ds_tree.data.dataset_reader.TreeDatasetReader` reads a step's groups only)."""
    dataset_dir = Path(dataset_dir)
    meta = read_meta(dataset_dir)
    table = open_table(dataset_dir, meta)
    groups = table_groups(table, range(table.num_rows), dataset_dir, meta, dataset_images(dataset_dir, meta))
    trajectories = [trajectory for group in groups for trajectory in group]
    check_count(dataset_dir, meta, len(trajectories))
    return trajectories
