"""Rewards: a function of one sampled trajectory's text -> float, and safe scoring of a batch.

A reward function takes a :class:`RewardRequest` and returns a finite float. ``rollout.reward`` names
one in :data:`ds_tree.registries.REWARDS` (``REWARDS.get(name)`` resolves a registered name and a user's
``package.module:function`` alike): ``game24`` (1.0 when the completion's answer solves the prompt's 24
game, the example in :mod:`ds_tree.envs.game24`) and ``exact_match`` (1.0 when the stripped
completion equals the stripped ``metadata["answer"]``). :func:`score` never lets one bad trajectory stop the loop: an
exception (``SystemExit`` included: a reward calling ``sys.exit`` does not end the rank) or a
non-finite value gives ``None`` for that request and a message naming it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

EXCERPT = 60
"""Characters of the prompt's end and the completion's start quoted in a failure message."""


@dataclass(frozen=True)
class RewardRequest:
    """What a reward function sees of one trajectory."""

    prompt: str
    """The prompt text (as the model saw it)."""
    completion: str
    """The sampled text after the prompt."""
    metadata: dict = field(default_factory=dict)
    """Per-prompt data: ``{"numbers": [4 ints]}`` for game24, ``{"answer": str}`` for exact_match."""

    def describe(self) -> str:
        """A short excerpt for messages: the prompt's end and the completion's start."""
        return f"prompt ...{self.prompt[-EXCERPT:]!r}, completion {self.completion[:EXCERPT]!r}..."


def exact_match_reward(request: RewardRequest) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals ``metadata["answer"]`` stripped."""
    if "answer" not in request.metadata:
        raise ValueError("exact_match needs metadata['answer']")
    return float(request.completion.strip() == str(request.metadata["answer"]).strip())


def describe_failure(error: BaseException) -> str:
    """``Type: message`` of a reward's failure; where a syntax error is, or the code a ``sys.exit`` gave."""
    if isinstance(error, SystemExit):
        return f"SystemExit: the reward code called sys.exit({error.code!r})"
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} ({error.filename}, line {error.lineno})"
    return f"{type(error).__name__}: {error}"


def score(
    reward_fn: Callable[[RewardRequest], float], requests: list[RewardRequest]
) -> tuple[list[float | None], list[str]]:
    """Each request's reward, and one message per request that failed (its reward is then None).

    A failure is an exception from ``reward_fn`` or a value that is not a finite number; the
    message names the request (index and text excerpt) and what went wrong.
    """
    rewards: list[float | None] = []
    failures: list[str] = []
    for index, request in enumerate(requests):
        try:
            value = reward_fn(request)
        except (Exception, SystemExit) as error:  # a user's reward function may raise anything, even exit
            rewards.append(None)
            failures.append(f"reward failed for request {index} ({request.describe()}): {describe_failure(error)}")
            continue
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            rewards.append(None)
            failures.append(f"reward for request {index} ({request.describe()}) is {value!r}, not a finite number")
            continue
        rewards.append(float(value))
    return rewards, failures
