"""TRL's preference records as trees (``ds-tree convert --format preference``; docs/DATA.md, docs/RL.md "DPO").

A record ``{"prompt", "chosen", "rejected"}`` becomes two trajectories of one group (its ``--group-key``
field, else the record's ``file:line``): the prompt followed by the chosen answer (``reward`` 1, ``trial`` 0)
and by the rejected one (``reward`` 0, ``trial`` 1), trained on the answer's tokens only. Their tree is the
prompt with the two answers as sibling leaves, the pair ``objective.kind: dpo`` takes
(:mod:`ds_tree.trees.pairs`); records sharing a group id (a long conversation whose turns were judged one by
one) merge into one tree, each pair's answers siblings at their own fork.

- conversational: ``prompt`` a list of messages, ``chosen`` and ``rejected`` the messages that follow
  (usually one assistant message): each whole conversation rendered by the chat template, its assistant
  turns after the prompt trained. Without ``prompt`` (TRL's implicit prompt), ``chosen`` and ``rejected``
  are whole conversations and their last assistant turns are trained.
- text: ``prompt``, ``chosen`` and ``rejected`` strings, each encoded without added special tokens (as
  ``ds-tree sample`` encodes a text prompt) and the tokenizer's end-of-sequence token after each answer.

A record whose two answers give the same tokens, or whose prompt is not a prefix of its rendered answers
(a chat template that is not prefix-stable), is refused (``--skip-bad`` counts it).
"""

from __future__ import annotations

import numpy as np

from ds_tree.data.chat import check_text, render_chat
from ds_tree.errors import RecordError
from ds_tree.trees.trajectory import Trajectory

SIDES = ("chosen", "rejected")
REWARDS = {"chosen": 1.0, "rejected": 0.0}


def preference_trajectories(where: str, record: dict, tokenizer, group: str | int) -> list[Trajectory]:
    """The record's chosen and rejected trajectories (module docstring), in group ``group``."""
    missing = [key for key in SIDES if key not in record]
    if missing:
        raise RecordError("bad_preference", f"{where}: a preference record needs {missing[0]!r} (and prompt)")
    answers = [record[side] for side in SIDES]
    prompt = record.get("prompt")
    if all(isinstance(answer, str) for answer in answers) and (prompt is None or isinstance(prompt, str)):
        encoded = [_text(where, tokenizer, prompt, answer) for answer in answers]
    elif all(isinstance(answer, list) for answer in answers) and (prompt is None or isinstance(prompt, list)):
        encoded = [_conversation(where, tokenizer, prompt, answer, record.get("tools")) for answer in answers]
    else:
        raise RecordError(
            "bad_preference",
            f"{where}: prompt, chosen and rejected must be all strings (text) or all lists of messages "
            "(conversational)",
        )
    (chosen_ids, _), (rejected_ids, _) = encoded
    if np.array_equal(chosen_ids, rejected_ids):
        raise RecordError("bad_preference", f"{where}: chosen and rejected give the same tokens: no preference")
    return [
        Trajectory(ids, mask, group_id=group, reward=REWARDS[side], trial=trial, source=where)
        for trial, (side, (ids, mask)) in enumerate(zip(SIDES, encoded, strict=True))
    ]


def _text(where: str, tokenizer, prompt: str | None, answer: str) -> tuple[np.ndarray, np.ndarray]:
    if not prompt:
        raise RecordError("bad_preference", f"{where}: a text preference record needs a non-empty 'prompt'")
    ids = []
    for text in (prompt, answer):
        try:
            check_text(where, text)
        except ValueError as error:
            raise RecordError("invalid_text", str(error)) from None
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is None:
        raise RecordError("bad_preference", f"{where}: the tokenizer has no end-of-sequence token to end an answer")
    answer_ids = [*ids[1], tokenizer.eos_token_id]
    mask = np.concatenate([np.zeros(len(ids[0])), np.ones(len(answer_ids))])
    return np.asarray([*ids[0], *answer_ids], dtype=np.int64), mask


def _conversation(where: str, tokenizer, prompt, answer, tools) -> tuple[np.ndarray, np.ndarray]:
    if prompt is None:  # implicit prompt: the whole conversation, its last assistant turn trained
        rendered = render_chat(tokenizer, answer, tools, where=where, train_on="last_assistant")
        return rendered.input_ids, _stable(where, rendered)
    rendered = render_chat(tokenizer, [*prompt, *answer], tools, where=where, train_on="assistant")
    context = render_chat(tokenizer, prompt, tools, where=where, train_on="all").input_ids
    if not np.array_equal(rendered.input_ids[: context.size], context):
        raise RecordError(
            "prefix_unstable", f"{where}: the prompt's rendering is not a prefix of the rendered conversation"
        )
    mask = _stable(where, rendered).copy()
    mask[: context.size] = 0.0  # the prompt's own assistant turns are context
    if not mask.any():
        raise RecordError("no_assistant", f"{where}: the answer has no assistant message to train on")
    return rendered.input_ids, mask


def _stable(where: str, rendered) -> np.ndarray:
    if rendered.unstable_turns:
        raise RecordError("prefix_unstable", f"{where}: the chat template is not prefix-stable for the answer")
    return rendered.loss_mask
