"""One measure of a tree result against the flat baseline, shared by ``ds-tree verify``, the
sequence-parallel and dfs checks it spawns, and the trainer's self-check (:mod:`ds_tree.engine.self_check`).

The loss is compared by relative error, each trajectory's log-probs by absolute error, and each
parameter's gradient by the norm of its difference relative to its own norm, floored at a small
fraction of the whole gradient's (:func:`gradient_errors`). :data:`TOLERANCES` bounds all three.
"""

from __future__ import annotations

import math

import torch

TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5}
"""Largest loss and gradient relative error and log-prob absolute error per dtype. Measured on the
project's synthetic and shared data: float64 errors stay below ~1e-13, float32 below ~1e-6."""

GRADIENT_FLOOR = 1e-2
"""A parameter's gradient error is relative to ``max(||g||, GRADIENT_FLOOR x ||g_all||)``."""


def relative_error(value: float, reference: float) -> float:
    """``|value - reference| / |reference|``, the reference floored at 1e-300 (a loss of 0 stays finite)."""
    return abs(value - reference) / max(abs(reference), 1e-300)


def gradient_errors(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter ``||g_other - g_ref|| / max(||g_ref||, GRADIENT_FLOOR * ||g_ref, all||)``, in float64.

    A parameter whose exact gradient vanishes (the q/k projections when every query sees a single
    key, say) holds only round-off in both modes, and round-off over round-off is order 1; such a
    parameter is measured against a small fraction of the whole gradient instead.
    """
    if set(other) != set(reference):
        raise AssertionError(f"parameters with gradients differ: {sorted(set(other) ^ set(reference))}")
    total = math.sqrt(sum(g.double().norm().item() ** 2 for g in reference.values()))
    errors = {}
    for name, g_ref in reference.items():
        diff = (other[name].double() - g_ref.double()).norm().item()
        floor = max(g_ref.double().norm().item(), GRADIENT_FLOOR * total)
        errors[name] = diff / floor if floor > 0 else diff
    return errors


def metric_errors(flat: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """Relative error of each metric sum (absolute where the flat value is 0)."""
    return {
        name: relative_error(other.get(name, 0.0), value) if value else abs(other[name]) for name, value in flat.items()
    }
