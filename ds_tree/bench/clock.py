"""The benchmarks' clock barrier: every timed step waits here for the device before reading ``time``."""

from __future__ import annotations

import torch


def synchronize(device: str) -> None:
    """Wait for a GPU's queued work before reading a clock (nothing to wait for on the CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
