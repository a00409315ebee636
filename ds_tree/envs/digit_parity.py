"""The online RL demo's task (docs/RL.md, *Online RL*): write digits of the parity the prompt asks for.

Prompts say ``even`` or ``odd`` (``metadata["parity"]``); the reward is the share of the completion's
characters, spaces left out, that are digits of that parity: 0 for an empty completion, 1 for one made
only of such digits. A randomly initialised model draws tokens about uniformly from the project
tokenizer's 1024, whose characters are about 5% even and 5% odd digits, so the reward starts near 0.05;
it reaches 1 only by learning to read the prompt, since half the prompts ask for each parity.
Use it as ``rollout.reward: ds_tree.envs.digit_parity:reward``.

:func:`preference_records` writes the task's preference set for DPO (docs/RL.md, "DPO on the parity task"):
per prompt, chosen answers made of digits of the asked parity, rejected ones of the other parity's digits.
"""

from __future__ import annotations

import random

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


def preference_records(prompts: list[dict], pairs_per_prompt: int, seed: int = 0) -> list[dict]:
    """TRL text preference records for ``prompts`` (the prompts file's objects, each with ``metadata["parity"]``):
    ``pairs_per_prompt`` per prompt, each a chosen answer of 3-8 digits of the asked parity (reward 1 under
    :func:`reward`) and a rejected one of as many digits of the other parity (reward 0), space-separated.
    Both answers are digits, so only the parity separates them: a model that learns the preference reads the
    prompt. Drawn from ``random.Random(seed)``: the same arguments give the same records."""
    rng = random.Random(seed)
    records = []
    for prompt in prompts:
        parity = prompt["metadata"]["parity"]
        if parity not in DIGITS:
            raise ValueError(f"metadata['parity'] must be 'even' or 'odd', got {parity!r}")
        other = "odd" if parity == "even" else "even"
        for _ in range(pairs_per_prompt):
            count = rng.randint(3, 8)
            chosen, rejected = (" ".join(rng.choices(sorted(DIGITS[kind]), k=count)) for kind in (parity, other))
            records.append({"prompt": prompt["prompt"], "chosen": " " + chosen, "rejected": " " + rejected})
    return records
