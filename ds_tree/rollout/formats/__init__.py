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


def check_template_fits(turn_format: TurnFormat, chat_template: str | None) -> None:
    """A ValueError when ``chat_template`` lacks one of ``turn_format``'s markers: the template then renders
    another family's turns (harmony or mistral named for a ChatML template), the policy learns that family's
    calls, and every tool call of every episode would be a parse error. A format without markers is not
    checked. The error says what ``auto`` would pick."""
    missing = [marker for marker in turn_format.markers if marker not in (chat_template or "")]
    if not missing:
        return
    try:
        fix = f"set rollout.env.format: auto (it finds {detect_format(chat_template)} in this template)"
    except ValueError:
        fix = "set rollout.env.format to the template's family"
    raise ValueError(
        f"the tokenizer's chat template does not write the {turn_format.name} format (it has no "
        f"{', '.join(missing)}), so every tool call would be a parse error; {fix}, or use a tokenizer whose "
        f"template is {turn_format.name}'s (ds-tree make-tokenizer --chat-format NAME writes each family's)"
    )


def resolve_format(name: str, tokenizer) -> TurnFormat:
    """``rollout.env.format``: a registered name whose markers the tokenizer's chat template has
    (:func:`check_template_fits`), or ``auto`` (:func:`detect_format` on that template). ValueError saying why."""
    template = getattr(tokenizer, "chat_template", None)
    if name == "auto":
        return get_format(detect_format(template))
    turn_format = get_format(name)
    if template is None or isinstance(template, str):  # several named templates (a dict): not told apart here
        check_template_fits(turn_format, template)
    return turn_format


def turn_stop_tokens(turn_format: TurnFormat, tokenizer) -> list[str]:
    """The format's turn-ending tokens that the tokenizer has (as special tokens)."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    found = []
    for token in turn_format.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is not None and token_id != unknown:
            found.append(token)
    return found
