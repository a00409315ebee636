"""Prompts for the samplers: the prompts JSONL that ``ds-tree sample`` and the online loop
(``rollout.prompts``) both read, and the tokens that end a completion."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds_tree.data.chat import ChatText, UnsafeText, check_text, validate_messages
from ds_tree.data.jsonl import read_jsonl
from ds_tree.errors import DataError, RecordError


@dataclass(frozen=True)
class Prompt:
    """One line of ``rollout.prompts``."""

    ids: np.ndarray
    """int64 token ids the sampler continues."""
    text: str
    """The prompt as the reward function sees it (decoded from ``prompt_ids`` when given as ids)."""
    metadata: dict
    """Passed to the reward function untouched (the answer, the puzzle's numbers, ...)."""
    source: str
    """``file:line``."""
    label: str
    """The line's ``group_id``, else ``prompt-<index>``: the start of its groups' ids."""
    tag: str = ""
    """The line's ``tag`` (an evaluation's per-tag breakdown, docs/EVAL.md); empty: none."""


def read_prompts(path: str | Path, tokenizer, vocab_size: int) -> list[Prompt]:
    """The prompts JSONL, in ``ds-tree sample``'s format (:func:`prompt_ids`): one of
    ``"prompt"`` (text), ``"messages"`` (a chat, rendered with the generation prompt) or ``"prompt_ids"``,
    an optional ``"metadata"`` object for the reward, an optional ``"group_id"`` label and an optional
    ``"tag"`` (:func:`check_tag`).

    Errors name ``file:line``: unknown keys, not exactly one prompt, ids outside ``[0, vocab_size)``,
    metadata that is not an object, a file without prompts.
    """
    prompts = []
    for where, record in read_jsonl(path):
        unknown = sorted(set(record) - {"prompt", "messages", "prompt_ids", "metadata", "group_id", "tag"})
        if unknown:
            raise DataError(
                f"{where}: unknown key {unknown[0]!r} (known: group_id, messages, metadata, prompt, prompt_ids, tag)"
            )
        metadata = record.get("metadata", {})
        if not isinstance(metadata, dict):
            raise DataError(f"{where}: 'metadata' must be an object, got {type(metadata).__name__}")
        ids = prompt_ids(where, record, tokenizer)
        if max(ids) >= vocab_size:
            raise DataError(f"{where}: prompt token id {max(ids)} is >= the model's vocab size {vocab_size}")
        text = record["prompt"] if "prompt" in record else tokenizer.decode(ids)
        label = str(record.get("group_id", f"prompt-{len(prompts)}"))
        tag = check_tag(where, record.get("tag", ""))
        prompts.append(Prompt(np.asarray(ids, dtype=np.int64), text, metadata, where, label, tag))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


TAG = re.compile(r"[A-Za-z0-9_.-]*")


def check_tag(where: str, tag: object) -> str:
    """A line's ``"tag"``: letters, digits, ``_``, ``.``, ``-`` (it names metrics, ``eval/TAG/reward_mean``)."""
    if not isinstance(tag, str) or not TAG.fullmatch(tag):
        raise DataError(f"{where}: 'tag' must be a string of letters, digits, '_', '.' or '-', got {tag!r}")
    return tag


def prompt_ids(where: str, record: dict, tokenizer) -> list[int]:
    """The token ids of a prompts line: its ``prompt_ids``, its ``prompt`` text encoded without added
    special tokens (markup in it is parsed: the text is the model's input as written), or its chat
    ``messages`` rendered with the generation prompt (their content encoded as text)."""
    given = [key for key in ("prompt", "messages", "prompt_ids") if key in record]
    if len(given) != 1:
        raise DataError(f"{where}: a prompt line needs exactly one of 'prompt', 'messages', 'prompt_ids'")
    if "prompt_ids" in record:
        ids = record["prompt_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
            raise DataError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        return ids
    if "messages" in record:  # checked as convert checks a chat; its content encoded as text, never markup
        messages = record["messages"]
        validate_messages(where, messages)
        try:
            chat = ChatText(tokenizer, messages, None)
            return chat.encode([chat.render(len(messages), True)])[0]
        except UnsafeText as error:
            raise RecordError("special_token_text", f"{where}: {error}") from None
    text = record["prompt"]  # the model's input verbatim: a prompt written in the template's own markup
    if not isinstance(text, str) or not text:
        raise DataError(f"{where}: the prompt must be a non-empty string")
    try:
        check_text(where, text)
    except ValueError as error:
        raise DataError(str(error)) from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, model_config, extra: Sequence[str] = ()) -> list[int]:
    """Where a completion ends: the model's and the tokenizer's EOS, the chat turn's end token, and
    each token of ``extra`` (a :class:`DataError` names one the tokenizer does not have)."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    ids = getattr(text_config, "eos_token_id", None)  # a vision-language model's: its text model's
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    ids.add(tokenizer.eos_token_id)
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if turn_end is not None and turn_end != tokenizer.unk_token_id:
        ids.add(turn_end)
    for token in extra:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise DataError(f"{token!r} is not a token of the tokenizer")
        ids.add(token_id)
    return sorted(i for i in ids if i is not None)
