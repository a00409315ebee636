"""Reading trajectories from disk: tokens JSONL files and converted tree datasets."""

from __future__ import annotations

from pathlib import Path

from ds_tree.errors import DataError
from ds_tree.trees.trajectory import Trajectory


def load_trajectories(path: str | Path) -> list[Trajectory]:
    """Trajectories from a tokens JSONL file or a tree dataset directory (``tools/convert.py``)."""
    path = Path(path)
    if path.is_dir():
        from ds_tree.data.tree_dataset import load_tree_dataset

        return load_tree_dataset(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    from ds_tree.data.tokens import read_tokens_jsonl

    return read_tokens_jsonl(path)


__all__ = ["load_trajectories"]
