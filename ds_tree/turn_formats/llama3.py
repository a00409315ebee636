"""Llama 3.1 / 3.2 JSON tool calls: the whole turn is ``{"name": ..., "parameters": {...}}`` (several
separated by ``;``), optionally after ``<|python_tag|>``; a turn that is not a call is text. The turn
ends with ``<|eot_id|>`` (``<|eom_id|>`` after a built-in tool call)."""

from __future__ import annotations

import json

from ds_tree.turn_formats.base import ParsedTurn, Turn, TurnFormat, call_from_object, load_json

PYTHON_TAG = "<|python_tag|>"


def json_objects(where: str, text: str) -> tuple[list[object], str | None]:
    """The JSON values of ``text``, one after another, separated by ``;`` (an error if anything else)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position] in " \n\t;":
            position += 1
        if position >= len(text):
            return values, None
        start = position
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            return values, f"{where}: not JSON ({error.msg} at character {error.pos}): {text[start:][:80]!r}"
        except (RecursionError, ValueError) as error:
            return values, f"{where}: not usable JSON ({type(error).__name__}): {text[start:][:80]!r}"
        _, error = load_json(where, text[start:position])  # the depth limit
        if error is not None:
            return values, error
        values.append(value)


class Llama3JsonFormat(TurnFormat):
    stop_tokens = ("<|eot_id|>", "<|eom_id|>")
    markers = ("<|start_header_id|>", "<|eot_id|>")

    def parse_calls(self, text: str, call_prefix: str) -> ParsedTurn:
        body = text.strip()
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG) :].strip()
        elif not body.startswith("{"):
            error = f"{PYTHON_TAG} inside the turn's text" if PYTHON_TAG in body else None
            return ParsedTurn(Turn(text=body, raw=text), error)
        values, error = json_objects("tool call", body)
        calls, errors = [], [error] if error else []
        for index, value in enumerate(values):
            call, problem = call_from_object(f"tool call {index + 1}", value, "parameters", f"{call_prefix}_{index}")
            if problem is None:
                calls.append(call)
            else:
                errors.append(problem)
        if not values and not errors:
            errors.append(f"{PYTHON_TAG} with no call after it")
        return ParsedTurn(Turn(text="", tool_calls=calls, raw=text), "; ".join(errors) or None)
