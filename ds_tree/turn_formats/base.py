"""What a turn is and what a turn format is: how a sampled assistant turn splits into reasoning, text
and tool calls.

A :class:`Turn` (its text, parsed :class:`ToolCall` s and reasoning) is what an environment sees of the
policy's assistant turn (:mod:`ds_tree.rollout.env`). A :class:`TurnFormat` is one model family's dialect
(docs/ENVIRONMENTS.md, *Chat formats*): its tool-call markup (parsed by :meth:`TurnFormat.parse_calls`),
its reasoning markup (``reasoning`` open/close strings, e.g. ``<think>``), the special tokens that end a
turn besides EOS (``stop_tokens``), and the strings of a chat template that identify it (``markers``, for
``rollout.env.format: auto``). The chat template renders tool results and history; the format shapes the
assistant message it renders (:meth:`TurnFormat.message`).

A malformed call is never an exception: :meth:`TurnFormat.parse` returns it as an error string,
which the rollout shows the policy as a tool message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """One parsed tool call of an assistant turn."""

    name: str
    arguments: dict
    id: str = ""


@dataclass
class Turn:
    """The policy's assistant turn, as the environment sees it."""

    text: str
    """The turn's text outside tool calls (stripped)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    raw: str = ""
    """The whole decoded turn, tool-call markup included (what a text env such as SkyRL's takes)."""
    reasoning: str = ""
    """The turn's reasoning (a ``<think>`` block, harmony's analysis channel); empty if none."""

    def message(self) -> dict:
        """The turn as an OpenAI-style assistant message (its reasoning as ``reasoning_content``)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in self.tool_calls
            ]
        return message


MAX_CALL_DEPTH = 32
"""Deepest nesting of a tool call's JSON that is passed on; deeper is a parse error (re-encoding it,
rendering it and every environment's use of it would recurse that deep)."""


@dataclass
class ParsedTurn:
    turn: Turn
    error: str | None = None
    """Why the tool calls could not be parsed (None: parsed, or no call)."""


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


def load_json(where: str, body: str) -> tuple[object, str | None]:
    """``body`` parsed as JSON, or an error naming ``where`` (never an exception)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return None, f"{where}: not JSON ({error.msg} at character {error.pos}): {body[:80]!r}"
    except (RecursionError, ValueError) as error:  # nested too deep for the parser, a huge number...
        return None, f"{where}: not usable JSON ({type(error).__name__}): {body[:80]!r}"
    if json_depth(value) > MAX_CALL_DEPTH:
        return None, f"{where}: nested deeper than {MAX_CALL_DEPTH} levels: {body[:80]!r}"
    return value, None


def call_from_object(where: str, value: object, arguments_key: str, call_id: str) -> tuple[ToolCall | None, str | None]:
    """A :class:`ToolCall` from a parsed ``{"name": ..., arguments_key: {...}}`` object, or an error."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, f"{where}: needs an object with a string 'name', got {json.dumps(value)[:80]}"
    arguments = value.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None, f"{where}: '{arguments_key}' must be an object, got {json.dumps(arguments)[:80]}"
    return ToolCall(value["name"], arguments, call_id), None


class TurnFormat:
    """One family's turn format (module docstring). Subclasses set the class attributes and
    implement :meth:`parse_calls`; register them with ``TURN_FORMATS.register(name)`` (:mod:`ds_tree.registries`)."""

    name: str = ""
    """The name it is registered under (set on each instance by :func:`ds_tree.turn_formats.get_format`)."""
    stop_tokens: tuple[str, ...] = ()
    """Special tokens that end an assistant turn besides EOS (those the tokenizer has are used)."""
    reasoning: tuple[str, str] | None = None
    """Open and close markup of a reasoning block at the start of a turn (None: the family has none)."""
    markers: tuple[str, ...] = ()
    """Strings a chat template of this family contains (all of them): how ``auto`` recognises it."""
    arguments_as_object: bool = False
    """The template renders a call's arguments as an object (else as the JSON string OpenAI messages carry)."""
    history_stop_differs: bool = False
    """The template ends a finished turn in history with another token than the sampled stop token
    (harmony: ``<|return|>`` becomes ``<|end|>``): such a turn cannot be bridged."""

    def parse(self, text: str, call_prefix: str = "call") -> ParsedTurn:
        """The decoded turn (stop token left out) as reasoning, text and tool calls."""
        reasoning, rest, error = self.split_reasoning(text)
        parsed = self.parse_calls(rest, call_prefix)
        parsed.turn.raw = text
        if reasoning:
            parsed.turn.reasoning = reasoning
        if error is not None:
            parsed.turn.tool_calls = []
            parsed.error = "; ".join(filter(None, [error, parsed.error]))
        return parsed

    def split_reasoning(self, text: str) -> tuple[str, str, str | None]:
        """(reasoning, the rest, an error). A turn may open with the reasoning block, or start inside
        it when the generation prompt opened it (only the close markup is sampled)."""
        if self.reasoning is None:
            return "", text, None
        open_, close = self.reasoning
        stripped = text.lstrip()
        if stripped.startswith(open_):
            stripped = stripped[len(open_) :]
        elif close not in text:
            return "", text, None  # no reasoning in this turn
        if close not in stripped:
            return stripped.strip(), "", f"the reasoning block is not closed with {close}"
        reasoning, rest = stripped.split(close, 1)
        if open_ in rest or close in rest:
            return reasoning.strip(), rest, f"more than one {open_} ... {close} block"
        return reasoning.strip("\n"), rest.lstrip("\n"), None

    def parse_calls(self, text: str, call_prefix: str) -> ParsedTurn:
        raise NotImplementedError

    def message(self, turn: Turn) -> dict:
        """The parsed turn as the assistant message the chat template renders in history."""
        message = turn.message()
        if self.arguments_as_object:
            for call, parsed in zip(message.get("tool_calls", []), turn.tool_calls, strict=True):
                call["function"] = {**call["function"], "arguments": parsed.arguments}
        return message

    def probe(self) -> list[dict]:
        """A conversation whose rendering ends an assistant turn with a stop token (what the renderer
        reads the template's text after a turn from)."""
        return [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
