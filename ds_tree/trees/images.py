"""Images inside trajectories: what an image is to a tree, and how it enters the trie.

A vision-language trajectory holds each image as a run of identical placeholder ids
(``<|image_pad|>``), one per merged patch, that the model replaces by the vision tower's output.
The ids say nothing about the image, so a trie keyed on ids would merge two different screenshots
into one node: a silent wrong result. An image therefore enters the trie by its **identity**, a
hash of its processed pixels and its grid (:attr:`TrajectoryImage.key`): identical screenshots
merge, different ones never do (:func:`trie_keys`).

Positions are the other half: Qwen2-VL-style models use multimodal rotary positions (temporal,
height, width) that the trajectory carries (``Trajectory.rope_positions``, computed with the model's
own rule, :mod:`ds_tree.models.vision`). They depend only on the path's prefix, so every path through
a shared token gives it the same three positions; the trie lays them out and checks exactly that.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ds_tree.errors import DataError


@dataclass(frozen=True, eq=False)
class TrajectoryImage:
    """One processed image: the image processor's patches and grid."""

    pixel_values: np.ndarray
    """``[t * h * w, channels * temporal_patch * patch * patch]`` float32, as the image processor gives them."""
    grid_thw: tuple[int, int, int]
    """Patches along time, height and width (before merging)."""
    merge_size: int
    """Patches merged into one token along height and width (2 for the Qwen VL families)."""
    key: str
    """Identity: sha256 of the grid, the merge size, the pixels' shape and dtype, and the pixel bytes."""

    @classmethod
    def of(cls, pixel_values, grid_thw, merge_size: int = 2) -> TrajectoryImage:
        pixels = np.ascontiguousarray(np.asarray(pixel_values, dtype=np.float32))
        grid = tuple(int(v) for v in np.asarray(grid_thw).reshape(-1))
        if len(grid) != 3 or min(grid) < 1:
            raise DataError(f"an image grid is (t, h, w) of positive integers, got {grid}")
        if grid[1] % merge_size or grid[2] % merge_size:
            raise DataError(f"image grid {grid}: height and width must be multiples of the merge size {merge_size}")
        if pixels.ndim != 2 or pixels.shape[0] != grid[0] * grid[1] * grid[2]:
            raise DataError(
                f"image grid {grid} has {grid[0] * grid[1] * grid[2]} patches but pixel_values has shape {pixels.shape}"
            )
        if not np.isfinite(pixels).all():  # NaN or inf (or a value beyond float32): every loss would be nan
            row = int(np.flatnonzero(~np.isfinite(pixels).all(axis=1))[0])
            raise DataError(f"pixel_values has a value that is not a finite float32 number (NaN or inf) in row {row}")
        digest = hashlib.sha256()
        digest.update(repr((grid, merge_size, pixels.shape, str(pixels.dtype))).encode())
        digest.update(pixels.tobytes())
        return cls(pixels, grid, merge_size, digest.hexdigest())

    @property
    def tokens(self) -> int:
        """Placeholder tokens of the image: its merged patches."""
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size * self.merge_size)


def image_runs(image_index: np.ndarray) -> list[tuple[int, int, int]]:
    """``(image, start, end)`` of every maximal run of one image's tokens (``image_index >= 0``)."""
    runs = []
    tokens = np.flatnonzero(image_index >= 0)
    if not tokens.size:
        return runs
    breaks = np.flatnonzero((np.diff(tokens) != 1) | (np.diff(image_index[tokens]) != 0)) + 1
    for chunk in np.split(tokens, breaks):
        runs.append((int(image_index[chunk[0]]), int(chunk[0]), int(chunk[-1]) + 1))
    return runs


def check_image_layout(where: str, image_index: np.ndarray, images: tuple[TrajectoryImage, ...]) -> None:
    """Each image of ``images`` is one run of exactly its token count, in order."""
    runs = image_runs(image_index)
    if [run[0] for run in runs] != list(range(len(images))):
        raise DataError(
            f"{where}: images must appear once each, in order, as one run of placeholders; found the runs "
            f"{[run[0] for run in runs]} for {len(images)} image(s)"
        )
    for image, start, end in runs:
        if end - start != images[image].tokens:
            raise DataError(
                f"{where}: image {image} (grid {images[image].grid_thw}) needs {images[image].tokens} placeholder "
                f"tokens, the trajectory has {end - start} at tokens {start}..{end - 1}"
            )


class PlaceholderCountError(ValueError):
    """The placeholders of a token sequence and its images' merged patches differ in number."""

    def __init__(self, found: int, needed: int) -> None:
        super().__init__(f"{found} image placeholder token(s), the images need {needed}")
        self.found, self.needed = found, needed


def placeholder_index(input_ids: np.ndarray, image_token_id: int, images) -> np.ndarray:
    """Per token: the image its placeholder shows (``-1`` for text), the ``image_token_id`` tokens taken in
    order, each image's merged patch count at a time; a :class:`PlaceholderCountError` when the counts
    differ (each caller says where)."""
    input_ids = np.asarray(input_ids)
    placeholders = np.flatnonzero(input_ids == image_token_id)
    counts = [image.tokens for image in images]
    if placeholders.size != sum(counts):
        raise PlaceholderCountError(placeholders.size, sum(counts))
    index = np.full(input_ids.shape, -1, dtype=np.int64)
    index[placeholders] = np.repeat(np.arange(len(counts)), counts)
    return index


def patch_index(image_index: np.ndarray) -> np.ndarray:
    """Per token: its merged patch inside its image (``-1`` for text)."""
    patch = np.full(image_index.shape, -1, dtype=np.int64)
    for _, start, end in image_runs(image_index):
        patch[start:end] = np.arange(end - start)
    return patch


def trie_keys(input_ids: np.ndarray, image_index: np.ndarray | None, images, codes: dict[str, int]) -> np.ndarray:
    """The token sequence the trie compares: the ids, with every token of an image replaced by
    ``-1 - code`` of its image's identity (``codes``: key -> small integer, filled as keys appear).

    One key per image suffices: two paths that agree on every key up to a token agree on where each
    image run starts, so equal keys there mean the same image at the same patch."""
    if image_index is None or not images:
        return input_ids
    keys = input_ids.copy()
    tokens = np.flatnonzero(image_index >= 0)
    per_image = np.array([-1 - codes.setdefault(image.key, len(codes)) for image in images], dtype=np.int64)
    keys[tokens] = per_image[image_index[tokens]]
    return keys
