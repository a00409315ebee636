"""Packing tree parts into rows (micro-batches) under a token budget.

Parts are placed first-fit decreasing by token count; several parts share a row with nothing
but offsets, because ``kv_end`` already confines attention to each part. Each row is padded to a
multiple of ``block`` with tokens that only see themselves (``kv_end = k + 1``) and weigh 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.packing.parts import TreePart


@dataclass
class PackedRow:
    """One row of packed parts. Token arrays have length ``n_tokens`` (padding included)."""

    parts: list[TreePart]
    input_ids: np.ndarray
    position_ids: np.ndarray
    kv_end: np.ndarray
    pred_pos: np.ndarray
    mask_sum: np.ndarray
    seq_mean_sum: np.ndarray
    mask_max: np.ndarray
    n_real: int
    """Tokens before padding."""

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.size)

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
        as_long = {"input_ids": self.input_ids, "position_ids": self.position_ids, "kv_end": self.kv_end}
        return {name: torch.as_tensor(value, device=device)[None] for name, value in as_long.items()}


def assemble_row(parts: list[TreePart], block: int = 1, pad_id: int = 0) -> PackedRow:
    """Concatenate ``parts`` into one row padded to a multiple of ``block``."""
    if block < 1:
        raise ValueError(f"block (the row padding multiple) must be >= 1, got {block}")
    n_real = sum(part.n_tokens for part in parts)
    n = -(-n_real // block) * block if n_real else block
    pad = n - n_real
    offsets = np.cumsum([0] + [part.n_tokens for part in parts])[:-1]

    def join(name: str, pad_values: np.ndarray, shift: bool = False) -> np.ndarray:
        pieces = []
        for part, offset in zip(parts, offsets, strict=True):
            values = getattr(part, name)
            pieces.append(np.where(values >= 0, values + offset, values) if shift else values)
        return np.concatenate(pieces + [pad_values])

    return PackedRow(
        parts=list(parts),
        input_ids=join("input_ids", np.full(pad, pad_id, dtype=np.int64)),
        position_ids=join("position_ids", np.zeros(pad, dtype=np.int64)),
        kv_end=join("kv_end", np.arange(n_real + 1, n + 1, dtype=np.int64), shift=True),
        pred_pos=join("pred_pos", np.full(pad, -1, dtype=np.int64), shift=True),
        mask_sum=join("mask_sum", np.zeros(pad)),
        seq_mean_sum=join("seq_mean_sum", np.zeros(pad)),
        mask_max=join("mask_max", np.zeros(pad)),
        n_real=n_real,
    )


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) for items of ``sizes``; each bin's total is <= capacity."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    used: list[int] = []
    for item in order:
        for position, total in enumerate(used):
            if total + sizes[item] <= capacity:
                bins[position].append(item)
                used[position] += sizes[item]
                break
        else:
            bins.append([item])
            used.append(sizes[item])
    return [sorted(members) for members in bins]


def pack_rows(parts: list[TreePart], budget: int, block: int = 1, pad_id: int = 0) -> list[PackedRow]:
    """Rows of at most ``budget`` real tokens each (first-fit decreasing), padded to ``block``."""
    too_large = [part for part in parts if part.n_tokens > budget]
    if too_large:
        raise ValueError(f"a tree part of {too_large[0].n_tokens} tokens exceeds the row budget {budget}")
    bins = first_fit_decreasing([part.n_tokens for part in parts], budget)
    return [assemble_row([parts[i] for i in members], block, pad_id) for members in bins]
