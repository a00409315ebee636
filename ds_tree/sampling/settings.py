"""How a group is sampled: the sampler's settings (docs/ROLLOUTS.md), their one home.

:func:`ds_tree.sampling.hf.sample_tree` takes them, ``ds-tree sample`` sets them with options, and
the training config's ``rollout`` section (:class:`ds_tree.config.RolloutConfig`) is these fields and
the online loop's own. Torch-free, so the config and the command line read them without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

from ds_tree.registries import TURN_FORMATS


@dataclass
class SamplerSettings:
    """How one prompt's group is sampled (docs/ROLLOUTS.md)."""

    segment_length: int = 16
    """Tokens decoded per segment before a branch decision."""
    branching: int = 2
    """Children per branch point."""
    max_depth: int = 3
    """Branch levels (segment boundaries 0 .. max_depth-1 may fork): at most branching**max_depth leaves."""
    width: int = 8
    """Leaves per prompt (the group size)."""
    max_new_tokens: int = 64
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: sample among the most likely tokens whose probabilities sum to >= top_p."""
    repetition_ngram: int = 0
    """0 = off; n > 0 stops a branch when its last n completion tokens already occur earlier in its completion."""
    logprob_floor: float = 0.0
    """Stop a branch whose mean sampler log-prob over a segment falls below this value (< 0; 0: off)."""
    refill: bool = True
    """Re-branch from live or stopped paths so a tree keeps ``width`` leaves when branches stop early."""
    independent: bool = False
    """Baseline: ``width`` independent completions (a depth-1 tree), same output type."""

    def __post_init__(self) -> None:
        for name in ("segment_length", "branching", "max_depth", "width", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"sampler {name} must be >= 1, got {getattr(self, name)}")
        if self.quota_rule_applies() and not self.independent and self.width > self.branching**self.max_depth:
            raise ValueError(
                f"sampler width {self.width} exceeds branching**max_depth = {self.branching}**{self.max_depth}; "
                "raise branching or max_depth, or lower width"
            )
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"sampler temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampler top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_ngram < 0:
            raise ValueError(f"sampler repetition_ngram must be >= 0 (0 = off), got {self.repetition_ngram}")
        if not (self.logprob_floor <= 0 and math.isfinite(self.logprob_floor)):
            raise ValueError(f"sampler logprob_floor must be a finite value <= 0, got {self.logprob_floor}")

    def quota_rule_applies(self) -> bool:
        """Whether ``branching`` and ``max_depth`` shape the tree (so ``width`` must fit them)."""
        return True

    @property
    def branch_levels(self) -> int:
        """Segment boundaries that may fork (1 for the independent baseline)."""
        return 1 if self.independent else self.max_depth


class TurnBranchedSettings(SamplerSettings):
    """The sampler settings of episodes whose forks ``rollout.env.turn_branching`` sets: it replaces the
    quota rule, so ``width`` need not fit ``branching**max_depth``."""

    def quota_rule_applies(self) -> bool:
        return False


FORK_MODES = ("copy", "replay", "none")


@dataclass
class EnvSettings:
    """Multi-turn rollouts against an environment (docs/ENVIRONMENTS.md): ``rollout.env``.

    With ``path`` set, each prompt slot is an episode tree: ``rollout.prompts`` holds tasks (one JSON
    object a line, handed to the environment's ``reset``), ``rollout.max_new_tokens`` caps each
    assistant turn, and ``rollout.width`` / ``branching`` / ``max_depth`` say how the tree forks at
    turn boundaries (boundary 0 is the prompt) by the sampler's quota rule; ``rollout.independent``
    forks all ``width`` episodes at the prompt (the baseline)."""

    path: str = ""
    """The environment: a name in :data:`ds_tree.registries.ENVIRONMENTS` (``secret_tool``, ``tau_shop``,
    ``gui_screens``) or an importable ``package.module:Class`` (or factory), called with no arguments once
    per episode; it returns a :class:`ds_tree.rollout.env.Environment`. Empty: single-turn online RL with
    ``rollout.reward``."""
    fork: str = ""
    """How an episode is forked at a turn boundary: ``copy`` (deep copy), ``replay`` (a fresh instance
    replays the recorded turns, checking its answers), ``none`` (branch at the prompt only). Empty:
    the environment class's ``fork_mode`` (``copy`` unless it says otherwise)."""
    format: Annotated[str, TURN_FORMATS.choices("auto")] = "auto"
    """The chat format: how a sampled turn splits into reasoning, text and tool calls, and which
    tokens end it (:data:`ds_tree.registries.TURN_FORMATS`: ``hermes``, ``qwen3``, ``qwen3_coder``,
    ``llama3_json``, ``mistral``, ``harmony``, or one a project registers). ``auto``: recognised from
    the tokenizer's chat template (an error naming this field when it cannot tell)."""
    max_turns: int = 4
    """Assistant turns per episode at most; a leaf still going after them stops with ``max_turns``."""
    max_context_tokens: int = 0
    """Tokens on one root-to-leaf path at most (0: ``packing.budget``); a turn that would pass it stops
    its leaf with ``length`` (the sampled tokens kept and trained, nothing cut silently)."""
    max_observation_tokens: int = 256
    """An observation message longer than this (in tokens, its images' placeholders included) is cut, with a
    visible marker (0: never)."""
    max_image_pixels: int = 40_000_000
    """Largest observation image (width x height): a larger one is an environment error, found from a file's
    header before it is decoded (``ds_tree.data.chat_images.MAX_IMAGE_PIXELS``: an 8K screenshot is 33 M)."""
    step_timeout_s: float = 30.0
    """Seconds one environment call (``reset``, ``step``, ``fork``, ``score``) may take; a ``step`` over
    it answers the policy with a tool error, any other call ends the leaf as an environment error."""
    episode_timeout_s: float = 600.0
    """Seconds one episode tree may take; leaves still going then stop with ``timeout``."""
    workers: int = 4
    """Threads that run environment calls (``async`` methods run on an event loop in them)."""
    save_rollouts: bool = True
    """Write each step's leaves to ``output_dir/rollouts/step_<N>.jsonl`` (tokens JSONL, rank 0)."""
    turn_branching: list[int] = field(default_factory=list)
    """Children per turn boundary (boundary 0 is the prompt), e.g. ``[1, 16]``: one call turn, then
    16 answers after its observation; boundaries past the list do not fork. The product must be
    ``rollout.width``; set, it replaces ``rollout.branching`` / ``max_depth``'s quota rule for
    episodes (siblings after a boundary share everything before it; a turn shared by all of a
    task's leaves gets no GRPO advantage). Empty: the quota rule."""
    warmup_steps: int = 0
    """The run's first steps teach the turn FORMAT by SFT instead of RL: each trains the objective's
    ``ppo_epochs x mini_batches`` updates, each on ``rollout.prompts_per_step`` demonstrations that
    the environment writes (its ``demonstration(task, rng)``: messages, every assistant turn
    trained); no rollout is sampled and no ``rollout/`` metric is logged. RL starts at step
    ``warmup_steps + 1``, the optimizer's warm-up and schedule restarting there. 0: RL from step 1."""
    refresh_every: int = 0
    """After the warm-up, every ``refresh_every``-th step is an SFT step again, on the demonstrations'
    assistant turns but the last (the call format, never the answer), at ``optimizer.lr``: RL does
    not train a turn all of a task's leaves share, and updates for the answers wore that format
    down. 0: never."""
    warmup_lr: float = 0.0
    """The learning rate of the warm-up steps (after ``optimizer.warmup_steps`` of linear warm-up);
    0: ``optimizer.lr``."""

    def __post_init__(self) -> None:
        from ds_tree.errors import ConfigError

        if self.fork and self.fork not in FORK_MODES:
            raise ConfigError(f"rollout.env.fork must be one of {', '.join(FORK_MODES)} (or empty), got {self.fork!r}")
        for name in ("max_turns", "workers", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.env.{name} must be >= 1, got {getattr(self, name)}")
        if any(not isinstance(count, int) or count < 1 for count in self.turn_branching):
            raise ConfigError(f"rollout.env.turn_branching must be a list of integers >= 1, got {self.turn_branching}")
        for name in ("max_context_tokens", "max_observation_tokens", "warmup_steps", "refresh_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"rollout.env.{name} must be >= 0, got {getattr(self, name)}")
        if self.warmup_lr < 0 or not math.isfinite(self.warmup_lr):
            raise ConfigError(f"rollout.env.warmup_lr must be a finite number >= 0, got {self.warmup_lr}")
        for name in ("step_timeout_s", "episode_timeout_s"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"rollout.env.{name} must be a finite number > 0, got {getattr(self, name)}")


def path_limit(config) -> tuple[int, str]:
    """The most tokens a sampled root-to-leaf path may have, and the config fields that set it:
    ``packing.budget``, or under sequence parallelism ``budget x S`` (a longer path's tree goes to
    rows of up to that many tokens sharded over a group, as offline data's do)."""
    budget, size = config.packing.budget, config.parallel.sequence_parallel_size
    if size == 1:
        return budget, f"packing.budget ({budget})"
    return budget * size, f"packing.budget x parallel.sequence_parallel_size ({budget} x {size})"
