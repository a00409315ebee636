"""The multi-turn CPU example's task (docs/ENVIRONMENTS.md): call a tool for a secret digit, then say it.

Each task has a secret digit. The policy sees a system prompt with one tool, ``get_secret``, and the
question; the tool's answer (a ``tool`` message) holds the secret; a turn without a tool call ends
the episode with reward 1 if its text is the secret, else 0. A policy that does not read the
observation answers one of ten digits: reward about 0.1. Use it as
``rollout.env.path: ds_tree.envs.secret_tool:SecretToolEnv``.

``python -m ds_tree.envs.secret_tool --tasks OUT`` writes a tasks file (``configs/multiturn_tasks.jsonl``
is one). :meth:`SecretToolEnv.demonstration` writes the warm-up's demonstrations
(``rollout.env.warmup_steps``): the call format and the answer format only. A demonstration calls the
tool and then answers a digit drawn independently of the secret, so no demonstration shows the
observation being used: reading it is what RL has to learn.
"""

from __future__ import annotations

import random

from ds_tree.envs.tasks_file import write_tasks_main
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

    repeat = 1
    """How many times the tool's answer states the secret (``"7,7,7"``; docs/ENVIRONMENTS.md)."""

    def get_secret(self) -> str:
        """Returns the secret digit of this task."""
        self.called = True
        return ",".join([self.secret] * self.repeat)

    def reset(self, task: dict) -> list[dict]:
        self.secret, self.called = str(task["secret"]), False
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]

    def reward(self, turn: Turn) -> float:
        """1 for the secret, after calling the tool (an answer without the call is a guess: 0)."""
        return float(self.called and turn.text.strip() == self.secret)

    def demonstration(self, task: dict, rng: random.Random) -> list[dict]:
        """One warm-up demonstration (``rollout.env.warmup_steps``): the call, the observation, and an
        answer drawn from ``rng`` independently of the secret, so it never shows the observation used."""
        call = {"id": "call_1_0", "type": "function", "function": {"name": "get_secret", "arguments": "{}"}}
        return [
            *self.reset(task),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1_0", "content": self.get_secret()},
            {"role": "assistant", "content": str(rng.randrange(10))},  # independent of the secret
        ]


class LoudSecretToolEnv(SecretToolEnv):
    """:class:`SecretToolEnv` for a random-init tiny model (the CPU example, docs/ENVIRONMENTS.md).

    The task and its reward are the same, but the secret is loud in a short context: the tool states
    it 16 times, and the tool is named in the system message instead of a JSON schema block (which a
    model that learns the call format from demonstrations does not read), so the context before the
    answer is ~110 tokens instead of ~250. A random-init model's attention is spread over the whole
    context at first: the secret then carries ~15% of what reaches the answer instead of ~0.4%, and
    the RL signal to read it is that much stronger (with one secret token in the schema'd prompt,
    even supervised training on the answer did not start copying within 60 steps)."""

    repeat = 16

    def tool_schemas(self) -> list[dict]:
        return []


def tasks(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"secret-{index}", "secret": rng.randrange(10)} for index in range(count)]


def main(argv: list[str] | None = None) -> int:
    return write_tasks_main(__doc__.split("\n")[0], tasks, argv)


if __name__ == "__main__":
    raise SystemExit(main())
