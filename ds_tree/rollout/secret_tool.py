"""The multi-turn CPU example's task (docs/ENVIRONMENTS.md): call a tool for a secret digit, then say it.

Each task has a secret digit. The policy sees a system prompt with one tool, ``get_secret``, and the
question; the tool's answer (a ``tool`` message) holds the secret; a turn without a tool call ends
the episode with reward 1 if its text is the secret, else 0. A policy that does not read the
observation answers one of ten digits: reward about 0.1. Use it as
``rollout.env.path: ds_tree.rollout.secret_tool:SecretToolEnv``.

``python -m ds_tree.rollout.secret_tool --tokenizer DIR --tasks OUT --demonstrations OUT`` writes the
tasks file and the SFT warm-up's demonstrations (tokens JSONL): the call format and the answer format
only. A demonstration calls the tool and then answers a digit drawn independently of the secret, so
no demonstration shows the observation being used: reading it is what RL has to learn.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ds_tree.rollout.env import ToolEnvironment, Turn

SYSTEM = "Call get_secret, then answer with the secret only."
QUESTION = "What is the secret?"


class SecretToolEnv(ToolEnvironment):
    """One tool returning the task's secret; the final answer is scored against it."""

    fork_mode = "copy"

    def __init__(self) -> None:
        self.secret = ""
        self.called = False
        self.tools = [self.get_secret]

    def get_secret(self) -> str:
        """Returns the secret digit of this task."""
        self.called = True
        return self.secret

    def reset(self, task: dict) -> list[dict]:
        self.secret, self.called = str(task["secret"]), False
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]

    def reward(self, turn: Turn) -> float:
        """1 for the secret, after calling the tool (an answer without the call is a guess: 0)."""
        return float(self.called and turn.text.strip() == self.secret)


def tasks(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"secret-{index}", "secret": rng.randrange(10)} for index in range(count)]


def demonstration(task: dict, rng: random.Random) -> list[dict]:
    """Messages of one demonstration: the call, the observation, an answer that ignores it."""
    env = SecretToolEnv()
    call = {"id": "call_1_0", "type": "function", "function": {"name": "get_secret", "arguments": "{}"}}
    return [
        *env.reset(task),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": env.get_secret()},
        {"role": "assistant", "content": str(rng.randrange(10))},  # independent of the secret
    ]


def main(argv: list[str] | None = None) -> int:
    from ds_tree.data.chat import render_chat
    from ds_tree.data.convert import load_tokenizer
    from ds_tree.rollout.env import tool_schema

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--tasks", required=True, help="tasks JSONL to write (rollout.prompts)")
    parser.add_argument("--demonstrations", required=True, help="SFT tokens JSONL to write")
    parser.add_argument("--count", type=int, default=64, help="tasks")
    parser.add_argument("--demos", type=int, default=256, help="demonstrations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    tools = [tool_schema(SecretToolEnv().get_secret)]
    Path(args.tasks).write_text("".join(json.dumps(task) + "\n" for task in tasks(args.count, args.seed)))
    rng = random.Random(args.seed + 1)
    lines = []
    for index in range(args.demos):
        task = {"secret": rng.randrange(10)}
        rendered = render_chat(tokenizer, demonstration(task, rng), tools, where=f"demonstration {index}")
        record = {"group_id": index, "input_ids": rendered.input_ids.tolist(), "loss_mask": rendered.loss_mask.tolist()}
        lines.append(json.dumps(record) + "\n")
    Path(args.demonstrations).write_text("".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
