"""Image observations: what an environment may put in a message, and how it becomes model input.

An environment of a vision-language policy (docs/ENVIRONMENTS.md, "Image observations") returns
messages whose ``content`` is a list of parts, as chat records hold them (``ds_tree.data.chat_images``)::

    {"type": "text", "text": "..."}
    {"type": "image", "image": <PIL.Image.Image | numpy uint8 array [H, W, 3] | path>}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}

A screenshot-returning tool returns such a list (or one image) and :func:`tool_content` turns it into
the tool message's content. Arrays become PIL images when the messages are checked
(:func:`normalize_parts`), so messages compare by value (``fork: replay``, ``reset`` checks). Each image
is processed by the policy's image processor into a :class:`~ds_tree.trees.images.TrajectoryImage`
**once per content** (:class:`ObservationImages`: a screenshot the environment returns again, or
that every sibling of a fork sees, is decoded and processed once); the rendering's one
``<|image_pad|>`` per image is expanded to the image's merged patches, and the trie merges images
by identity (their pixels), never by the placeholder ids.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ds_tree.data.chat_images import (
    CONVERTIBLE_MODES,
    IMAGE_TYPES,
    MAX_IMAGE_PIXELS,
    ImageReader,
    check_image_size,
    expand_image_pads,
    image_parts,
    is_image_part,
)
from ds_tree.errors import RecordError
from ds_tree.trees.images import TrajectoryImage

SETTING = "rollout.env.max_image_pixels"
"""The largest observation image (width x height), refused before decoding or processing above it."""


class ImageFailure(ValueError):
    """An image part an environment returned cannot be read (the environment's error)."""


def has_images(messages: list[dict]) -> bool:
    return bool(image_parts(messages))


def normalize_parts(where: str, content: list) -> list:
    """``content`` (a list of parts) checked, numpy arrays turned into PIL images; an
    :class:`ImageFailure` naming the part otherwise."""
    from PIL import Image

    out = []
    for j, part in enumerate(content):
        at = f"{where}: content part {j}"
        if not isinstance(part, dict) or part.get("type") not in ("text", *IMAGE_TYPES):
            raise ImageFailure(f"{at}: a part is an object of type text, image or image_url")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise ImageFailure(f"{at}: a text part needs a string 'text'")
        elif part["type"] == "image_url":
            url = part.get("image_url")
            if not isinstance(url, dict) or not isinstance(url.get("url"), str):
                raise ImageFailure(f"{at}: an image_url part needs 'image_url': {{'url': ...}}")
        else:
            image = part.get("image")
            if isinstance(image, np.ndarray):
                if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] not in (3, 4):
                    raise ImageFailure(
                        f"{at}: an image array must be uint8 [height, width, 3 or 4], got {image.dtype} {image.shape}"
                    )
                part = {**part, "image": Image.fromarray(image)}
            elif isinstance(image, Path):
                part = {**part, "image": str(image)}
            elif not isinstance(image, (str, Image.Image)):
                raise ImageFailure(
                    f"{at}: 'image' must be a PIL image, a uint8 array or a file path, got {type(image).__name__}"
                )
        out.append(part)
    return out


def with_pil_images(where: str, messages: list[dict]) -> list[dict]:
    """``messages`` with every list content's parts checked and image arrays made PIL images (a chat
    record's other checks are the caller's)."""
    return [
        {**message, "content": normalize_parts(f"{where}: message {index}", message["content"])}
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        else message
        for index, message in enumerate(messages)
    ]


def tool_content(value) -> list | None:
    """A tool's return value as message content parts when it holds images (a PIL image, a uint8
    array, or a list of those and strings), else None (the value is text)."""
    from PIL import Image

    def part(item):
        if isinstance(item, Image.Image | np.ndarray):
            return {"type": "image", "image": item}
        if isinstance(item, dict) and item.get("type") in ("text", *IMAGE_TYPES):
            return item
        return {"type": "text", "text": str(item)}

    items = value if isinstance(value, list) else [value]
    if not any(isinstance(item, Image.Image | np.ndarray) or is_image_part(item) for item in items):
        return None
    return [part(item) for item in items]


class ObservationImages:
    """Image parts of messages processed into trajectory images with the policy's image processor,
    once per content (module docstring)."""

    def __init__(self, vision, max_pixels: int = MAX_IMAGE_PIXELS) -> None:
        """``vision``: the policy's processor folder (:class:`~ds_tree.vocab.vision_processor.VisionProcessor`);
        ``max_pixels``: ``rollout.env.max_image_pixels``."""
        self.image_token_id = vision.image_token_id
        self.reader = ImageReader(vision.image_processor, vision.family.merge_size, max_pixels, SETTING)
        self.cache: dict[str, TrajectoryImage] = {}

    def of(self, messages: list[dict], where: str = "observation") -> list[TrajectoryImage]:
        """The images of ``messages``' image parts, in rendering order."""
        parts = image_parts(messages)
        return [self.read(part, f"{where}: message {index}: content part {j}") for index, j, part in parts]

    def read(self, part: dict, where: str) -> TrajectoryImage:
        from PIL import Image

        image = part.get("image")
        if isinstance(image, Image.Image):
            try:  # before hashing or processing its pixels
                check_image_size(where, image.size, self.reader.max_pixels, SETTING)
            except RecordError as error:
                raise ImageFailure(str(error)) from None
            key = hashlib.sha256(repr((image.mode, image.size)).encode() + image.tobytes()).hexdigest()
            if key not in self.cache:
                if image.mode not in CONVERTIBLE_MODES:
                    modes = ", ".join(CONVERTIBLE_MODES)
                    raise ImageFailure(f"{where}: image mode {image.mode!r} is not one of {modes}")
                self.cache[key] = self._process(where, image.convert("RGB"))
            return self.cache[key]
        try:  # a path (relative to the working directory) or a data URL: the record reader's rules
            return self.reader.read(str(Path.cwd() / "observation"), where, part)
        except Exception as error:  # RecordError: the environment's failure here, not a data file's
            raise ImageFailure(str(error)) from None

    def _process(self, where: str, image) -> TrajectoryImage:
        try:
            return self.reader._process(where, image)
        except Exception as error:
            raise ImageFailure(str(error)) from None

    def expand(self, ids: list[int], images: list[TrajectoryImage], where: str = "observation") -> list[int]:
        """``ids`` with each image's one ``<|image_pad|>`` repeated to its merged patch count."""
        try:
            return expand_image_pads(ids, self.image_token_id, [image.tokens for image in images], where)
        except ValueError as error:
            raise ImageFailure(str(error)) from None


def rendering_stand_ins(messages: list[dict]) -> list[dict]:
    """``messages`` with each image part's image replaced by a name (the chat template renders an image
    part by its type alone), so they pass the chat-record checks of ``render_chat``."""

    def stand_in(part):
        return {"type": "image", "image": "observation-image"} if is_image_part(part) else part

    return [
        {**message, "content": [stand_in(part) for part in message["content"]]}
        if isinstance(message.get("content"), list)
        else message
        for message in messages
    ]


def observation_images(tokenizer_dir, model_config, max_pixels: int = MAX_IMAGE_PIXELS) -> ObservationImages | None:
    """The image reader of a vision-language policy whose ``model.tokenizer`` is a processor folder
    (``ds-tree make-tokenizer --vision``); None for a text-only policy (an image observation is then an
    environment error naming the reason); a ValueError for a vision-language model without one."""
    from ds_tree.models.vision import check_image_inputs, is_vision_language
    from ds_tree.vocab.vision_processor import load_vision_processor

    if not is_vision_language(model_config):
        return None
    vision = load_vision_processor(tokenizer_dir)
    if vision is None:
        raise ValueError(
            f"{tokenizer_dir} is not a processor folder; a vision-language policy needs one for image observations "
            f"(ds-tree make-tokenizer --output DIR --vision {model_config.model_type})"
        )
    if vision.image_token_id != model_config.image_token_id:
        raise ValueError(
            f"the processor folder's <|image_pad|> is id {vision.image_token_id}, the model's image_token_id is "
            f"{model_config.image_token_id}"
        )
    family = vision.family
    check_image_inputs(model_config, family.patch_values, family.merge_size, f"the processor folder ({family.name})")
    return ObservationImages(vision, max_pixels)
