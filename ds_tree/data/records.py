"""Checks of the JSON fields of input records, shared by every record format.

Python's ``bool`` is a subclass of ``int``, so a JSON ``true`` passes ``isinstance(value, int)``;
every check here rejects booleans where a number or an id is expected. Each check raises a
:class:`DataError` that starts with ``where`` (``file:line``, and the node for tree records) and
names the field.
"""

from __future__ import annotations

import math

import numpy as np

from ds_tree.errors import DataError, RecordError

INT64_MAX = 2**63 - 1
PER_TOKEN_FIELDS = {"logprobs": True, "advantages": False}
"""The RL rollout fields aligned with a record's tokens, and whether their entries may be null."""


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer_list(where: str, name: str, value: object) -> list[int]:
    """``value`` if it is a list of integers that fit int64 (token ids, labels)."""
    if not isinstance(value, list) or not all(is_integer(v) for v in value):
        raise DataError(f"{where}: field {name!r} must be a list of integers")
    if value and max(abs(v) for v in value) > INT64_MAX:
        raise DataError(f"{where}: field {name!r} has an integer outside the 64-bit range")
    return value


def number_list(where: str, name: str, value: object) -> list[int | float]:
    """``value`` if it is a list of numbers (loss masks; finiteness is checked by ``Trajectory``)."""
    if not isinstance(value, list) or not all(is_number(v) for v in value):
        raise DataError(f"{where}: field {name!r} must be a list of numbers")
    return value


MISSING = object()
"""The value of a field a record does not have (``record.get(name, MISSING)``)."""


def group_id(where: str, value: object, name: str = "group_id") -> str | int:
    """A group id, required: a string, or an integer kept as one (``1`` and ``"1"`` are two groups).

    Every reader checks group ids here (tokens, explicit trees, chat, converted datasets), so the
    rule and its error are one. The error is a :class:`RecordError` (``bad_group_id``), which
    ``convert --skip-bad`` counts.
    """
    if isinstance(value, str) or is_integer(value):
        return value
    if value is MISSING:
        raise RecordError("bad_group_id", f"{where}: missing field {name!r} (a string or an integer)")
    raise RecordError("bad_group_id", f"{where}: field {name!r} must be a string or an integer")


def _as_float(value: object) -> float:
    """A JSON number as a float; NaN for anything else, infinity for an integer beyond the float range."""
    try:
        return float(value) if is_number(value) else math.nan
    except OverflowError:
        return math.inf


def optional_finite_number(where: str, name: str, value: object) -> float | None:
    """``None`` for a missing or null value, else a finite number as a float (rewards)."""
    if value is None:
        return None
    number = _as_float(value)
    if not math.isfinite(number):
        raise DataError(f"{where}: field {name!r} must be a finite number or null")
    return number


def optional_per_token(where: str, name: str, value: object, nulls: bool) -> np.ndarray | None:
    """``None`` for a missing or null field, else a float64 array with one value per entry (the
    sampler's log-probs, advantages; ``Trajectory`` checks the length and the range).

    Entries are finite numbers; with ``nulls`` an entry may also be ``null``, stored as NaN (a
    token the sampler did not produce). A JSON ``NaN`` or ``Infinity`` literal is an error.
    """
    if value is None:
        return None
    allowed = "finite numbers or null" if nulls else "finite numbers"
    if not isinstance(value, list) or not all(is_number(v) or (nulls and v is None) for v in value):
        raise DataError(f"{where}: field {name!r} must be a list of {allowed}")
    numbers = np.array([math.nan if v is None else _as_float(v) for v in value], dtype=np.float64)
    given = np.array([v is not None for v in value], dtype=bool)
    if not np.all(np.isfinite(numbers[given])):
        raise DataError(f"{where}: field {name!r} must be a list of {allowed}; it holds a non-finite value")
    return numbers
