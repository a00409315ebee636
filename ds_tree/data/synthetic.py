"""Synthetic agentic tree data with a chosen prefix overlap ratio (POR), for tests and benchmarks.

Token ids are sampled directly (no tokenizer, so 64 groups take well under a second) but keep the
shape of rendered ChatML agent conversations: ``<|im_start|> role \\n content <|im_end|> \\n``
turns, a system prompt and a user task shared by the group, then assistant turns (some with a
tool-call span) alternating with tool results. ``loss_mask`` is 1 on assistant content and its
``<|im_end|> \\n`` (what the model generates), 0 on headers, system, user and tool tokens.

How the POR is hit: if trial ``i`` copies an earlier trial's first ``d_i`` tokens and then
diverges, the trie gains ``len_i - d_i`` new tokens, so ``POR = sum_i d_i / sum_i len_i``. Trials
are built one at a time; each copies a random earlier trial of its group (so branches nest, giving
depth as well as width) up to the depth that keeps the running shared/flat ratio on target, snapped
to an assistant content token: like sampling at temperature > 0, trials diverge where the model
generates. A depth equal to the whole length makes an exact duplicate (temperature-0 trials).
POR is at most ``(T-1)/T`` with ``T`` trials per group (the first trial is all new), so the
default trial count grows with the target. ``por=0`` makes every trial its own task (own group).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_tree.data.jsonl import write_jsonl
from ds_tree.trees.stats import token_counts
from ds_tree.trees.trajectory import Trajectory
from ds_tree.vocab.tokenizer import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS

IM_START, IM_END = SPECIAL_TOKENS.index("<|im_start|>"), SPECIAL_TOKENS.index("<|im_end|>")
# Structural ids right after the special tokens stand for role names, newline and tool-call tags.
ROLE = {"system": 5, "user": 6, "assistant": 7, "tool": 8}
NEWLINE, CALL_OPEN, CALL_CLOSE = 9, 10, 11
FIRST_CONTENT_ID = 12
"""Content ids are drawn from ``[FIRST_CONTENT_ID, vocab_size)``."""


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the generated data; every field is validated against the others."""

    groups: int = 64
    """Number of tasks (trees); with ``por=0`` each trial becomes its own group instead."""
    por: float = 0.5
    """Target prefix overlap ratio 1 - tree_tokens / flat_tokens, in [0, 0.95]."""
    trials: int | None = None
    """Trials per task; None: 8, or the fewest that can reach ``por`` (POR <= (T-1)/T)."""
    vocab_size: int = DEFAULT_VOCAB_SIZE
    max_tokens: int = 512
    """Length cap of one trajectory; trial lengths are drawn from [max_tokens/2, max_tokens]."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.por <= 0.95:
            raise ValueError(f"por must be in [0, 0.95], got {self.por}")
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.max_tokens < 64:  # the shortest trial (max_tokens/2) must fit a prompt and a reply
            raise ValueError(f"max_tokens must be >= 64, got {self.max_tokens}")
        if self.vocab_size <= FIRST_CONTENT_ID + 16:
            raise ValueError(f"vocab_size must be > {FIRST_CONTENT_ID + 16}, got {self.vocab_size}")
        if self.trials is not None and self.trials < self.min_trials:
            raise ValueError(f"por={self.por} needs at least {self.min_trials} trials per group, got {self.trials}")

    @property
    def min_trials(self) -> int:
        """Fewest trials whose bound (T-1)/T exceeds the target POR (by one trial's worth)."""
        return math.ceil(1.0 / (1.0 - self.por)) + 1

    @property
    def trials_per_group(self) -> int:
        return self.trials if self.trials is not None else max(8, self.min_trials)


class _Conversation:
    """Token ids and loss mask of one trajectory, plus which positions may start a divergence."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.divergeable: list[bool] = []  # assistant content tokens

    def add(self, ids: list[int] | np.ndarray, mask: int, divergeable: bool = False) -> None:
        self.ids.extend(int(i) for i in ids)
        self.mask.extend([mask] * len(ids))
        self.divergeable.extend([divergeable] * len(ids))

    def copy_prefix(self, length: int) -> _Conversation:
        other = _Conversation()
        other.ids, other.mask, other.divergeable = self.ids[:length], self.mask[:length], self.divergeable[:length]
        return other

    def __len__(self) -> int:
        return len(self.ids)


class _Generator:
    def __init__(self, config: SyntheticConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng

    def content(self, n: int) -> np.ndarray:
        return self.rng.integers(FIRST_CONTENT_ID, self.config.vocab_size, size=n)

    def turn(self, conversation: _Conversation, role: str, n: int) -> None:
        """A whole non-assistant turn (never trained)."""
        conversation.add([IM_START, ROLE[role], NEWLINE], 0)
        conversation.add(self.content(n), 0)
        conversation.add([IM_END, NEWLINE], 0)

    def assistant_body(self, conversation: _Conversation, avoid: int | None) -> None:
        """Assistant content after the header: text, sometimes a tool call, then the end marker.

        ``avoid`` is the token the copied trial has at this position: the first new token differs
        from it, so the trie really branches here.
        """
        text = self.content(int(self.rng.integers(4, 40)))
        while avoid is not None and text[0] == avoid:
            text[0] = self.content(1)[0]
        conversation.add(text, 1, divergeable=True)
        if self.rng.random() < 0.7:  # a tool call: fixed tags around a name and JSON-ish arguments
            conversation.add([CALL_OPEN], 1)
            conversation.add(self.content(int(self.rng.integers(6, 24))), 1, divergeable=True)
            conversation.add([CALL_CLOSE], 1)
        conversation.add([IM_END, NEWLINE], 1)

    def continue_to(self, conversation: _Conversation, length: int, avoid: int | None) -> None:
        """Extend a conversation that stopped inside (or right before) an assistant turn to ``length``.

        Turns alternate tool result / assistant; the last turn is cut at ``length`` as a max-length
        truncation would cut it.
        """
        self.assistant_body(conversation, avoid)
        while len(conversation) < length:
            self.turn(conversation, "tool", int(self.rng.integers(8, 80)))
            conversation.add([IM_START, ROLE["assistant"], NEWLINE], 0)
            self.assistant_body(conversation, None)
        del conversation.ids[length:], conversation.mask[length:], conversation.divergeable[length:]

    def prompt(self, budget: int) -> _Conversation:
        """System prompt + user task + the first assistant header, about ``budget`` tokens long."""
        conversation = _Conversation()
        system = max(1, int(budget * self.rng.uniform(0.6, 0.8)))
        self.turn(conversation, "system", system)
        self.turn(conversation, "user", max(1, budget - system - 13))
        conversation.add([IM_START, ROLE["assistant"], NEWLINE], 0)
        return conversation

    def first_trial(self, length: int, prompt_budget: int) -> _Conversation:
        """A new task's prompt and one trial of ``length`` tokens."""
        conversation = self.prompt(max(16, prompt_budget))
        self.continue_to(conversation, length, None)
        return conversation

    def group(self) -> list[_Conversation]:
        """Trials of one task with POR close to the target."""
        config, rng = self.config, self.rng
        lengths = rng.integers(config.max_tokens // 2, config.max_tokens + 1, size=config.trials_per_group)
        # The shared prompt must not exceed what the target lets every later trial share.
        prompt_budget = int(min(0.5, config.por) * lengths.min() * rng.uniform(0.5, 1.0))
        trials = [self.first_trial(int(lengths[0]), prompt_budget)]
        shared, flat = 0, len(trials[0])
        for length in lengths[1:]:
            source = trials[int(rng.integers(len(trials)))]
            wanted = config.por * (flat + length) - shared
            trial = self.branch(source, int(length), wanted)
            shared += self.shared_with(source, trial)
            flat += len(trial)
            trials.append(trial)
        return trials

    def branch(self, source: _Conversation, length: int, wanted: float) -> _Conversation:
        """A trial that copies ``source`` up to about ``wanted`` tokens, then diverges."""
        if wanted >= min(length, len(source)) - 0.5:
            # Sharing everything: a duplicate or a truncated copy (temperature 0 does this).
            return source.copy_prefix(min(length, len(source)))
        candidates = np.flatnonzero(np.asarray(source.divergeable[:length]))
        if candidates.size == 0:  # a length that ends inside the prompt
            return source.copy_prefix(min(length, len(source)))
        depth = int(candidates[np.argmin(np.abs(candidates - wanted))])
        trial = source.copy_prefix(depth)
        self.continue_to(trial, length, avoid=source.ids[depth])
        return trial

    @staticmethod
    def shared_with(source: _Conversation, trial: _Conversation) -> int:
        n = min(len(source), len(trial))
        diff = np.flatnonzero(np.asarray(source.ids[:n]) != np.asarray(trial.ids[:n]))
        return int(diff[0]) if diff.size else n


def generate(config: SyntheticConfig) -> Iterator[Trajectory]:
    """Trajectories of ``config.groups`` tasks; the same config always gives the same data."""
    rng = np.random.default_rng(config.seed)
    generator = _Generator(config, rng)
    for group in range(config.groups):
        if config.por > 0:
            members = [(f"synthetic-{group}", trial) for trial in generator.group()]
        else:  # no sharing at all: every trial is a distinct task with its own prompt and group
            lengths = rng.integers(config.max_tokens // 2, config.max_tokens + 1, size=config.trials_per_group)
            members = [(f"synthetic-{group}-{i}", generator.first_trial(int(n), 16)) for i, n in enumerate(lengths)]
        for trial, (group_id, conversation) in enumerate(members):
            yield Trajectory(
                input_ids=np.asarray(conversation.ids, dtype=np.int64),
                loss_mask=np.asarray(conversation.mask, dtype=np.float64),
                group_id=group_id,
                reward=float(rng.random() < 0.5),
                trial=trial,
                source=f"{group_id}:trial {trial}",
            )


def write_synthetic(config: SyntheticConfig, output: str | Path) -> dict:
    """Write :func:`generate`'s trajectories as tokens JSONL (gzip for ``.gz``); returns a summary
    with the POR achieved next to the target."""
    trajectories = list(generate(config))
    records = (
        {
            "group_id": trajectory.group_id,
            "trial": trajectory.trial,
            "input_ids": trajectory.input_ids.tolist(),
            "loss_mask": trajectory.loss_mask.astype(int).tolist(),  # masks are 0/1 here
            "reward": trajectory.reward,
        }
        for trajectory in trajectories
    )
    write_jsonl(output, records)
    counts = token_counts(trajectories)
    return {
        "output": str(output),
        "trajectories": len(trajectories),
        "groups": len({t.group_id for t in trajectories}),
        "flat_tokens": counts.flat_tokens,
        "target_por": config.por,
        "por": counts.por,
    }
