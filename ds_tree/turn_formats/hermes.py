"""Hermes / Qwen2.5 tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the
project's own template) and Qwen3 (the same calls after a ``<think>`` reasoning block)."""

from __future__ import annotations

import re

from ds_tree.turn_formats.base import ParsedTurn, Turn, TurnFormat, call_from_object, load_json

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def parse_tagged_calls(text: str, call_prefix: str, parse_body) -> ParsedTurn:
    """Calls between ``<tool_call>`` tags, each body parsed by ``parse_body(where, body, call_id)``
    into ``(ToolCall | None, error | None)``; the text outside them is the turn's text."""
    calls, errors = [], []
    for index, match in enumerate(_CALL.finditer(text)):
        call, error = parse_body(f"tool call {index + 1}", match.group(1).strip(), f"{call_prefix}_{index}")
        if error is not None:
            errors.append(error)
        else:
            calls.append(call)
    outside = _CALL.sub("", text)
    if CALL_OPEN in outside or CALL_CLOSE in outside:
        errors.append(f"unbalanced {CALL_OPEN} / {CALL_CLOSE} markup")
    return ParsedTurn(Turn(text=outside.strip(), tool_calls=calls, raw=text), "; ".join(errors) or None)


def json_call(where: str, body: str, call_id: str):
    value, error = load_json(where, body)
    if error is not None:
        return None, error
    return call_from_object(where, value, "arguments", call_id)


class HermesFormat(TurnFormat):
    stop_tokens = ("<|im_end|>",)
    markers = ("<|im_start|>", CALL_OPEN)

    def parse_calls(self, text: str, call_prefix: str) -> ParsedTurn:
        return parse_tagged_calls(text, call_prefix, json_call)


class Qwen3Format(HermesFormat):
    """Hermes calls after an optional ``<think>`` block (Qwen3, QwQ)."""

    reasoning = ("<think>", "</think>")
    markers = ("<|im_start|>", CALL_OPEN, "<think>")
