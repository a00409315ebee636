"""``python -m ds_tree.envs.<example> --tasks OUT``: an example environment's tasks file."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def write_tasks_main(description: str, make_tasks: Callable[[int, int], list[dict]], argv: list[str] | None) -> int:
    """Parse ``--tasks OUT --count N --seed S`` and write ``make_tasks(N, S)`` to OUT, one JSON object a line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tasks", required=True, help="tasks JSONL to write (rollout.prompts)")
    parser.add_argument("--count", type=int, default=64, help="tasks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    Path(args.tasks).write_text("".join(json.dumps(task) + "\n" for task in make_tasks(args.count, args.seed)))
    return 0
