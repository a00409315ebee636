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

Tool calls and reasoning are parsed by the chat format (``rollout.env.format``,
:mod:`ds_tree.turn_formats`: Hermes ``<tool_call>`` JSON by default, Qwen3, Qwen3-Coder, Llama 3
JSON, Mistral, harmony). A malformed call is not an exception: :meth:`Renderer.parse` returns it as
a parse error, which the rollout shows the policy as a tool message (``parse_error_message``).

A turn whose reasoning the template does not show once it is history (QwQ, DeepSeek-R1, Qwen3 after
a new user message), or whose stop token the template writes differently in history (harmony's
``<|return|>``), is not append-only either: the rollout continues it in a new branch whose root is
the template's rendering, so every turn is sampled and trained in its exact context.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ds_tree.data.chat import ChatText, UnsafeText, encode_rendered, special_token_strings
from ds_tree.rollout.env import EnvFailure
from ds_tree.rollout.images import ImageFailure, ObservationImages, has_images
from ds_tree.turn_formats import get_format
from ds_tree.turn_formats.base import ParsedTurn, Turn, TurnFormat


class NotAppendOnly(Exception):
    """The conversation's new rendering does not extend the old one (bridging would realign tokens)."""


def parse_tool_calls(text: str, call_prefix: str = "call") -> ParsedTurn:
    """Text and tool calls of a decoded assistant turn in the Hermes format (the project's template)."""
    return get_format("hermes").parse(text, call_prefix)


def without_special_strings(text: str, specials: Sequence[str]) -> str:
    """``text`` (a parse error the policy is shown) with each special token's string (``specials``, longest
    first) written as its bare name (``[TOOL_CALLS]`` as ``TOOL_CALLS``): the error quotes the sampled turn and
    the format's markers, and a template that transforms tool content (Mistral's ``tojson``) cannot keep a
    special token's string as text, so rendering the error would fail and end the leaf instead of answering."""
    for special in specials:
        if special in text:
            text = text.replace(special, special.strip("<>[]|/") or "special token")
    return text


def parse_error_message(error: str) -> dict:
    """The observation the policy gets for a malformed tool call (the environment is not stepped)."""
    return {"role": "tool", "tool_call_id": "parse_error", "content": f"error: could not parse your tool call: {error}"}


class Renderer:
    """Chat template and tokenizer of the policy (module docstring)."""

    def __init__(
        self,
        tokenizer,
        stop_ids: Sequence[int],
        max_observation_tokens: int = 0,
        turn_format: TurnFormat | None = None,
        images: ObservationImages | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.images = images
        """A vision-language policy's image reader: image parts become their merged patches' placeholders."""
        self.stop_ids = {int(token) for token in stop_ids}
        self.max_observation_tokens = max_observation_tokens
        self.format = turn_format or get_format("hermes")
        text = self.render(self.format.probe(), None, generation_prompt=False)
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
        spells a special token is encoded as text (only the template's structure gives special ids).
        Each image part's placeholder is expanded to the image's merged patches (:meth:`images_of`)."""
        return self.prompt_with_images(messages, tools)[0]

    def prompt_with_images(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list]:
        """:meth:`prompt`'s ids and the conversation's images (each read once)."""
        images = self.images_of(messages)
        return self.expand(self.encode(*self.render_spans(messages, tools, generation_prompt=True)), images), images

    def images_of(self, messages: list[dict]) -> list:
        """The :class:`~ds_tree.trees.images.TrajectoryImage` of every image part of ``messages``, in order;
        :class:`EnvFailure` for one that cannot be read, or for images without a vision-language policy."""
        if not has_images(messages):
            return []
        if self.images is None:
            raise EnvFailure(
                "an observation holds an image but the policy has no vision tower (model.tokenizer is not a processor "
                "folder of a vision-language model: ds-tree make-tokenizer --vision FAMILY)"
            )
        try:
            return self.images.of(messages)
        except ImageFailure as error:
            raise EnvFailure(str(error)) from None

    def expand(self, ids: list[int], images: list) -> list[int]:
        """``ids`` with each of ``images``' one placeholder expanded to its merged patches."""
        if not images:
            return ids
        try:
            return self.images.expand(ids, images)
        except ImageFailure as error:
            raise EnvFailure(str(error)) from None

    def parse(self, sampled_ids: Sequence[int], call_prefix: str = "call") -> ParsedTurn:
        """The sampled assistant turn (its final stop token left out) as text and tool calls."""
        ids = list(sampled_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        parsed = self.format.parse(self.tokenizer.decode(ids, skip_special_tokens=False), call_prefix)
        specials = special_token_strings(self.tokenizer)
        if parsed.error:
            parsed.error = without_special_strings(parsed.error, specials)
        for index, call in enumerate(parsed.turn.tool_calls):  # rendered as markup by some templates
            spelled = json.dumps([call.name, call.arguments], ensure_ascii=False)
            if any(special in spelled for special in specials):
                error = f"tool call {index + 1}: its name or arguments contain a special token"
                parsed.turn.tool_calls = []
                return ParsedTurn(parsed.turn, "; ".join(filter(None, [parsed.error, error])))
        return parsed

    def message(self, turn: Turn) -> dict:
        """The parsed turn as the assistant message the chat template renders in history."""
        return self.format.message(turn)

    def cut(self, message: dict) -> dict:
        """``message`` with its content cut to ``max_observation_tokens`` tokens and a visible marker. Content
        parts count in order, an image its placeholder tokens (:meth:`image_tokens`): text is cut at the
        limit, an image that does not fit whole is left out, and so is every part after the cut."""
        limit = self.max_observation_tokens
        if not limit:
            return message
        if isinstance(message["content"], list):
            return self.cut_parts(message, limit)
        ids = self.encode_content(message["content"])
        if len(ids) <= limit:
            return message
        kept = self.tokenizer.decode(ids[:limit])
        return {**message, "content": f"{kept}\n[observation cut: {len(ids) - limit} more tokens]"}

    def cut_parts(self, message: dict, limit: int) -> dict:
        """:meth:`cut` for content parts: the marker is a text part after the kept ones."""
        kept, used, more = [], 0, 0
        for part in message["content"]:
            if part.get("type") == "text":
                ids = self.encode_content(part["text"])
                room = 0 if more else max(limit - used, 0)
                if ids[:room]:
                    kept.append(part if len(ids) <= room else {**part, "text": self.tokenizer.decode(ids[:room])})
                used += min(len(ids), room)
                more += len(ids) - min(len(ids), room)
                continue
            size = self.image_tokens(part)
            if not more and used + size <= limit:
                kept.append(part)
                used += size
            else:
                more += size
        if not more:
            return message
        return {**message, "content": [*kept, {"type": "text", "text": f"\n[observation cut: {more} more tokens]"}]}

    def image_tokens(self, part: dict) -> int:
        """Tokens an image part renders to: its merged patches and the ``<|vision_start|>``, ``<|vision_end|>``
        around them (0 for a text-only policy, whose renderer refuses the image when it renders it)."""
        if self.images is None:
            return 0
        try:
            return self.images.read(part, "observation").tokens + 2
        except ImageFailure as error:
            raise EnvFailure(str(error)) from None

    def check_turn_kept(self, stop_id: int, messages: list[dict], before: str, tools) -> None:
        """:class:`NotAppendOnly` where the history the template renders is not what was sampled:
        the last turn's reasoning is not shown, or its stop token is written as another."""
        reasoning = messages[-1].get("reasoning_content") if messages else None
        if reasoning:
            earlier = self.render(messages[:-1], tools, generation_prompt=False)
            if not before.startswith(earlier) or reasoning not in before[len(earlier) :]:
                raise NotAppendOnly("the chat template does not show the turn's reasoning in history")
        if self.format.history_stop_differs:
            stop = self.tokenizer.convert_ids_to_tokens(int(stop_id))
            if not before[: len(before) - len(self.after_stop)].endswith(stop):
                raise NotAppendOnly(f"the chat template ends the turn with another token than {stop}")

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
        return self.bridge_with_images(previous_ids, messages, new_messages, tools)[0]

    def bridge_with_images(
        self,
        previous_ids: Sequence[int],
        messages: list[dict],
        new_messages: list[dict],
        tools: list[dict] | None,
    ) -> tuple[list[int], list]:
        """:meth:`bridge`'s ids and the images of ``new_messages`` (each read once)."""
        if not previous_ids or previous_ids[-1] not in self.stop_ids:
            raise ValueError("bridge needs ids that end with a stop token (a finished assistant turn)")
        before = self.render(messages, tools, generation_prompt=False)
        after, spans = self.render_spans(messages + new_messages, tools, generation_prompt=True)
        if not after.startswith(before) or not before.endswith(self.after_stop):
            raise NotAppendOnly("the rendering of the new conversation does not extend the sampled one")
        self.check_turn_kept(previous_ids[-1], messages, before, tools)
        shift = len(before) - len(self.after_stop)  # new messages' content spans, in the appended text
        appended = [(start - shift, end - shift) for start, end in spans if start >= len(before)]
        images = self.images_of(new_messages)
        return self.expand(self.encode(self.after_stop + after[len(before) :], appended), images), images
