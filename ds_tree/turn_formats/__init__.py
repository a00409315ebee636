"""Turn formats: a model family's tool-call and reasoning dialect, registered by name in
:data:`ds_tree.registries.TURN_FORMATS` (``base``: what a turn and a format are; one module per family).

``rollout.env.format`` names one (docs/ENVIRONMENTS.md, *Chat formats*); ``auto`` recognises it from
the tokenizer's chat template (:func:`detect_format`). The built-in formats are lazy registry entries,
loaded on first use; a project's own format registers on the registry::

    @TURN_FORMATS.register("my_family")
    class MyFormat(TurnFormat):
        stop_tokens = ("<|end_of_turn|>",)
        markers = ("<|end_of_turn|>", "<call>")
        def parse_calls(self, text, call_prefix): ...

A name registered twice is refused unless ``force=True``; a failed lookup lists the valid names.
"""

from __future__ import annotations

from ds_tree.registries import TURN_FORMATS
from ds_tree.turn_formats.base import TurnFormat


def get_format(name: str) -> TurnFormat:
    """A new instance of the format registered as ``name`` (a ValueError listing the names if none; a
    TypeError for a registration that is not a :class:`TurnFormat` subclass)."""
    found = TURN_FORMATS.get(name)
    if not (isinstance(found, type) and issubclass(found, TurnFormat)):
        raise TypeError(f"chat format {name!r}: {found!r} is not a TurnFormat subclass")
    instance = found()
    instance.name = name
    return instance


def detect_format(chat_template: str | None) -> str:
    """The registered format whose ``markers`` a chat template contains: of those that match, the most
    specific (one whose markers include every other match's). ValueError when none or several do."""
    if not chat_template:
        raise ValueError("the tokenizer has no chat template")
    names = sorted(TURN_FORMATS.names())
    formats = {name: get_format(name) for name in names}
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
        f"cannot tell the chat format from the tokenizer's chat template: {what}; name one of {', '.join(names)}"
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
