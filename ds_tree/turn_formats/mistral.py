"""Mistral tool calls (v3 tokenizer): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` after
the turn's text, ending with ``</s>``; results come back as ``[TOOL_RESULTS] ... [/TOOL_RESULTS]``."""

from __future__ import annotations

from ds_tree.turn_formats.base import ParsedTurn, Turn, TurnFormat, call_from_object, load_json

TOOL_CALLS = "[TOOL_CALLS]"


class MistralFormat(TurnFormat):
    stop_tokens = ("</s>",)
    markers = ("[INST]", TOOL_CALLS)

    def parse_calls(self, text: str, call_prefix: str) -> ParsedTurn:
        if TOOL_CALLS not in text:
            return ParsedTurn(Turn(text=text.strip(), raw=text))
        before, body = text.split(TOOL_CALLS, 1)
        turn = Turn(text=before.strip(), raw=text)
        if TOOL_CALLS in body:
            return ParsedTurn(turn, f"more than one {TOOL_CALLS}")
        value, error = load_json("tool calls", body.strip())
        if error is not None:
            return ParsedTurn(turn, error)
        if not isinstance(value, list) or not value:
            return ParsedTurn(turn, f"{TOOL_CALLS} needs a non-empty JSON list of calls, got {body.strip()[:80]!r}")
        errors = []
        for index, item in enumerate(value):
            call, error = call_from_object(f"tool call {index + 1}", item, "arguments", f"{call_prefix}_{index}")
            if error is None:
                turn.tool_calls.append(call)
            else:
                errors.append(error)
        return ParsedTurn(turn, "; ".join(errors) or None)
