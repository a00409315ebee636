"""Packing tree parts into rows (micro-batches) under a token budget.

Parts are placed first-fit decreasing by token count; several parts share a row with nothing
but offsets, because ``kv_end`` already confines attention to each part. Each row is padded to a
multiple of ``block`` with tokens that only see themselves (``kv_end = k + 1``) and weigh 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ds_tree.packing.bins import first_fit_decreasing
from ds_tree.packing.parts import TreePart
from ds_tree.trees.token_arrays import TOKEN_FIELDS, TokenArrays, concatenate_tokens


@dataclass(kw_only=True)
class PackedRow(TokenArrays):
    """One row of packed parts. Token arrays have length ``n_tokens`` (padding included)."""

    kind: ClassVar[str] = "packed"
    """The execution kind (:mod:`ds_tree.packing.plan`): a row forwarded and backwarded at once."""

    parts: list[TreePart]
    n_real: int
    """Tokens before padding."""

    @property
    def layout_parts(self) -> list[TreePart]:
        """The parts laid out in the row's tokens, in order (a sequence-parallel shard: its whole row's)."""
        return self.parts

    def predicted_here(self) -> np.ndarray:
        """Per row token, whether this rank scores its prediction (a shard's ``pred_pos`` is -1 outside it; a walked
        shard's stays row-global and it overrides this)."""
        return self.pred_pos >= 0

    def trajectory_paths(self) -> list[tuple[TreePart, int, np.ndarray]]:
        """``(part, trajectory id in its tree, row indices of its tokens)`` for every trajectory."""
        out = []
        offset = 0
        for part in self.parts:
            for trajectory_id, path in zip(part.trajectory_ids, part.paths, strict=True):
                out.append((part, trajectory_id, path + offset))
            offset += part.n_tokens
        return out

    def tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Model inputs with a leading batch dimension of 1. A row with images also passes its images
        (``row_images``, :meth:`image_inputs`) and ``position_ids`` as ``[4, 1, N]``: the depth, then the
        multimodal rotary positions (temporal, height, width; :mod:`ds_tree.models.vision`)."""
        inputs = {
            name: torch.as_tensor(getattr(self, name), device=device)[None]
            for name, spec in TOKEN_FIELDS.items()
            if spec.model_input
        }
        if np.any(self.image_id >= 0):
            inputs["position_ids"] = torch.as_tensor(self.rope_positions(), device=device)[:, None]
            inputs["row_images"] = self.forward_images()
        return inputs

    def forward_images(self) -> RowImages | None:
        """The images a forward of this row encodes (:meth:`tensors`' ``row_images``): all of the row's."""
        return self.image_inputs()

    def image_inputs(self, tokens: np.ndarray | None = None) -> RowImages:
        """The row's distinct images (one per image of each tree, however many copies the row holds: the
        flat baseline's trees are its trajectories, each encoding its own) and, per placeholder token in row
        order, its merged patch's index into their concatenated features. ``tokens`` (ascending row
        indices; default all): only the images and placeholders among them (a dfs chunk's). Vectorised:
        per token only numpy, a Python step per distinct image."""
        chosen = np.zeros(self.n_tokens, dtype=bool)
        chosen[slice(None) if tokens is None else tokens] = True
        placeholders = np.flatnonzero((self.image_id >= 0) & chosen)
        sizes = [part.n_tokens for part in self.layout_parts]
        part_of = np.repeat(np.arange(len(sizes)), sizes)[placeholders]
        pairs = part_of * (int(self.image_id.max()) + 1) + self.image_id[placeholders]
        unique, first, inverse = np.unique(pairs, return_index=True, return_inverse=True)
        slots: dict[tuple[int, int], int] = {}
        images, offsets, slot_of_pair = [], [], np.empty(unique.size, dtype=np.int64)
        for pair in np.argsort(first, kind="stable"):  # in order of first appearance in the row
            index = placeholders[first[pair]]
            tree, image_id = self.layout_parts[part_of[first[pair]]].tree, int(self.image_id[index])
            key = (id(tree), image_id)
            if key not in slots:
                slots[key] = len(images)
                offsets.append(sum(known.tokens for known in images))
                images.append(tree.images[image_id])
            slot_of_pair[pair] = slots[key]
        offsets = np.asarray(offsets, dtype=np.int64)
        feature_index = offsets[slot_of_pair[inverse]] + self.image_patch[placeholders] if images else placeholders
        return RowImages(
            pixel_values=[image.pixel_values for image in images],
            grids=[image.grid_thw for image in images],
            feature_index=np.asarray(feature_index, dtype=np.int64),
        )

    def rope_positions(self, tokens: np.ndarray | None = None) -> np.ndarray:
        """``[4, n]``: the depth and the multimodal rotary positions of ``tokens`` (default all); refused when a
        trajectory's positions were not attached."""
        rope = np.stack([self.position_ids, self.rope_t, self.rope_h, self.rope_w])
        rope = rope if tokens is None else rope[:, tokens]
        if np.any(rope < 0):
            raise ValueError(
                "a row with images holds a trajectory without its rope positions: attach them with the "
                "model's rule before packing (ds_tree.models.vision.attach_rope_positions)"
            )
        return rope


@dataclass
class RowImages:
    """What a vision-language model needs of a row's images (:mod:`ds_tree.models.vision`)."""

    pixel_values: list[np.ndarray]
    """Each distinct image's patches, in order of first appearance in the row."""
    grids: list[tuple[int, int, int]]
    feature_index: np.ndarray
    """Per placeholder token of the row, in row order: its index into the images' concatenated merged features."""


def assemble_row(parts: list[TreePart], block: int = 1, pad_id: int = 0) -> PackedRow:
    """Concatenate ``parts`` into one row padded to a multiple of ``block``."""
    if block < 1:
        raise ValueError(f"block (the row padding multiple) must be >= 1, got {block}")
    n_real = sum(part.n_tokens for part in parts)
    n = -(-n_real // block) * block if n_real else block
    arrays = concatenate_tokens(parts, n - n_real, {"input_ids": pad_id})
    return PackedRow(**arrays, parts=list(parts), n_real=n_real)


def pack_rows(parts: list[TreePart], budget: int, block: int = 1, pad_id: int = 0) -> list[PackedRow]:
    """Rows of at most ``budget`` real tokens each (first-fit decreasing), padded to ``block``."""
    too_large = [part for part in parts if part.n_tokens > budget]
    if too_large:
        raise ValueError(f"a tree part of {too_large[0].n_tokens} tokens exceeds the row budget {budget}")
    bins = first_fit_decreasing([part.n_tokens for part in parts], budget)
    return [assemble_row([parts[i] for i in members], block, pad_id) for members in bins]
