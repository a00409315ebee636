"""Synthetic GUI-agent chat data with screenshots shared as agent trees share them.

Each task's trials start from the task's screenshot, tap one of two buttons, see the screenshot of
that choice, tap again and see the screenshot of the pair of choices: trial ``t`` takes ``t % 2`` then
``t // 2 % 2``. So per task 1 screenshot is shared by every trial, 2 by half of them each, 4 by a quarter
each (7 distinct images against 3 per trial in the flat layout). Screenshots are random-pixel PNGs of
``side`` x ``side`` pixels beside the JSONL; records are chat JSONL with image parts (docs/DATA.md,
"Images"), rewards 1 for every third trial. For benchmarks and tests of the vision-language path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SYSTEM = "You operate a phone. Tap to reach the goal."


def _tap(x: int, trial: int) -> dict:
    arguments = json.dumps({"x": x, "y": trial})
    return {"id": "tap", "type": "function", "function": {"name": "tap", "arguments": arguments}}


def write_gui_chat(folder: str | Path, *, tasks: int, trials: int, side: int, seed: int = 0) -> Path:
    """Write ``gui.jsonl`` and its screenshots into ``folder``; returns the JSONL's path."""
    from PIL import Image

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def screenshot(name: str) -> dict:
        pixels = (rng.random((side, side, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / name)
        return {"type": "image", "image": name}

    lines = []
    for task in range(tasks):
        start = screenshot(f"task{task}.png")
        first = {a: screenshot(f"task{task}_{a}.png") for a in range(2)}
        second = {(a, b): screenshot(f"task{task}_{a}{b}.png") for a in range(2) for b in range(2)}
        for trial in range(trials):
            a, b = trial % 2, trial // 2 % 2
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": [{"type": "text", "text": f"Task {task}: open the settings."}, start]},
                {"role": "assistant", "content": f"I tap button {a}.", "tool_calls": [_tap(a, trial)]},
                {"role": "tool", "tool_call_id": "tap", "content": [first[a]]},
                {"role": "assistant", "content": f"Now button {b}.", "tool_calls": [_tap(b, trial)]},
                {"role": "tool", "tool_call_id": "tap", "content": [second[(a, b)]]},
                {"role": "assistant", "content": f"Done after trial {trial}."},
            ]
            record = {"group_id": f"task{task}", "trial": trial, "reward": float(trial % 3 == 0), "messages": messages}
            lines.append(json.dumps(record))
    path = folder / "gui.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
