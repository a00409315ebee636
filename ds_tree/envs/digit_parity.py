"""The online RL demo's task (docs/RL.md, *Online RL*): write digits of the parity the prompt asks for.

Prompts say ``even`` or ``odd`` (``metadata["parity"]``); the reward is the share of the completion's
characters, spaces left out, that are digits of that parity: 0 for an empty completion, 1 for one made
only of such digits. A randomly initialised model draws tokens about uniformly from the project
tokenizer's 1024, whose characters are about 5% even and 5% odd digits, so the reward starts near 0.05;
it reaches 1 only by learning to read the prompt, since half the prompts ask for each parity.
Use it as ``rollout.reward: ds_tree.envs.digit_parity:reward``.
"""

from __future__ import annotations

from ds_tree.rollout.rewards import RewardRequest

DIGITS = {"even": set("02468"), "odd": set("13579")}


def reward(request: RewardRequest) -> float:
    """Share of the completion's non-space characters that are digits of ``metadata["parity"]``."""
    parity = request.metadata.get("parity")
    if parity not in DIGITS:
        raise ValueError(f"metadata['parity'] must be 'even' or 'odd', got {parity!r}")
    characters = [c for c in request.completion if not c.isspace()]
    if not characters:
        return 0.0
    return sum(c in DIGITS[parity] for c in characters) / len(characters)
