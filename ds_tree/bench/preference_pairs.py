"""Multi-turn preference pairs that share long histories, from chat trials (``ds-tree bench --objective dpo``;
docs/RL.md, "Timing distill and dpo steps").

For each group of a chat JSONL (``{"group_id", "messages", ...}``, e.g. ``../shared/data/tau2-telecom``), its
first trial's conversation gives ``pairs`` preference records (TRL's conversational format with an explicit
prompt): at assistant turns spread over the conversation, the prompt is the history before the turn, chosen
is the turn as it was, rejected another assistant turn's text in its place (a plausible message in the wrong
place). Every record carries the group id, so ``ds-tree convert --format preference`` makes one tree per
conversation: its history once, each pair's answers siblings at their own turn. A flat trainer computes the
history twice per pair, and twice more under the reference.

``max_message_chars`` cuts every message's text to its first characters before the pairs are chosen, so
their histories can be timed flat on a CPU: in agent data most of the shared history is one long message
(tau2-telecom's system prompt is a 23 k-character policy, ~12 k of a history's ~13 k tokens). The cut is
made once per conversation, so every turn stays, each record's history is still a prefix of the next, and
the tree keeps its shape with a shorter stem. ``tools/history_pairs.py`` runs it from the command line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ds_tree.data.jsonl import read_jsonl, write_jsonl
from ds_tree.errors import DataError


def history_pairs(conversation: list[dict], pairs: int) -> list[tuple[list[dict], dict, dict]]:
    """``(history, chosen, rejected)`` at ``pairs`` assistant turns after the first, evenly spread."""
    turns = [i for i, message in enumerate(conversation) if message["role"] == "assistant"]
    texts = [conversation[i].get("content") or "" for i in turns]
    found = []
    for slot in np.unique(np.linspace(1, len(turns) - 1, pairs).round().astype(int)) if len(turns) > 1 else []:
        index = turns[slot]
        chosen = conversation[index]
        other = next((text for text in texts[::-1] if text and text != (chosen.get("content") or "")), "")
        rejected = {"role": "assistant", "content": other or "I cannot help with that."}
        found.append((conversation[:index], chosen, rejected))
    return found


def cut_messages(conversation: list[dict], max_chars: int | None) -> list[dict]:
    """``conversation`` with every text ``content`` cut to its first ``max_chars`` characters (``None``: as
    it is); tool calls and other fields are kept."""
    if max_chars is None:
        return conversation
    cut = lambda content: content[:max_chars] if isinstance(content, str) else content  # noqa: E731
    return [message | {"content": cut(message["content"])} if "content" in message else message
            for message in conversation]  # fmt: skip


def write_history_pairs(
    trials: str | Path, output: str | Path, pairs: int = 3, max_message_chars: int | None = None
) -> dict:
    """The preference records of every group's first trial in ``trials`` (module docstring) to ``output``,
    its messages cut to ``max_message_chars``. A DataError naming ``file:line`` for a record without
    ``group_id`` or ``messages``."""
    first: dict[str, list[dict]] = {}
    for where, record in read_jsonl(Path(trials)):
        missing = [field for field in ("group_id", "messages") if field not in record]
        if missing:
            raise DataError(f"{where}: no {' or '.join(missing)} (a chat trial: group_id, messages)")
        first.setdefault(str(record["group_id"]), cut_messages(record["messages"], max_message_chars))
    records = [
        {"group_id": group, "prompt": history, "chosen": [chosen], "rejected": [rejected]}
        for group, conversation in first.items()
        for history, chosen, rejected in history_pairs(conversation, pairs)
    ]
    write_jsonl(Path(output), records)
    return {"groups": len(first), "records": len(records)}
