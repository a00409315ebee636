"""The project's processor folders for vision-language families (``ds-tree make-tokenizer --vision``).

A processor folder is the project tokenizer (:mod:`ds_tree.vocab.tokenizer`) with the family's image
tokens added after its vocabulary, a chat template of the project's own that lays images out as the
family does, and the family's image processor config. Everything is built in code, offline.

Layout of an image inside a message (Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike)::

    <|vision_start|><|image_pad|><|vision_end|>

The template writes one ``<|image_pad|>``; rendering expands it to the image's merged patch count
``t * h * w / merge_size**2`` (:func:`ds_tree.data.chat_images.expand_image_pads`), as the family's
processor does. The template
stays prefix-stable (each message renders from itself alone), so the chat renderer's loss spans hold.

Image tokens take the ids right after the tokenizer's vocabulary, in :data:`VISION_TOKENS` order:
with the default 1024-token vocabulary ``<|vision_start|>`` is 1024, ``<|vision_end|>`` 1025,
``<|image_pad|>`` 1026 and ``<|video_pad|>`` 1027 (the tiny VL model configs use these ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ds_tree.registries import MODEL_FAMILIES
from ds_tree.vocab.chat_templates import CHAT_TEMPLATE
from ds_tree.vocab.tokenizer import DEFAULT_VOCAB_SIZE, build_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VISION_FILE = "ds_tree_vision.json"
"""What the folder records about its family (read back by :func:`load_vision_processor`)."""


@dataclass(frozen=True)
class VisionFamily:
    """A family's image processor settings (its published preprocessor configs, with small pixel limits): the
    ``vision`` of its model family spec (``ds_tree/models/families/qwen_vl.py``)."""

    name: str
    patch_size: int
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 28 * 28
    max_pixels: int = 64 * 28 * 28
    """Small limits, so test images stay small; real checkpoints ship their own processor."""

    @property
    def patch_values(self) -> int:
        """Values per patch in ``pixel_values``: 3 channels x temporal patch x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


# Message content is a string or a list of parts; an image part renders as the family's placeholder.
_CONTENT_MACRO = (
    "{% macro render_content(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type == 'image' or part.type == 'image_url' %}" + IMAGE_PLACEHOLDER + "{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
)
VISION_CHAT_TEMPLATE = _CONTENT_MACRO + CHAT_TEMPLATE.replace(
    "{{ message.content }}", "{{ render_content(message.content) }}"
).replace("{{ messages[0].content }}", "{{ render_content(messages[0].content) }}")


def family(name: str) -> VisionFamily:
    """The image processor settings of the vision-language family ``name``: its model family spec's ``vision``
    (``ds_tree.models.families``, looked up by name in :data:`~ds_tree.registries.MODEL_FAMILIES`)."""
    found = MODEL_FAMILIES.get(name).vision if name in MODEL_FAMILIES else None
    if found is None:
        known = [spec.model_type for _, spec in MODEL_FAMILIES.items() if spec.vision is not None]
        raise ValueError(f"unknown vision family {name!r}; choose one of {', '.join(known)}")
    return found


def build_vision_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The project tokenizer with :data:`VISION_TOKENS` as special tokens after its vocabulary."""
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    return tokenizer


def build_image_processor(settings: VisionFamily):
    """transformers' Qwen2-VL image processor (PIL backend: no torchvision) with the family's settings."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=settings.patch_size,
        merge_size=settings.merge_size,
        temporal_patch_size=settings.temporal_patch_size,
        min_pixels=settings.min_pixels,
        max_pixels=settings.max_pixels,
    )


def save_vision_processor(output_dir: str | Path, name: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Write the processor folder of family ``name`` (module docstring)."""
    settings = family(name)
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir}: exists and is not a directory")
    tokenizer = build_vision_tokenizer(vocab_size)
    tokenizer.save_pretrained(output_dir)
    build_image_processor(settings).save_pretrained(output_dir)
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True))
    (output_dir / VISION_FILE).write_text(json.dumps({"family": name, "token_ids": ids}, indent=2) + "\n")
    return output_dir


@dataclass
class VisionProcessor:
    """A processor folder loaded: the tokenizer, the image processor, the family and its token ids."""

    tokenizer: object
    image_processor: object
    family: VisionFamily
    token_ids: dict[str, int]

    @property
    def image_token_id(self) -> int:
        return self.token_ids["<|image_pad|>"]


def load_vision_processor(directory: str | Path) -> VisionProcessor | None:
    """The processor folder at ``directory``, or None when it is a text-only tokenizer folder."""
    directory = Path(directory)
    recorded = directory / VISION_FILE
    if not recorded.is_file():
        return None
    from transformers import AutoTokenizer

    fields = json.loads(recorded.read_text())
    settings = family(fields["family"])
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    # Built in code from the family's settings: the saved preprocessor_config.json is for other tools.
    return VisionProcessor(tokenizer, build_image_processor(settings), settings, fields["token_ids"])
