"""gpt-oss's harmony format. A sampled turn (after the generation prompt ``<|start|>assistant``) is
one or more messages, each ``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY``,
separated by ``<|end|><|start|>assistant``: ``analysis`` is reasoning, ``final`` the answer,
``commentary`` a preamble, or with ``to=functions.NAME`` a tool call whose body is the JSON
arguments. The turn ends with ``<|call|>`` (a call) or ``<|return|>`` (a final answer); in history
the template ends a final answer with ``<|end|>`` instead, and drops its analysis.

Parsed here from the decoded text with this project's tokenizer. The ``openai-harmony`` package
renders and parses the same format, but in the o200k token ids of gpt-oss's own tokenizer, and it
loads that vocabulary from the network on first use (offline: ``HarmonyError: error downloading or
loading vocab file``), so it can serve neither the tests nor another tokenizer.
"""

from __future__ import annotations

import re

from ds_tree.turn_formats.base import ParsedTurn, Turn, TurnFormat, call_from_object, load_json

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


class HarmonyFormat(TurnFormat):
    stop_tokens = ("<|call|>", "<|return|>")
    markers = (START, CHANNEL, MESSAGE)
    history_stop_differs = True

    def probe(self) -> list[dict]:
        call = {"id": "probe", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        return [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}]

    def split_reasoning(self, text: str) -> tuple[str, str, str | None]:
        return "", text, None  # the analysis channel is a message of its own: parse_calls reads it

    def parse_calls(self, text: str, call_prefix: str) -> ParsedTurn:
        turn = Turn(text="", raw=text)
        reasoning, answer, errors = [], [], []
        segments = text.split(START)
        for index, segment in enumerate(segments):
            where = f"message {index + 1}"
            if index:
                if not segment.startswith("assistant"):
                    errors.append(f"{where}: a turn may only continue with {START}assistant")
                    continue
                segment = segment[len("assistant") :]
            if index < len(segments) - 1:
                if not segment.endswith(END):
                    errors.append(f"{where}: not ended with {END} before the next {START}")
                    continue
                segment = segment[: -len(END)]
            elif segment.endswith(END):
                segment = segment[: -len(END)]
            if MESSAGE not in segment:
                errors.append(f"{where}: no {MESSAGE} after the header {segment[:80]!r}")
                continue
            header, body = segment.split(MESSAGE, 1)
            channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
            if channel is None:
                errors.append(f"{where}: no {CHANNEL} in the header {header[:80]!r}")
            elif recipient is not None:
                name = recipient.group(1)
                if not name.startswith("functions.") or len(name) == len("functions."):
                    errors.append(f"{where}: recipient {name!r} is not functions.NAME")
                    continue
                value, error = load_json(f"{where} (call to {name})", body.strip())
                call = None
                if error is None:
                    wrapped = {"name": name[len("functions.") :], "arguments": value}
                    call, error = call_from_object(where, wrapped, "arguments", f"{call_prefix}_{len(turn.tool_calls)}")
                if error is not None:
                    errors.append(error)
                else:
                    turn.tool_calls.append(call)
            elif channel.group(1) == "analysis":
                reasoning.append(body.strip())
            elif channel.group(1) in ("final", "commentary"):
                answer.append(body.strip())
            else:
                errors.append(f"{where}: unknown channel {channel.group(1)!r} (analysis, commentary, final)")
        turn.text, turn.reasoning = "\n".join(filter(None, answer)), "\n".join(filter(None, reasoning))
        return ParsedTurn(turn, "; ".join(errors) or None)
