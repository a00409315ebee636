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
        """Model inputs with a leading batch dimension of 1."""
        return {
            name: torch.as_tensor(getattr(self, name), device=device)[None]
            for name, spec in TOKEN_FIELDS.items()
            if spec.model_input
        }


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
