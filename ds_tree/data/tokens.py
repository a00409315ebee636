"""The tokens JSONL format: one trajectory a line, already tokenised.

``{"group_id": str | int, "input_ids": [int], "loss_mask": [number], "reward": number?, "trial": int?,
"logprobs": [number | null]?, "advantages": [number]?}``;
``"labels"`` with ``-100`` for untrained tokens may stand instead of ``loss_mask`` (Hugging
Face style, labels equal to input_ids elsewhere; a record with both is an error). Trajectories
sharing a ``group_id`` form one tree; the group id is required (:func:`ds_tree.data.records.group_id`).

RL rollouts may carry, one entry per token of ``input_ids``: ``logprobs``, the sampling policy's
log-probability of each token (``<= 0``; ``null`` where the token was not sampled, such as the
prompt or tool output), and ``advantages``, per-token advantages computed elsewhere (finite; the
first token's value is never used) for the ``given`` estimator.

Records may carry images that were already processed (``images``, ``image_index``:
:mod:`ds_tree.data.token_images`); ``ds-tree convert --format tokens`` with a processor folder reads
them. Read directly (:func:`read_tokens_jsonl`), such a record is refused rather than its images dropped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ds_tree.data.jsonl import read_jsonl
from ds_tree.data.records import (
    MISSING,
    PER_TOKEN_FIELDS,
    group_id,
    integer_list,
    is_integer,
    number_list,
    optional_finite_number,
    optional_per_token,
)
from ds_tree.data.token_images import check_not_saved_rollout
from ds_tree.errors import DataError
from ds_tree.trees.trajectory import Trajectory

IGNORE_INDEX = -100


def trajectory_from_record(where: str, record: dict) -> Trajectory:
    """Validate one tokens record and turn it into a :class:`Trajectory`."""
    input_ids = integer_list(where, "input_ids", record.get("input_ids"))
    if "loss_mask" in record and "labels" in record:
        raise DataError(
            f"{where}: both 'loss_mask' and 'labels': give one of them (either says which tokens are trained)"
        )
    if "loss_mask" in record:
        mask = number_list(where, "loss_mask", record["loss_mask"])
    elif "labels" in record:
        labels = integer_list(where, "labels", record["labels"])
        if len(labels) != len(input_ids):
            raise DataError(f"{where}: 'labels' has {len(labels)} entries but 'input_ids' has {len(input_ids)}")
        if any(label not in (IGNORE_INDEX, token) for label, token in zip(labels, input_ids, strict=True)):
            raise DataError(f"{where}: 'labels' must equal 'input_ids' or be -100 (labels are not shifted)")
        mask = [float(label != IGNORE_INDEX) for label in labels]
    else:
        raise DataError(f"{where}: missing field 'loss_mask' (or 'labels')")
    trial = record.get("trial")
    return Trajectory(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        loss_mask=np.asarray(mask, dtype=np.float64),
        group_id=group_id(where, record.get("group_id", MISSING)),
        reward=optional_finite_number(where, "reward", record.get("reward")),
        trial=trial if is_integer(trial) else None,
        source=where,
        **{name: optional_per_token(where, name, record.get(name), nulls) for name, nulls in PER_TOKEN_FIELDS.items()},
    )


def read_tokens_jsonl(path: str | Path) -> list[Trajectory]:
    """All trajectories of a tokens JSONL file (``.jsonl`` or ``.jsonl.gz``)."""
    trajectories = [trajectory_from_record(where, _without_images(where, record)) for where, record in read_jsonl(path)]
    if not trajectories:
        raise DataError(f"{path}: no trajectories")
    return trajectories


def _without_images(where: str, record: dict) -> dict:
    """``record``, refused when it carries images: only ``convert`` (with a processor folder) reads them."""
    check_not_saved_rollout(where, record.get("images"))
    if record.get("images") is not None or record.get("image_index") is not None:
        raise DataError(
            f"{where}: a record with images: convert the file first, ds-tree convert --format tokens --input FILE "
            "--tokenizer PROC (a processor folder: ds-tree make-tokenizer --vision FAMILY) --output DATA"
        )
    return record
