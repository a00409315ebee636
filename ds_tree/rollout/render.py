"""The trainer's side of a conversation: chat template, tool-call parsing, token-in-token-out bridging.

An environment speaks messages; the policy speaks tokens. :class:`Renderer` turns the opening
messages into prompt ids, parses a sampled assistant turn into text and tool calls, and appends the
environment's next messages to the ids sampled so far with :meth:`Renderer.bridge`, never
re-rendering the sampled turn: a chat template does not always give back the ids a model sampled
(the model may space a tool call differently from the template, or stop on another token), and
re-tokenising the whole history each turn costs time growing with its length.

Bridging renders the conversation before and after the new messages (the sampled turn as the
parsed message: its ids are not used) and appends the ids of the difference, behind the template's
text between an assistant turn's stop token and the next message (``"\\n"`` for ChatML). That is
exact when the template is prefix-stable (rendering k messages is a string prefix of rendering
more): then bridging equals a full re-render whenever the sampled ids are the template's own
rendering of the turn (tests/test_multiturn.py). When the longer rendering does not extend the
shorter one (a template that rewrites history, or an environment that returns a new ``history``),
:class:`NotAppendOnly` is raised and the rollout starts a new branch from the full rendering.

Tool calls are parsed in the Hermes/Qwen format of the project's template: ``<tool_call>`` +
``{"name": ..., "arguments": {...}}`` + ``</tool_call>``. A malformed call is not an exception:
:meth:`Renderer.parse` returns it as a parse error, which the rollout shows the policy as a tool
message (``parse_error_message``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ds_tree.data.chat import ChatText, UnsafeText, encode_rendered, special_token_strings
from ds_tree.rollout.env import EnvFailure, ToolCall, Turn

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


class NotAppendOnly(Exception):
    """The conversation's new rendering does not extend the old one (bridging would realign tokens)."""


@dataclass
class ParsedTurn:
    turn: Turn
    error: str | None = None
    """Why the tool calls could not be parsed (None: parsed, or no call)."""


MAX_CALL_DEPTH = 32
"""Deepest nesting of a tool call's JSON that is passed on; deeper is a parse error (re-encoding it,
rendering it and every environment's use of it would recurse that deep)."""


def json_depth(value: object) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack += [(child, depth + 1) for child in item.values()]
        elif isinstance(item, list):
            stack += [(child, depth + 1) for child in item]
    return deepest


def parse_tool_calls(text: str, call_prefix: str = "call") -> ParsedTurn:
    """Text and tool calls of a decoded assistant turn; a malformed call gives ``error``."""
    calls, errors = [], []
    for index, match in enumerate(_CALL.finditer(text)):
        body = match.group(1).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            errors.append(f"tool call {index + 1}: not JSON ({error.msg} at character {error.pos}): {body[:80]!r}")
            continue
        except (RecursionError, ValueError) as error:  # nested too deep for the parser, a huge number...
            errors.append(f"tool call {index + 1}: not usable JSON ({type(error).__name__}): {body[:80]!r}")
            continue
        if json_depth(value) > MAX_CALL_DEPTH:
            errors.append(f"tool call {index + 1}: nested deeper than {MAX_CALL_DEPTH} levels: {body[:80]!r}")
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            errors.append(f"tool call {index + 1}: needs an object with a string 'name', got {body[:80]!r}")
            continue
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            errors.append(f"tool call {index + 1}: 'arguments' must be an object, got {json.dumps(arguments)[:80]}")
            continue
        calls.append(ToolCall(value["name"], arguments, f"{call_prefix}_{index}"))
    outside = _CALL.sub("", text)
    if CALL_OPEN in outside or CALL_CLOSE in outside:
        errors.append(f"unbalanced {CALL_OPEN} / {CALL_CLOSE} markup")
    turn = Turn(text=outside.strip(), tool_calls=calls, raw=text)
    return ParsedTurn(turn, "; ".join(errors) or None)


def parse_error_message(error: str) -> dict:
    """The observation the policy gets for a malformed tool call (the environment is not stepped)."""
    return {"role": "tool", "tool_call_id": "parse_error", "content": f"error: could not parse your tool call: {error}"}


class Renderer:
    """Chat template and tokenizer of the policy (module docstring)."""

    def __init__(self, tokenizer, stop_ids: Sequence[int], max_observation_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = {int(token) for token in stop_ids}
        self.max_observation_tokens = max_observation_tokens
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        text = self.render(probe, None, generation_prompt=False)
        stop = next(
            (
                tokenizer.convert_ids_to_tokens(i)
                for i in sorted(self.stop_ids)
                if tokenizer.convert_ids_to_tokens(i) in text
            ),
            None,
        )
        if stop is None:
            raise ValueError("the chat template ends an assistant turn with none of the stop tokens")
        # what the template writes after an assistant turn's stop token, before the next message
        self.after_stop = text[text.rindex(stop) + len(stop) :]

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.render_spans(messages, tools, generation_prompt)[0]

    def render_spans(
        self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and the character spans in it of content that holds a special token's string
        (:class:`~ds_tree.data.chat.ChatText`); :class:`EnvFailure` where such a string cannot be
        kept text (a tool schema, a name)."""
        try:
            chat = ChatText(self.tokenizer, messages, tools or None)
            return chat.render(len(messages), generation_prompt)
        except UnsafeText as error:
            raise EnvFailure(str(error)) from None

    def encode(self, text: str, spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Ids of rendered ``text``: the template's special tokens parsed, the ``spans`` (content) text."""
        return encode_rendered(self.tokenizer, [(text, list(spans))])[0]

    def encode_content(self, text: str) -> list[int]:
        """Ids of message content: all of it ordinary text (a special token's string included)."""
        return self.encode(text, [(0, len(text))] if text else [])

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """Ids of a conversation's full rendering, ending in the generation prompt; content that
        spells a special token is encoded as text (only the template's structure gives special ids)."""
        return self.encode(*self.render_spans(messages, tools, generation_prompt=True))

    def parse(self, sampled_ids: Sequence[int], call_prefix: str = "call") -> ParsedTurn:
        """The sampled assistant turn (its final stop token left out) as text and tool calls."""
        ids = list(sampled_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        parsed = parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=False), call_prefix)
        specials = special_token_strings(self.tokenizer)
        for index, call in enumerate(parsed.turn.tool_calls):  # rendered as markup by some templates
            spelled = json.dumps([call.name, call.arguments], ensure_ascii=False)
            if any(special in spelled for special in specials):
                error = f"tool call {index + 1}: its name or arguments contain a special token"
                parsed.turn.tool_calls = []
                return ParsedTurn(parsed.turn, "; ".join(filter(None, [parsed.error, error])))
        return parsed

    def cut(self, message: dict) -> dict:
        """``message`` with its content cut to ``max_observation_tokens`` tokens and a visible marker."""
        limit = self.max_observation_tokens
        if not limit:
            return message
        ids = self.encode_content(message["content"])
        if len(ids) <= limit:
            return message
        kept = self.tokenizer.decode(ids[:limit])
        return {**message, "content": f"{kept}\n[observation cut: {len(ids) - limit} more tokens]"}

    def bridge(
        self,
        previous_ids: Sequence[int],
        messages: list[dict],
        new_messages: list[dict],
        tools: list[dict] | None,
    ) -> list[int]:
        """Ids to append to ``previous_ids`` (a conversation ending in a sampled assistant turn, its
        stop token last; ``messages`` the same conversation as messages) for ``new_messages`` and the
        next generation prompt. Raises :class:`NotAppendOnly` when the template does not extend."""
        if not previous_ids or previous_ids[-1] not in self.stop_ids:
            raise ValueError("bridge needs ids that end with a stop token (a finished assistant turn)")
        before = self.render(messages, tools, generation_prompt=False)
        after, spans = self.render_spans(messages + new_messages, tools, generation_prompt=True)
        if not after.startswith(before) or not before.endswith(self.after_stop):
            raise NotAppendOnly("the rendering of the new conversation does not extend the sampled one")
        shift = len(before) - len(self.after_stop)  # new messages' content spans, in the appended text
        appended = [(start - shift, end - shift) for start, end in spans if start >= len(before)]
        return self.encode(self.after_stop + after[len(before) :], appended)
