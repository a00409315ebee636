"""Images in chat records: content parts read, checked and processed into trajectory images.

A message's ``content`` may be a list of parts (OpenAI style)::

    {"type": "text", "text": "..."}
    {"type": "image", "image": "shots/step1.png"}                       # a path relative to the JSONL file
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}

The processor folder's chat template (``ds-tree make-tokenizer --vision``) renders each image part as
the family's placeholder; :func:`render_chat` (``ds_tree.data.chat``) then expands each image's
``<|image_pad|>`` to its merged patch count, so every rendering, and the loss spans computed from
them, hold the image tokens the model sees. Images are read with PIL and converted to RGB from the
modes that convert without loss of meaning (:data:`CONVERTIBLE_MODES`); anything else, an
unreadable file, a URL that is not a base64 data URL, a missing file is a :class:`RecordError`
naming the record's file:line, the message and the part. Each source is read and processed once per
converter (a screenshot shared by every trial is decoded once).

Sizes: an image whose header declares more than ``max_pixels`` pixels (width x height; default
:data:`MAX_IMAGE_PIXELS`, ``convert --max-image-pixels``, ``rollout.env.max_image_pixels``) is refused
before it is decoded (a 5 KB PNG may declare 100000 x 100000 pixels: 30 GB once decoded), and so is an
image without pixels (a width or height of 0). The image processor is told that the pixels are laid
out height x width x channels (``input_data_format``): left to guess, it takes an image 1 or 3 pixels
high for channels-first and garbles it.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from pathlib import Path

import numpy as np

from ds_tree.errors import RecordError
from ds_tree.trees.images import TrajectoryImage

IMAGE_TYPES = ("image", "image_url")
CONVERTIBLE_MODES = ("RGB", "RGBA", "L", "LA", "P")
"""PIL modes converted to RGB; others (16-bit, float, CMYK, ...) are refused as a wrong mode."""
DATA_URL = "data:image/"
MAX_IMAGE_PIXELS = 40_000_000
"""Default largest image (width x height) read: screenshots of an 8K screen (7680 x 4320 = 33 M) pass; what
the family's processor makes of an image is far smaller (its ``max_pixels``), decoding is what costs."""


def image_parts(messages: list[dict]) -> list[tuple[int, int, dict]]:
    """``(message index, part index, part)`` of every image part, in rendering order."""
    found = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            found.extend((index, j, part) for j, part in enumerate(content) if is_image_part(part))
    return found


def is_image_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_TYPES


def check_parts(where: str, content: list) -> None:
    """Raise a :class:`RecordError` for a malformed content part list."""
    for j, part in enumerate(content):
        at = f"{where}: content part {j}"
        if not isinstance(part, dict) or part.get("type") not in ("text", *IMAGE_TYPES):
            raise RecordError("malformed_message", f"{at}: a part is an object of type text, image or image_url")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise RecordError("malformed_message", f"{at}: a text part needs a string 'text'")
        if part["type"] == "image" and not isinstance(part.get("image"), str):
            raise RecordError("malformed_message", f"{at}: an image part needs 'image': a path (relative to the file)")
        if part["type"] == "image_url":
            url = part.get("image_url")
            if not isinstance(url, dict) or not isinstance(url.get("url"), str):
                raise RecordError("malformed_message", f"{at}: an image_url part needs 'image_url': {{'url': ...}}")


def check_image_size(where: str, size: tuple[int, int], max_pixels: int, setting: str) -> None:
    """A :class:`RecordError` for an image of ``size`` (width, height) without pixels or with more than
    ``max_pixels`` (``setting`` names where the limit is set)."""
    width, height = size
    if width < 1 or height < 1:
        raise RecordError("bad_image", f"{where}: the image has no pixels ({width} x {height})")
    if width * height > max_pixels:
        raise RecordError(
            "bad_image",
            f"{where}: the image is {width} x {height} = {width * height} pixels, more than {setting} "
            f"({max_pixels}); refused before decoding it (raise {setting} for larger images)",
        )


class ImageReader:
    """Reads image parts into :class:`TrajectoryImage` with a family's image processor, once per source."""

    def __init__(
        self,
        image_processor,
        merge_size: int,
        max_pixels: int = MAX_IMAGE_PIXELS,
        setting: str = "--max-image-pixels",
    ) -> None:
        from PIL import Image

        self.image_processor = image_processor
        self.merge_size = merge_size
        self.max_pixels = max_pixels
        """Images whose header declares more pixels are refused before decoding (:func:`check_image_size`)."""
        self.setting = setting
        """Where ``max_pixels`` is set, for the error message."""
        self.cache: dict[str, TrajectoryImage] = {}
        if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
            # PIL refuses (DecompressionBombError) above twice its own limit at open: never below ours
            Image.MAX_IMAGE_PIXELS = max_pixels

    def read(self, line: str, where: str, part: dict) -> TrajectoryImage:
        """``line``: the record's ``FILE:LINE`` (a relative path is relative to FILE); ``where``: the part."""
        if part["type"] == "image":
            base = Path(line.rsplit(":", 1)[0]).parent
            source = str((base / part["image"]).resolve())
        else:
            source = part["image_url"]["url"]
        if source not in self.cache:
            self.cache[source] = self._process(where, self._open(where, part, source))
        return self.cache[source]

    def _open(self, where: str, part: dict, source: str):
        from PIL import Image, UnidentifiedImageError

        if part["type"] == "image":
            path = Path(source)
            if not path.is_file():
                raise RecordError("bad_image", f"{where}: image file {part['image']!r} not found ({path})")
            data = path.read_bytes()
        else:
            if not source.startswith(DATA_URL) or ";base64," not in source:
                raise RecordError(
                    "bad_image",
                    f"{where}: image_url must be a base64 data URL (data:image/...;base64,...); nothing is downloaded",
                )
            try:
                data = base64.b64decode(source.split(";base64,", 1)[1], validate=True)
            except (binascii.Error, ValueError) as error:
                raise RecordError("bad_image", f"{where}: image_url holds invalid base64 ({error})") from None
        try:
            with warnings.catch_warnings():  # PIL's warning above its own limit: ours is checked below
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))  # reads the header only
        except Image.DecompressionBombError:  # above twice PIL's limit, which is at least ours
            raise RecordError(
                "bad_image",
                f"{where}: the image declares more than {2 * Image.MAX_IMAGE_PIXELS} pixels, more than "
                f"{self.setting} ({self.max_pixels}); refused before decoding it",
            ) from None
        except (UnidentifiedImageError, OSError, ValueError) as error:
            raise RecordError("bad_image", f"{where}: unreadable image ({unreadable(error)})") from None
        check_image_size(where, image.size, self.max_pixels, self.setting)
        try:
            image.load()
        except (OSError, ValueError) as error:
            raise RecordError("bad_image", f"{where}: unreadable image ({unreadable(error)})") from None
        if image.mode not in CONVERTIBLE_MODES:
            raise RecordError(
                "bad_image",
                f"{where}: image mode {image.mode!r} is not supported (one of {', '.join(CONVERTIBLE_MODES)})",
            )
        return image.convert("RGB")

    def _process(self, where: str, image) -> TrajectoryImage:
        """``image`` (RGB, its size checked) through the image processor."""
        pixels = np.asarray(image)
        try:  # the layout said, never guessed (module docstring)
            out = self.image_processor(images=[pixels], return_tensors="np", input_data_format="channels_last")
        except ValueError as error:  # e.g. an aspect ratio the processor refuses
            raise RecordError("bad_image", f"{where}: the image processor refused the image ({error})") from None
        return TrajectoryImage.of(out["pixel_values"], out["image_grid_thw"][0], self.merge_size)


def unreadable(error: Exception) -> str:
    """Why PIL could not read an image, without the repr of the in-memory file it was given."""
    from PIL import UnidentifiedImageError

    if isinstance(error, UnidentifiedImageError):
        return "UnidentifiedImageError: not an image format PIL reads"
    return f"{type(error).__name__}: {error}"


def expand_image_pads(ids: list[int], image_token_id: int, counts: list[int], where: str) -> list[int]:
    """``ids`` with the k-th ``<|image_pad|>`` repeated ``counts[k]`` times (the image's merged patches)."""
    pads = [index for index, token in enumerate(ids) if token == image_token_id]
    if len(pads) != len(counts):
        raise ValueError(f"{where}: {len(counts)} image(s) but {len(pads)} image placeholder(s) in the rendering")
    out: list[int] = []
    previous = 0
    for index, count in zip(pads, counts, strict=True):
        out.extend(ids[previous:index])
        out.extend([image_token_id] * count)
        previous = index + 1
    out.extend(ids[previous:])
    return out
