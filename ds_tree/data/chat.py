"""OpenAI-style chat messages -> (input_ids, loss_mask) through a tokenizer's chat template.

The loss mask is produced here, where the conversation is rendered, from the message structure:
an assistant turn trains exactly the tokens the model generates for it, i.e. the tokens between
"conversation so far + generation prompt" and "conversation including this turn". That span
includes the end-of-turn marker (``<|im_end|>``: the model must learn to stop) and whatever the
template appends to the message (a newline for ChatML). The template's generation prompt
(``<|im_start|>assistant\\n``), system, user and tool tokens stay untrained.

Finding those spans by rendering prefixes of the message list relies on prefix stability: the
rendering of the first k messages must be a token prefix of the rendering of all of them. Most
ChatML templates have it; templates that rewrite history (e.g. drop the reasoning of earlier
turns, or print the number of messages) do not. Every assistant turn is checked: its
generation-prompt rendering must be a prefix of its own rendering, which must be a prefix of the
full rendering. A turn that fails is left untrained and counted in
:attr:`RenderedChat.unstable_turns`; the caller decides (``--prefix-policy``) whether to keep
such a trajectory (full rendering, stable turns trained), drop it, or stop. Never silent.

Cost: two renderings per trained assistant turn, each tokenised in full, so O(turns x length)
per conversation (tau2-telecom: about 0.5 s for 14k tokens and 10 assistant turns).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds_tree.errors import RecordError

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "last_assistant", "all")
"""Which tokens get loss: every assistant turn, only the last one, or every token but the first."""


@dataclass
class RenderedChat:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    unstable_turns: int
    """Assistant turns left untrained because the template is not prefix-stable there."""


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _check_tool_call(where: str, call: object) -> str:
    """Validate one OpenAI tool call; return its id."""
    if not isinstance(call, dict) or not _is_str(call.get("id")) or not isinstance(call.get("function"), dict):
        raise RecordError("malformed_message", f"{where}: a tool call needs a string 'id' and a 'function' object")
    function = call["function"]
    if not _is_str(function.get("name")) or not _is_str(function.get("arguments")):
        raise RecordError(
            "malformed_message", f"{where}: tool call {call['id']!r} needs function.name and function.arguments strings"
        )
    return call["id"]


def validate_messages(where: str, messages: object, tools: object = None) -> None:
    """Raise a :class:`RecordError` (with ``where`` and the message index) for a bad conversation."""
    if not isinstance(messages, list):
        raise RecordError("malformed_message", f"{where}: 'messages' must be a list of message objects")
    if not messages:
        raise RecordError("empty_conversation", f"{where}: empty conversation ('messages' is [])")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RecordError("malformed_message", f"{where}: 'tools' must be a list of objects")
    issued: set[str] = set()
    for index, message in enumerate(messages):
        at = f"{where}: message {index}"
        if not isinstance(message, dict) or not _is_str(message.get("role")):
            raise RecordError("malformed_message", f"{at}: a message must be an object with a string 'role'")
        role, content = message["role"], message.get("content")
        if role not in ROLES:
            raise RecordError("unknown_role", f"{at}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        calls = message.get("tool_calls")
        if role == "assistant":
            if calls is not None and not isinstance(calls, list):
                raise RecordError("malformed_message", f"{at}: 'tool_calls' must be a list")
            issued.update(_check_tool_call(at, call) for call in calls or [])
            if content is not None and not _is_str(content):
                raise RecordError("malformed_message", f"{at}: 'content' must be a string or null")
            continue
        if calls:
            raise RecordError("malformed_message", f"{at}: only assistant messages may have 'tool_calls'")
        if not _is_str(content):
            raise RecordError("malformed_message", f"{at}: {role} message needs a string 'content'")
        if role == "tool" and message.get("tool_call_id") not in issued:
            raise RecordError(
                "unmatched_tool_result",
                f"{at}: tool result for call {message.get('tool_call_id')!r} without a preceding matching tool call",
            )


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without added special tokens, as ``tokenizer(texts)`` gives them.

    Straight to the Rust backend's ``encode_batch_fast`` where there is one: it skips the
    character offsets that ``__call__`` computes, most of the cost for long renderings (2-3x on
    tau2-telecom). Only when the backend has no padding or truncation configured, because
    ``__call__`` would switch those off first.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]


def _is_prefix(prefix: list[int], sequence: list[int]) -> bool:
    return len(prefix) <= len(sequence) and sequence[: len(prefix)] == prefix


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    where: str = "",
    train_on: str = "assistant",
) -> RenderedChat:
    """Render ``messages`` with ``tokenizer``'s chat template into token ids and a loss mask.

    ``train_on``: ``"assistant"`` trains every assistant turn, ``"last_assistant"`` only the last
    one, ``"all"`` every token but the first (never predicted).
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    validate_messages(where, messages, tools)

    def render(count: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:count], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    if train_on == "all":
        (full,) = _encode(tokenizer, [render(len(messages), False)])
        mask = np.ones(len(full))
        mask[0] = 0.0
        return RenderedChat(np.asarray(full, dtype=np.int64), mask, 0)
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise RecordError("no_assistant", f"{where}: no assistant message to train on")
    if train_on == "last_assistant":
        turns = turns[-1:]
    texts = [render(len(messages), False)]
    for index in turns:
        texts += [render(index, True), render(index + 1, False)]
    encoded = _encode(tokenizer, texts)
    full = encoded[0]
    mask = np.zeros(len(full))
    unstable = 0
    for header, turn in zip(encoded[1::2], encoded[2::2], strict=True):
        if _is_prefix(header, turn) and _is_prefix(turn, full):
            mask[len(header) : len(turn)] = 1.0
        else:
            unstable += 1
    return RenderedChat(np.asarray(full, dtype=np.int64), mask, unstable)
