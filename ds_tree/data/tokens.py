"""The tokens JSONL format: one trajectory a line, already tokenised.

``{"group_id": str, "input_ids": [int], "loss_mask": [number], "reward": number?, "trial": int?}``;
``"labels"`` with ``-100`` for untrained tokens may stand instead of ``loss_mask`` (Hugging Face
style, labels equal to input_ids elsewhere). Trajectories sharing a ``group_id`` form one tree.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ds_tree.data.jsonl import read_jsonl
from ds_tree.errors import DataError
from ds_tree.trees.trajectory import Trajectory

IGNORE_INDEX = -100


INT64_MAX = 2**63 - 1


def _int_list(where: str, record: dict, name: str) -> list[int]:
    values = record.get(name)
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise DataError(f"{where}: field {name!r} must be a list of integers")
    if values and max(abs(v) for v in values) > INT64_MAX:
        raise DataError(f"{where}: field {name!r} has an integer outside the 64-bit range")
    return values


def trajectory_from_record(where: str, record: dict) -> Trajectory:
    """Validate one tokens record and turn it into a :class:`Trajectory`."""
    input_ids = _int_list(where, record, "input_ids")
    if "loss_mask" in record:
        mask = record["loss_mask"]
        if not isinstance(mask, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in mask
        ):
            raise DataError(f"{where}: field 'loss_mask' must be a list of numbers")
    elif "labels" in record:
        labels = _int_list(where, record, "labels")
        if len(labels) != len(input_ids):
            raise DataError(f"{where}: 'labels' has {len(labels)} entries but 'input_ids' has {len(input_ids)}")
        if any(label not in (IGNORE_INDEX, token) for label, token in zip(labels, input_ids, strict=True)):
            raise DataError(f"{where}: 'labels' must equal 'input_ids' or be -100 (labels are not shifted)")
        mask = [float(label != IGNORE_INDEX) for label in labels]
    else:
        raise DataError(f"{where}: missing field 'loss_mask' (or 'labels')")
    group_id = record.get("group_id", "")
    if not isinstance(group_id, str | int) or isinstance(group_id, bool):
        raise DataError(f"{where}: field 'group_id' must be a string")
    reward = record.get("reward")
    if reward is not None and (
        not isinstance(reward, int | float) or isinstance(reward, bool) or not math.isfinite(reward)
    ):
        raise DataError(f"{where}: field 'reward' must be a finite number or null")
    trial = record.get("trial")
    return Trajectory(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        loss_mask=np.asarray(mask, dtype=np.float64),
        group_id=str(group_id),
        reward=None if reward is None else float(reward),
        trial=trial if isinstance(trial, int) else None,
        source=where,
    )


def read_tokens_jsonl(path: str | Path) -> list[Trajectory]:
    """All trajectories of a tokens JSONL file (``.jsonl`` or ``.jsonl.gz``)."""
    trajectories = [trajectory_from_record(where, record) for where, record in read_jsonl(path)]
    if not trajectories:
        raise DataError(f"{path}: no trajectories")
    return trajectories
