"""A converted dataset read lazily: only the groups a rank needs for a step are materialised.

:func:`~ds_tree.data.tree_dataset.load_tree_dataset` turns a whole dataset into trajectories (numpy arrays and
a Python object per trajectory: about 16 bytes a token resident, fine to some 10M tokens). At scale a rank
needs only its own groups of each step (:mod:`ds_tree.packing.distributed`). :class:`TreeDatasetReader` opens
the dataset as ``datasets.load_from_disk`` does, its Arrow files memory-mapped: opening reads the schema and
the record batches' metadata, not the token columns. :meth:`~TreeDatasetReader.groups` takes the asked rows
(one row per group) out of the mapped table and makes their trajectories; :meth:`~TreeDatasetReader.flat_tokens`
reads only the columns' offsets. What a rank holds is then its step's groups, not the dataset: the mapped
pages it touched are file-backed and clean (the kernel drops them under pressure), and its anonymous memory
does not grow with the dataset (docs/DATA.md, "Reading at scale", measures it).

Group ``r`` is row ``r``: the index :class:`~ds_tree.data.sampler.StepSampler` draws, and the order
``group_trajectories(load_trajectories(path))`` gives (a converted dataset holds each group in one row).
A dataset with images loads its images file whole on the first read (images are not read lazily).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_tree.data.tree_dataset import check_count, dataset_images, open_table, read_meta, table_groups
from ds_tree.errors import DataError
from ds_tree.trees.trajectory import Trajectory


class TreeDatasetReader:
    """A converted dataset (``ds-tree convert``'s output), opened without reading its rows (module docstring)."""

    def __init__(self, dataset_dir: str | Path) -> None:
        self.path = Path(dataset_dir)
        self.meta = read_meta(self.path)
        self.table = open_table(self.path, self.meta)
        column = self.table.column("input_ids")
        self._starts = np.cumsum([0] + [len(chunk) for chunk in column.chunks])
        """The first row of each record batch (chunk) of the table."""
        self._images = None
        trials = self.table.column("trial").chunks  # one entry per trajectory: its offsets count them
        check_count(self.path, self.meta, sum(chunk.offsets[-1].as_py() - chunk.offsets[0].as_py() for chunk in trials))

    @property
    def n_groups(self) -> int:
        return self.table.num_rows

    def _check_rows(self, rows: Sequence[int]) -> list[int]:
        rows = [int(row) for row in rows]
        outside = [row for row in rows if not 0 <= row < self.n_groups]
        if outside:
            raise DataError(f"{self.path}: no group {outside[0]} (the dataset holds {self.n_groups})")
        return rows

    def flat_tokens(self, rows: Sequence[int]) -> np.ndarray:
        """Tokens of every trajectory of each of ``rows``' groups, summed per group, read from the
        ``input_ids`` column's offsets only."""
        rows = np.array(self._check_rows(rows), dtype=np.int64)
        column = self.table.column("input_ids")
        chunk_of = np.searchsorted(self._starts, rows, side="right") - 1
        sizes = np.zeros(rows.size, dtype=np.int64)
        for chunk_index in np.unique(chunk_of):
            here = chunk_of == chunk_index
            chunk, local = column.chunk(int(chunk_index)), rows[here] - self._starts[chunk_index]
            outer = chunk.offsets.to_numpy()  # views of the mapped buffers
            inner = chunk.values.offsets.to_numpy()
            sizes[here] = inner[outer[local + 1]] - inner[outer[local]]
        return sizes

    def groups(self, rows: Sequence[int]) -> list[list[Trajectory]]:
        """The trajectories of the groups ``rows``, validated as :func:`load_tree_dataset` validates them."""
        rows = self._check_rows(rows)
        if self._images is None and "image_keys" in self.table.column_names:
            self._images = dataset_images(self.path, self.meta)
        return table_groups(self._rows(rows), rows, self.path, self.meta, self._images)

    def nbytes(self, rows: Sequence[int]) -> int:
        """The Arrow bytes of ``rows`` (what reading them moves)."""
        return int(self._rows(self._check_rows(rows)).nbytes)

    def max_token_id(self) -> int:
        """The largest token id of the dataset, from the mapped ``input_ids`` values (no row is materialised)."""
        import pyarrow.compute as pc

        column = self.table.column("input_ids")
        tops = [pc.max(chunk.flatten().flatten()).as_py() for chunk in column.chunks if len(chunk)]
        return max((top for top in tops if top is not None), default=0)

    def longest_trajectory(self) -> tuple[int, int]:
        """``(tokens, row)`` of the dataset's longest trajectory, from the ``input_ids`` offsets only."""
        column = self.table.column("input_ids")
        best, where = 0, 0
        for index, chunk in enumerate(column.chunks):
            outer = chunk.offsets.to_numpy()
            inner = chunk.values.offsets.to_numpy()[outer[0] : outer[-1] + 1]
            if inner.size < 2:
                continue
            lengths = np.diff(inner)
            k = int(np.argmax(lengths))
            if lengths[k] > best:  # the row of trajectory k: the last row starting at or before it
                best, where = (
                    int(lengths[k]),
                    int(self._starts[index] + np.searchsorted(outer, outer[0] + k, "right") - 1),
                )
        return best, where

    def batches(self, size: int):
        """Every group of the dataset, ``size`` rows at a time (a check over the whole dataset in bounded memory)."""
        for start in range(0, self.n_groups, size):
            yield self.groups(range(start, min(start + size, self.n_groups)))

    def _rows(self, rows: list[int]):
        """The table of ``rows``, in order, as zero-copy slices of the mapped table (``Table.take`` of nested
        lists cost 0.15 s a call on a 23M-token table, whatever the rows)."""
        import pyarrow as pa

        return pa.concat_tables([self.table.slice(row, 1) for row in rows]) if rows else self.table.slice(0, 0)


@dataclass
class LoadedGroups:
    """Groups held in memory (a tokens JSONL loaded whole), read as :class:`TreeDatasetReader` reads its rows."""

    by_row: Sequence[Sequence[Trajectory]]
    """The data's groups, by group index."""

    @property
    def n_groups(self) -> int:
        return len(self.by_row)

    def __len__(self) -> int:
        return len(self.by_row)

    def __getitem__(self, row: int) -> Sequence[Trajectory]:
        return self.by_row[row]

    def flat_tokens(self, rows: Sequence[int]) -> np.ndarray:
        return np.array([sum(len(t) for t in self.by_row[row]) for row in rows], dtype=np.int64)

    def groups(self, rows: Sequence[int]) -> list[list[Trajectory]]:
        return [list(self.by_row[row]) for row in rows]

    def nbytes(self, rows: Sequence[int]) -> int:
        arrays = ("input_ids", "loss_mask", "logprobs", "advantages")
        return sum(
            getattr(t, name).nbytes
            for row in rows
            for t in self.by_row[row]
            for name in arrays
            if getattr(t, name) is not None
        )


@dataclass
class DatasetGroups:
    """One step's groups of a :class:`TreeDatasetReader` (or of :class:`LoadedGroups`), as the step planner reaches them
    (:class:`~ds_tree.packing.distributed.StepUnits`): a unit per distinct group of the step, in order of
    first appearance, its trajectories as many times as the step drew the group (a step that spans two
    epochs may draw a group twice: ``plan_step`` then builds one trie of both copies, and so does this)."""

    reader: TreeDatasetReader | LoadedGroups
    rows: Sequence[int]
    """The step's group indices (:meth:`~ds_tree.data.sampler.StepSampler.groups_for_step`)."""

    def __post_init__(self) -> None:
        counts: dict[int, int] = {}
        for row in self.rows:
            counts[int(row)] = counts.get(int(row), 0) + 1
        self.distinct, self.copies = list(counts), list(counts.values())

    def sizes(self) -> np.ndarray:
        return self.reader.flat_tokens(self.distinct) * np.array(self.copies, dtype=np.int64)

    def read(self, units: Sequence[int]) -> list[list[Trajectory]]:
        groups = self.reader.groups([self.distinct[unit] for unit in units])
        return [group * self.copies[unit] for unit, group in zip(units, groups, strict=True)]

    def nbytes(self, units: Sequence[int]) -> int:
        return self.reader.nbytes([self.distinct[unit] for unit in units])
