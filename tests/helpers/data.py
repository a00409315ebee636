"""Token files a test run reads: a fixed forest with real sharing (SFT), prompts for online RL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_forest(path: Path, groups: int = 6, seed: int = 0) -> Path:
    """A fixed forest with real sharing, forks at many depths and partly untrained prefixes."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as handle:
        for group in range(groups):
            stem = rng.integers(3, 1024, 90).tolist()
            for _ in range(4):
                cut = int(rng.integers(5, 90))
                length = int(rng.integers(cut + 1, 180))
                ids = stem[:cut] + rng.integers(3, 1024, length - cut).tolist()
                mask = [0] * min(cut, 30) + [1] * (length - min(cut, 30))
                handle.write(json.dumps({"group_id": f"g{group}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def write_prompts(path: Path) -> Path:
    """Four prompts (text and ids) with the digit-parity reward's ``parity`` metadata."""
    lines = [
        {"prompt": "Write even digits:", "metadata": {"parity": "even"}},
        {"prompt": "odd:", "metadata": {"parity": "odd"}},
        {"prompt": "even:", "metadata": {"parity": "even"}},
        {"prompt_ids": [300, 301, 302], "metadata": {"parity": "odd"}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
