"""The registry of turn formats: a model family's tool-call and reasoning dialect, by name.

``rollout.env.format`` names one (docs/ENVIRONMENTS.md, *Chat formats*); ``auto`` recognises it from
the tokenizer's chat template (:func:`detect_format`). Built-in formats are a lazy table (module,
class) loaded on first use; a project's own format registers with :func:`register_format`::

    @register_format("my_family")
    class MyFormat(TurnFormat):
        stop_tokens = ("<|end_of_turn|>",)
        markers = ("<|end_of_turn|>", "<call>")
        def parse_calls(self, text, call_prefix): ...

A name registered twice is refused unless ``force=True``; a failed lookup lists the valid names.
"""

from __future__ import annotations

import importlib

from ds_tree.rollout.formats.base import TurnFormat

BUILTIN: dict[str, tuple[str, str]] = {
    "hermes": ("ds_tree.rollout.formats.hermes", "HermesFormat"),
    "qwen3": ("ds_tree.rollout.formats.hermes", "Qwen3Format"),
    "qwen3_coder": ("ds_tree.rollout.formats.qwen3_coder", "Qwen3CoderFormat"),
    "llama3_json": ("ds_tree.rollout.formats.llama3", "Llama3JsonFormat"),
    "mistral": ("ds_tree.rollout.formats.mistral", "MistralFormat"),
    "harmony": ("ds_tree.rollout.formats.harmony", "HarmonyFormat"),
}
"""Name -> (module, class) of the formats that ship with ds_tree."""

_REGISTERED: dict[str, type[TurnFormat]] = {}


def register_format(name: str, force: bool = False):
    """Class decorator: register a :class:`TurnFormat` subclass under ``name``."""

    def register(cls: type[TurnFormat]) -> type[TurnFormat]:
        if not (isinstance(cls, type) and issubclass(cls, TurnFormat)):
            raise TypeError(f"format {name!r}: {cls!r} is not a TurnFormat subclass")
        if not force and (name in _REGISTERED or name in BUILTIN) and _REGISTERED.get(name) is not cls:
            raise ValueError(f"format {name!r} is already registered (pass force=True to replace it)")
        cls.name = name
        _REGISTERED[name] = cls
        return cls

    return register


def list_registered() -> list[str]:
    return sorted(set(BUILTIN) | set(_REGISTERED))


def get_format(name: str) -> TurnFormat:
    """A new instance of the format registered as ``name`` (ValueError listing the names if none)."""
    if name not in _REGISTERED and name in BUILTIN:
        module, attribute = BUILTIN[name]
        cls = getattr(importlib.import_module(module), attribute)
        cls.name = name
        _REGISTERED[name] = cls
    if name not in _REGISTERED:
        raise ValueError(f"unknown chat format {name!r}; registered: {', '.join(list_registered())}")
    return _REGISTERED[name]()


def detect_format(chat_template: str | None) -> str:
    """The registered format whose ``markers`` a chat template contains: of those that match, the most
    specific (one whose markers include every other match's). ValueError when none or several do."""
    if not chat_template:
        raise ValueError("the tokenizer has no chat template")
    formats = {name: get_format(name) for name in list_registered()}
    matches = {
        name: set(found.markers)
        for name, found in formats.items()
        if found.markers and all(marker in chat_template for marker in found.markers)
    }
    best = [name for name, markers in matches.items() if all(other <= markers for other in matches.values())]
    if len(best) == 1:
        return best[0]
    what = f"several match ({', '.join(sorted(matches))})" if matches else "none matches"
    raise ValueError(
        f"cannot tell the chat format from the tokenizer's chat template: {what}; "
        f"name one of {', '.join(list_registered())}"
    )


def resolve_format(name: str, tokenizer) -> TurnFormat:
    """``rollout.env.format``: a registered name, or ``auto`` (:func:`detect_format` on the tokenizer's
    chat template). ValueError saying why."""
    return get_format(detect_format(getattr(tokenizer, "chat_template", None)) if name == "auto" else name)


def turn_stop_tokens(turn_format: TurnFormat, tokenizer) -> list[str]:
    """The format's turn-ending tokens that the tokenizer has (as special tokens)."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    found = []
    for token in turn_format.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id != unknown:
            found.append(token)
    return found
