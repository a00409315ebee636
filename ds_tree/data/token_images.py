"""Images in tokens records: pixels that were already processed, with the placeholders already expanded.

A tokens record (:mod:`ds_tree.data.tokens`) may carry ``images``, one entry per image in order of
appearance::

    "images": [{"pixel_values": "shots/1.npy", "grid_thw": [1, 4, 8]}, ...]

``pixel_values`` is a ``.npy`` file (a path relative to the JSONL file, read without pickle) or a nested
list: the family's image processor output for that image, ``[t * h * w, 3 * temporal_patch * patch *
patch]`` (as ``pixel_values`` of transformers' Qwen2-VL processors); ``grid_thw`` is its patch grid (the
processor's ``image_grid_thw`` row). ``input_ids`` already hold each image's ``<|image_pad|>`` repeated
once per merged patch (``t * h * w / merge**2``), as the processor folder's rendering writes them; the
record may say which image each token shows in ``image_index`` (``-1`` for text), else the k-th run of
``t * h * w / merge**2`` placeholders is image k. The processor folder (``--tokenizer``, ``ds-tree
make-tokenizer --vision``) gives the placeholder id, the merge size and the patch size. A file that
cannot be read, pixels of the wrong shape, a grid that does not match the placeholders are one
:class:`~ds_tree.errors.RecordError` naming ``file:line: images[k]``. Images are identified by content
(:class:`~ds_tree.trees.images.TrajectoryImage`), so the same pixels given as a file, as a list or
through a chat record are one image of the dataset; each file is read once per converter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ds_tree.data.records import integer_list
from ds_tree.errors import DataError, RecordError
from ds_tree.trees.images import PlaceholderCountError, TrajectoryImage
from ds_tree.trees.images import placeholder_index as image_placeholder_index

SAVED_ROLLOUT_IMAGE = {"key", "grid_thw"}
"""How a vision-language run's saved rollouts (``output_dir/rollouts/step_<N>.jsonl``) name an image: by
identity only, without its pixels."""


def check_not_saved_rollout(where: str, images: object) -> None:
    """A :class:`RecordError` for the ``images`` of a vision-language run's saved rollout: its pixels were not
    saved, so no reader can give the trajectory its images (stats, verify and convert refuse it)."""
    if isinstance(images, list) and any(
        isinstance(entry, dict) and set(entry) == SAVED_ROLLOUT_IMAGE for entry in images
    ):
        raise RecordError(
            "bad_image",
            f"{where}: a saved rollout of a vision-language run: it names its images by key only ('key', 'grid_thw'; "
            "rollouts/step_<N>.jsonl keeps no pixels), so its images cannot be read and the file cannot be used by "
            "stats, verify or convert (docs/ENVIRONMENTS.md, Image observations)",
        )


def placeholder_index(where: str, input_ids: np.ndarray, image_token_id: int, images) -> np.ndarray:
    """Per token: the image its placeholder shows (``-1`` for text), the placeholders taken in order,
    each image's merged patch count at a time; a :class:`RecordError` when the counts differ."""
    try:
        return image_placeholder_index(input_ids, image_token_id, images)
    except PlaceholderCountError as error:
        grids = [image.grid_thw for image in images]
        raise RecordError(
            "bad_image",
            f"{where}: the images' grids {grids} need {error.needed} placeholder token(s) (id {image_token_id}), "
            f"input_ids has {error.found}",
        ) from None


def given_image_index(where: str, value: object, input_ids: np.ndarray, image_token_id: int) -> np.ndarray:
    """A record's ``image_index``, checked to mark exactly the placeholder tokens (the runs' lengths and
    order are the trajectory's own check)."""
    index = np.asarray(integer_list(where, "image_index", value), dtype=np.int64)
    if index.shape != input_ids.shape:
        raise RecordError("bad_image", f"{where}: image_index has {index.size} entries, input_ids {input_ids.size}")
    wrong = np.flatnonzero((index >= 0) != (input_ids == image_token_id))
    if wrong.size:
        token = int(wrong[0])
        raise RecordError(
            "bad_image",
            f"{where}: token {token}: image_index {int(index[token])} but input_ids {int(input_ids[token])} "
            f"(the placeholders, id {image_token_id}, are exactly the tokens with an image)",
        )
    return index


class ProcessedImageReader:
    """Reads the ``images`` of tokens records into :class:`TrajectoryImage` (module docstring)."""

    def __init__(self, merge_size: int, patch_values: int) -> None:
        self.merge_size = merge_size
        self.patch_values = patch_values
        """Values per patch: channels x temporal patch x patch x patch of the processor folder's family."""
        self.files: dict[Path, np.ndarray] = {}

    def read(self, where: str, images: object) -> list[TrajectoryImage]:
        """``where``: the record's ``FILE:LINE`` (a relative path is relative to FILE)."""
        check_not_saved_rollout(where, images)
        if not isinstance(images, list):
            raise RecordError("bad_image", f"{where}: 'images' must be a list of {{'pixel_values', 'grid_thw'}}")
        return [self._image(f"{where}: images[{k}]", where, entry) for k, entry in enumerate(images)]

    def _image(self, at: str, where: str, entry: object) -> TrajectoryImage:
        if not isinstance(entry, dict) or set(entry) != {"pixel_values", "grid_thw"}:
            raise RecordError("bad_image", f"{at}: an image is an object with exactly 'pixel_values' and 'grid_thw'")
        pixels = self._pixels(at, where, entry["pixel_values"])
        if pixels.ndim != 2 or pixels.shape[1] != self.patch_values:
            raise RecordError(
                "bad_image",
                f"{at}: pixel_values has shape {pixels.shape}, expected (patches, {self.patch_values}) for the "
                "processor folder's family (channels x temporal patch x patch x patch)",
            )
        grid = entry["grid_thw"]
        if not (isinstance(grid, list) and len(grid) == 3 and all(type(v) is int for v in grid)):
            raise RecordError("bad_image", f"{at}: grid_thw must be a list of 3 integers [t, h, w], got {grid!r}")
        try:
            return TrajectoryImage.of(pixels, grid, self.merge_size)
        except DataError as error:
            raise RecordError("bad_image", f"{at}: {error}") from None

    def _pixels(self, at: str, where: str, value: object) -> np.ndarray:
        if isinstance(value, list):
            try:
                with np.errstate(over="ignore"):  # a value beyond float32 becomes inf, refused by TrajectoryImage.of
                    return np.asarray(value, dtype=np.float32)
            except (ValueError, TypeError) as error:
                raise RecordError(
                    "bad_image", f"{at}: pixel_values is not a rectangular list of numbers ({error})"
                ) from None
        if not isinstance(value, str):
            raise RecordError("bad_image", f"{at}: pixel_values is a .npy path (relative to the file) or a nested list")
        path = (Path(where.rsplit(":", 1)[0]).parent / value).resolve()
        if path not in self.files:
            if not path.is_file():
                raise RecordError("bad_image", f"{at}: pixel_values file {value!r} not found ({path})")
            try:
                array = np.load(path, allow_pickle=False)
            except (OSError, ValueError, EOFError) as error:
                raise RecordError("bad_image", f"{at}: unreadable .npy file {value!r} ({error})") from None
            if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.number):
                raise RecordError("bad_image", f"{at}: {value!r} holds no numeric array")
            if np.iscomplexobj(array):  # float32 would silently drop the imaginary part
                raise RecordError(
                    "bad_image", f"{at}: {value!r} holds complex numbers ({array.dtype}); pixels are real"
                )
            with np.errstate(over="ignore"):
                self.files[path] = array.astype(np.float32)
        return self.files[path]
