"""Qwen3-Coder tool calls: XML-style, one parameter a block, values as text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value that reads as JSON (a number, ``true``, an object) is taken as JSON, any other as a string: a
string argument that looks like a number comes back a number (the template writes both alike; the
tool's schema, which the parser does not see, would tell them apart).
"""

from __future__ import annotations

import json
import re

from ds_tree.turn_formats.base import MAX_CALL_DEPTH, ParsedTurn, ToolCall, TurnFormat, json_depth
from ds_tree.turn_formats.hermes import CALL_OPEN, parse_tagged_calls

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def parameter_value(text: str) -> object:
    """A parameter's value: its text without the newline after the open tag and before the close tag,
    as JSON where it reads as JSON, else as the string."""
    text = text.removeprefix("\n").removesuffix("\n")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def xml_call(where: str, body: str, call_id: str):
    match = _FUNCTION.fullmatch(body)
    if match is None or not match.group(1).strip():
        return None, f"{where}: needs <function=NAME>...</function>, got {body[:80]!r}"
    arguments: dict[str, object] = {}
    inside = match.group(2)
    for parameter in _PARAMETER.finditer(inside):
        key = parameter.group(1).strip()
        if not key or key in arguments:
            return None, f"{where}: parameter name {key!r} empty or repeated"
        arguments[key] = parameter_value(parameter.group(2))
    if _PARAMETER.sub("", inside).strip():
        return None, f"{where}: text outside <parameter=...>...</parameter> blocks: {inside[:80]!r}"
    if json_depth(arguments) > MAX_CALL_DEPTH:
        return None, f"{where}: nested deeper than {MAX_CALL_DEPTH} levels"
    return ToolCall(match.group(1).strip(), arguments, call_id), None


class Qwen3CoderFormat(TurnFormat):
    stop_tokens = ("<|im_end|>",)
    markers = ("<|im_start|>", CALL_OPEN, "<function=")
    arguments_as_object = True

    def parse_calls(self, text: str, call_prefix: str) -> ParsedTurn:
        return parse_tagged_calls(text, call_prefix, xml_call)
