"""The exception types for bad input: data and configuration."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data. The message names where it came from (file:line, group, field)."""


class RecordError(DataError):
    """One input record that cannot be used; ``reason`` is the short key that
    ``tools/convert.py --skip-bad`` counts skipped lines by."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ConfigError(ValueError):
    """A configuration mistake; the message names the file and the offending key."""


class RolloutError(RuntimeError):
    """A rollout step that cannot give the objective what it needs (tasks that lost every leaf); the
    message names the cause, and the trainer prints it without a traceback."""


class HubError(DataError):
    """A hub id (``org/name``) that cannot be resolved to a local snapshot: not cached while offline, no
    such model, no safetensors weights. The message names the id and how to get it (:mod:`ds_tree.hub`)."""
