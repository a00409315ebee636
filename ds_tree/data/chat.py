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

Content is text: a special token's string inside a message's content or a tool call's arguments
(``<|im_end|>`` in a tool result) is encoded as ordinary text, never as the special id; only the
template's own structure produces special ids (:class:`ChatText`). Text that is not valid Unicode (a
lone surrogate) is a record error.

Cost: two renderings per trained assistant turn, each tokenised in full, so O(turns x length)
per conversation (tau2-telecom: about 0.5 s for 14k tokens and 10 assistant turns).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ds_tree.data.chat_images import check_parts, expand_image_pads, image_parts
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
    try:
        check_text(where, tools)
    except ValueError as error:
        raise RecordError("invalid_text", f"{error} in 'tools'") from None
    issued: set[str] = set()
    for index, message in enumerate(messages):
        at = f"{where}: message {index}"
        if not isinstance(message, dict) or not _is_str(message.get("role")):
            raise RecordError("malformed_message", f"{at}: a message must be an object with a string 'role'")
        try:
            check_text(at, message)
        except ValueError as error:
            raise RecordError("invalid_text", str(error)) from None
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
        if isinstance(content, list):  # content parts: text and images (ds_tree.data.chat_images)
            check_parts(at, content)
        elif not _is_str(content):
            raise RecordError("malformed_message", f"{at}: {role} message needs a string 'content' or a list of parts")
        if role == "tool" and message.get("tool_call_id") not in issued:
            raise RecordError(
                "unmatched_tool_result",
                f"{at}: tool result for call {message.get('tool_call_id')!r} without a preceding matching tool call",
            )


def _encode(tokenizer, texts: list[str], split_special_tokens: bool = False) -> list[list[int]]:
    """Token ids of each text, without added special tokens, as ``tokenizer(texts)`` gives them;
    with ``split_special_tokens`` a special token's string is encoded as ordinary text.

    Straight to the Rust backend's ``encode_batch_fast`` where there is one: it skips the
    character offsets that ``__call__`` computes, most of the cost for long renderings (2-3x on
    tau2-telecom). Only when the backend has no padding or truncation configured, because
    ``__call__`` would switch those off first. The backend's ``encode_special_tokens`` flag is set
    for the call and put back (``__call__`` leaves it as its last caller asked).
    """
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return tokenizer(texts, add_special_tokens=False, split_special_tokens=split_special_tokens)["input_ids"]
    before = backend.encode_special_tokens
    backend.encode_special_tokens = split_special_tokens
    try:
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
    finally:
        backend.encode_special_tokens = before


# ------------------------------------------------------------------ content is text, never structure
class UnsafeText(ValueError):
    """A special token's string where rendering cannot keep it ordinary text."""


_PLACEHOLDER = "\x00ds_tree_text_{}\x00"


def special_token_strings(tokenizer) -> list[str]:
    """The strings of the tokenizer's special tokens, longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = {token.content for token in decoder.values() if getattr(token, "special", True)}
    found.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted((token for token in found if token), key=len, reverse=True)


def _strings(value: object):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def check_text(where: str, value: object) -> None:
    """Raise a ValueError naming ``where`` if a string in ``value`` is not valid Unicode text (a lone
    surrogate, as a ``\\udcff`` JSON escape gives: no tokenizer can encode it)."""
    for text in _strings(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"{where}: text with a lone surrogate {text[error.start : error.end]!r} at character "
                f"{error.start} (not valid Unicode)"
            ) from None


class ChatText:
    """Renders a conversation with the chat template and encodes it so that only the template's own
    structure produces special-token ids: a special token's string inside a message's content or a
    tool call's arguments (what an environment, a tool or a record wrote) is encoded as ordinary text.

    How: the strings that hold a special token's string are rendered as placeholders too; the
    placeholder rendering, with each placeholder put back, must give the real rendering (else
    :class:`UnsafeText`), which locates the content in it. The text between the template's own
    special tokens is encoded with ``split_special_tokens``. A conversation whose strings hold no
    special token's string is encoded exactly as before (one plain encoding of the rendering). A
    special token's string anywhere else (a tool schema, a name, an id) is refused (:class:`UnsafeText`).
    """

    def __init__(self, tokenizer, messages: list[dict], tools: list[dict] | None) -> None:
        self.tokenizer = tokenizer
        self.messages, self.tools = messages, tools
        self.specials = special_token_strings(tokenizer)
        self.values: dict[str, str] = {}
        self.shown = self._protect(messages) if self._carries(messages) or self._carries(tools) else None
        if self.shown is not None and self._carries(self.shown) or self._carries(tools):
            raise UnsafeText("a special token's string outside message content or tool-call arguments")

    def _carries(self, value: object) -> bool:
        return any(special in text for text in _strings(value) for special in self.specials)

    def _placeholder(self, text: str) -> str:
        if not any(special in text for special in self.specials):
            return text
        key = _PLACEHOLDER.format(len(self.values))
        self.values[key] = text
        return key

    def _protect(self, messages: list[dict]) -> list[dict]:
        shown = []
        for message in messages:
            message = dict(message)
            if isinstance(message.get("content"), str):
                message["content"] = self._placeholder(message["content"])
            elif isinstance(message.get("content"), list):  # text parts are content too
                message["content"] = [
                    {**part, "text": self._placeholder(part["text"])} if part.get("type") == "text" else part
                    for part in message["content"]
                ]
            if isinstance(message.get("tool_calls"), list):
                calls = []
                for call in message["tool_calls"]:
                    if isinstance(call, dict) and isinstance(call.get("function"), dict):
                        function = dict(call["function"])
                        if isinstance(function.get("arguments"), str):
                            function["arguments"] = self._placeholder(function["arguments"])
                        call = {**call, "function": function}
                    calls.append(call)
                message["tool_calls"] = calls
            shown.append(message)
        return shown

    def render(self, count: int, generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """The rendering of the first ``count`` messages and the spans of protected text in it."""

        def render(messages: list[dict]) -> str:
            return self.tokenizer.apply_chat_template(
                messages[:count], tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
            )

        text = render(self.messages)
        if self.shown is None:
            return text, []
        shown = render(self.shown)
        pieces, spans, position = [], [], 0
        for match in re.finditer("\x00ds_tree_text_[0-9]+\x00", shown):
            pieces.append(shown[position : match.start()])
            start = sum(map(len, pieces))
            value = self.values.get(match.group())
            if value is None:
                raise UnsafeText("the chat template changed a placeholder of message text")
            pieces.append(value)
            spans.append((start, start + len(value)))
            position = match.end()
        pieces.append(shown[position:])
        if "".join(pieces) != text:
            raise UnsafeText(
                "the chat template transforms message text that holds a special token's string, so that text "
                "cannot be located to encode it as text"
            )
        return text, spans

    def encode(self, renderings: list[tuple[str, list[tuple[int, int]]]]) -> list[list[int]]:
        return encode_rendered(self.tokenizer, renderings, self.specials)


def encode_rendered(
    tokenizer, renderings: list[tuple[str, list[tuple[int, int]]]], specials: list[str] | None = None
) -> list[list[int]]:
    """Ids of rendered texts, each with the character spans that are text (special tokens' strings
    in a span encoded as text; outside the spans special tokens are parsed as the tokenizer does)."""
    plain = [index for index, (_, spans) in enumerate(renderings) if not spans]
    out: list[list[int]] = [[] for _ in renderings]
    for index, ids in zip(plain, _encode(tokenizer, [renderings[i][0] for i in plain]), strict=True):
        out[index] = list(ids)
    specials = special_token_strings(tokenizer) if specials is None else specials
    pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    for index, (text, spans) in enumerate(renderings):
        if not spans:
            continue
        runs, marks, position = [], [], 0
        for match in pattern.finditer(text) if pattern else ():
            if any(start < match.end() and match.start() < end for start, end in spans):
                continue  # inside content: text
            runs.append(text[position : match.start()])
            marks.append(match.group())
            position = match.end()
        runs.append(text[position:])
        encoded = _encode(tokenizer, runs, split_special_tokens=True)
        ids: list[int] = []
        for run_ids, mark in zip(encoded, marks + [None], strict=True):
            ids += run_ids
            if mark is not None:
                ids.append(int(tokenizer.convert_tokens_to_ids(mark)))
        out[index] = ids
    return out


def _expanded(encoded: list[list[int]], image_token_id, image_tokens, where: str) -> list[list[int]]:
    """Each rendering with its images' placeholders expanded (the first k images: renderings are prefixes)."""
    if image_token_id is None:
        return encoded
    out = []
    for ids in encoded:
        count = sum(1 for token in ids if token == image_token_id)
        if count > len(image_tokens):
            raise RecordError("bad_image", f"{where}: the rendering has more image placeholders than image parts")
        out.append(expand_image_pads(ids, image_token_id, list(image_tokens[:count]), where))
    return out


def _is_prefix(prefix: list[int], sequence: list[int]) -> bool:
    return len(prefix) <= len(sequence) and sequence[: len(prefix)] == prefix


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    where: str = "",
    train_on: str = "assistant",
    image_token_id: int | None = None,
    image_tokens: list[int] = (),
) -> RenderedChat:
    """Render ``messages`` with ``tokenizer``'s chat template into token ids and a loss mask.

    ``train_on``: ``"assistant"`` trains every assistant turn, ``"last_assistant"`` only the last
    one, ``"all"`` every token but the first (never predicted). Messages with image parts need a
    vision processor folder's tokenizer, its ``image_token_id`` and each image's token count
    (``image_tokens``, in order): every rendering's ``<|image_pad|>`` are expanded to them.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
    validate_messages(where, messages, tools)
    if image_parts(messages) and image_token_id is None:
        raise RecordError(
            "images_without_processor",
            f"{where}: the record has image parts; convert with a processor folder "
            "(ds-tree make-tokenizer --vision FAMILY) as --tokenizer",
        )
    try:
        chat = ChatText(tokenizer, messages, tools)
        if train_on == "all":
            (full,) = _expanded(chat.encode([chat.render(len(messages), False)]), image_token_id, image_tokens, where)
    except UnsafeText as error:
        raise RecordError("special_token_text", f"{where}: {error}") from None
    if train_on == "all":
        mask = np.ones(len(full))
        mask[0] = 0.0
        return RenderedChat(np.asarray(full, dtype=np.int64), mask, 0)
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise RecordError("no_assistant", f"{where}: no assistant message to train on")
    if train_on == "last_assistant":
        turns = turns[-1:]
    try:
        texts = [chat.render(len(messages), False)]
        for index in turns:
            texts += [chat.render(index, True), chat.render(index + 1, False)]
        encoded = _expanded(chat.encode(texts), image_token_id, image_tokens, where)
    except UnsafeText as error:
        raise RecordError("special_token_text", f"{where}: {error}") from None
    full = encoded[0]
    mask = np.zeros(len(full))
    unstable = 0
    for header, turn in zip(encoded[1::2], encoded[2::2], strict=True):
        if _is_prefix(header, turn) and _is_prefix(turn, full):
            mask[len(header) : len(turn)] = 1.0
        else:
            unstable += 1
    return RenderedChat(np.asarray(full, dtype=np.int64), mask, unstable)
