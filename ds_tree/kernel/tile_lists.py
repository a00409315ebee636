"""Which tiles a blocked tree-attention kernel visits, as compact per-block lists (the ``list`` schedule).

A blocked kernel tiles the ``[query, key]`` scores into ``block_m x block_n`` tiles. With the tree mask
(``k <= q < kv_end[k]``, docs/DESIGN.md section 2), and a sliding window on the depths, per-block bounds
put every tile in one of three classes:

- **empty**: no pair can be visible (the key block starts after the tile's last query, or no key of it
  is still visible at the first query, ``max(kv_end[block]) <= q0``, or the window cuts every pair);
  never loaded;
- **full**: every pair is visible (all keys precede the first query, ``min(kv_end[block])`` is past the
  last row, the window reaches the shallowest key from the deepest query, both blocks whole); computed
  without the element mask;
- **partial**: the rest, computed with the element mask.

These are the rules the ``loop`` schedule evaluates per tile inside the kernel (``block_stats`` counts
them). The ``list`` schedule evaluates them once here, in vectorised torch on the kernel's device, and
hands each program two ordered lists, full tiles then partial tiles, so its loops have no branch
(FlexAttention's ``BlockMask`` has the same pair, ``full_kv_indices`` and ``kv_indices``). The forward
and dQ kernels take the lists per query block (entries: key blocks), the dK/dV kernel per key block
(entries: query blocks): the same classification, transposed.

Without a window the classes are exact when ``block_n`` divides ``block_m`` (the kernels' shapes): a
listed tile holds a visible pair. Otherwise (windows, other shapes) an empty tile is still certainly
empty and a full tile certainly full, but a partial tile may turn out to hold no visible pair: it is
computed with its mask, which is correct, only wasted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCHEDULES = ("loop", "list")
"""How the Triton kernels walk their tiles: ``loop`` classifies each tile in the kernel (a branch per
tile), ``list`` reads the lists built here (two branch-free loops). docs/KERNEL.md says which is faster."""
DEFAULT_SCHEDULE = "loop"
"""``loop`` until a GPU run shows ``list`` faster: the lists are exact under the interpreter (every
Triton test runs on both) and compile for sm_90, but have not yet run or been timed on a GPU
(docs/KERNEL.md)."""
SCHEDULE_VARIABLE = "DS_TREE_TRITON_TILES"
"""Environment variable naming the schedule of calls that pass none (gpu-check's columns, a user's run)."""
POSITION_FILL = 2**30
"""Beyond any depth: a ragged block's missing tokens take ``-POSITION_FILL`` in a max, ``+`` in a min."""


def resolve_schedule(tile_schedule: str | None = None) -> str:
    """``tile_schedule``, else ``$DS_TREE_TRITON_TILES``, else :data:`DEFAULT_SCHEDULE`; ValueError naming
    where an unknown name came from."""
    name = tile_schedule if tile_schedule is not None else os.environ.get(SCHEDULE_VARIABLE) or DEFAULT_SCHEDULE
    if name not in SCHEDULES:
        source = "tile_schedule" if tile_schedule is not None else f"${SCHEDULE_VARIABLE}"
        raise ValueError(f"{source} = {name!r}: choose one of {', '.join(SCHEDULES)}")
    return name


def key_block_end_bounds(kv_end: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block max and min of ``kv_end``: two int32 tensors ``[B, ceil(N / block_n)]``.

    The ragged last block is padded with ``kv_end = 0``: such keys see nothing, and a padded
    minimum of 0 correctly keeps a partial block off the unmasked fast path.
    """
    kv_end = kv_end.reshape(-1, kv_end.shape[-1]).to(torch.int32)
    n = kv_end.shape[-1]
    num_blocks = -(-n // block_n)
    padded = F.pad(kv_end, (0, num_blocks * block_n - n), value=0).view(kv_end.shape[0], num_blocks, block_n)
    return padded.amax(dim=-1).contiguous(), padded.amin(dim=-1).contiguous()


def block_position_bounds(positions: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``block`` tokens the max and min of ``positions`` (the depths): two int32 tensors
    ``[B, ceil(N / block)]``, the ragged last block's missing tokens left out of both.

    With a sliding window a tile is empty when its shallowest query is ``window`` or more deeper than
    its deepest key, and full only when even its deepest query is within ``window`` of its shallowest key.
    """
    positions = positions.reshape(-1, positions.shape[-1]).to(torch.int32)
    n = positions.shape[-1]
    num_blocks = -(-n // block)
    missing = num_blocks * block - n
    highest = F.pad(positions, (0, missing), value=-POSITION_FILL).view(positions.shape[0], num_blocks, block)
    lowest = F.pad(positions, (0, missing), value=POSITION_FILL).view(positions.shape[0], num_blocks, block)
    return highest.amax(dim=-1).contiguous(), lowest.amin(dim=-1).contiguous()


def classify_tiles(
    kv_end: torch.Tensor,
    block_m: int,
    block_n: int,
    positions: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(listed, full)``: two bool tensors ``[B, query blocks, key blocks]`` for ``kv_end`` ``[N]`` or
    ``[B, N]``; ``listed`` marks the non-empty tiles (full or partial), ``full`` the full ones (a subset).

    With a ``window``, ``positions`` (the depths, shaped like ``kv_end``) bound the tiles too.
    """
    kv_end = kv_end.reshape(-1, kv_end.shape[-1])
    n = kv_end.shape[-1]
    device = kv_end.device
    max_end, min_end = key_block_end_bounds(kv_end, block_n)
    query_start = torch.arange(0, n, block_m, device=device, dtype=torch.int32)[None, :, None]
    query_last = torch.clamp(query_start + block_m, max=n) - 1
    key_start = torch.arange(0, n, block_n, device=device, dtype=torch.int32)[None, None, :]
    listed = (key_start <= query_last) & (max_end[:, None, :] > query_start)
    full = (key_start + block_n - 1 <= query_start) & (min_end[:, None, :] > query_start + block_m - 1)
    if window is not None:
        if positions is None:
            raise ValueError("classify_tiles: a window needs the positions (depths)")
        positions = positions.reshape(kv_end.shape)
        query_max, query_min = block_position_bounds(positions, block_m)
        key_max, key_min = block_position_bounds(positions, block_n)
        listed = listed & (query_min[:, :, None] - key_max[:, None, :] < window)
        full = full & (query_max[:, :, None] - key_min[:, None, :] < window)
    return listed, full & listed


@dataclass(frozen=True)
class TileLists:
    """Per row block (a query block, or a key block for dK/dV) the column blocks to visit, in
    ascending order: ``full [B, rows, width]`` with ``full_counts [B, rows]`` entries each, and the
    same for ``partial``. Entries past a row's count are -1 (never read). int32, contiguous."""

    full: torch.Tensor
    full_counts: torch.Tensor
    partial: torch.Tensor
    partial_counts: torch.Tensor

    @property
    def width(self) -> int:
        """The row stride of ``full`` and ``partial`` (their last dimension)."""
        return self.full.shape[-1]

    def kernel_arguments(self) -> tuple:
        """``FULL, FULL_COUNTS, PARTIAL, PARTIAL_COUNTS, list_width``: the kernels' order."""
        return self.full, self.full_counts, self.partial, self.partial_counts, self.width


def compact(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices of the True entries of each row of ``mask [B, rows, columns]``, ascending, at the front
    of ``[B, rows, columns]`` int32 (the rest -1), and their counts ``[B, rows]`` int32.

    The width stays ``columns`` (no host synchronisation to find the longest row): ``columns`` ints per
    block, 4 MiB for a 64K-token row in 64-token blocks.
    """
    counts = mask.sum(-1, dtype=torch.int32)
    columns = mask.shape[-1]
    # each listed column goes to its rank among the listed ones; the others to a spare slot, cut off after
    slots = torch.where(mask, mask.cumsum(-1) - 1, columns)
    indices = torch.arange(columns, device=mask.device, dtype=torch.int32).expand(mask.shape)
    found = torch.full((*mask.shape[:-1], columns + 1), -1, device=mask.device, dtype=torch.int32)
    return found.scatter_(-1, slots, indices)[..., :columns].contiguous(), counts.contiguous()


def tile_lists(listed: torch.Tensor, full: torch.Tensor) -> TileLists:
    """The full and partial lists of each row of a classification ``[B, rows, columns]``."""
    full_indices, full_counts = compact(full)
    partial_indices, partial_counts = compact(listed & ~full)
    return TileLists(full_indices, full_counts, partial_indices, partial_counts)


def query_tile_lists(kv_end, block_m, block_n, positions=None, window=None) -> TileLists:
    """Per query block the key blocks to visit (the forward's and the dQ kernel's lists)."""
    return tile_lists(*classify_tiles(kv_end, block_m, block_n, positions, window))


def backward_tile_lists(kv_end, block_m, block_n, positions=None, window=None) -> tuple[TileLists, TileLists]:
    """``(per query block, per key block)``: the dQ kernel's lists and the dK/dV kernel's, from one
    classification of the backward's tiles."""
    listed, full = classify_tiles(kv_end, block_m, block_n, positions, window)
    return tile_lists(listed, full), tile_lists(listed.transpose(1, 2).contiguous(), full.transpose(1, 2).contiguous())
