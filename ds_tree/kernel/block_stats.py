"""How much of a block-sparse attention pass is useful work, for a given ``kv_end``.

A blocked kernel (the Triton one, flash-attn) tiles the ``[query, key]`` score matrix into
``block_m x block_n`` tiles and computes every element of each tile it visits. With the tree mask
(``k <= q < kv_end[k]``, docs/DESIGN.md section 2) a tile is visited only if it may hold a visible pair:

- key block ``j`` starts at or before the tile's last (real) query, and
- some key of block ``j`` is still visible at the tile's first query: ``max(kv_end[block j]) > q0``.

A visited tile is *fully visible* when every key of the block precedes the first query and every
key's ``kv_end`` is past the tile's last row (``min(kv_end[block j]) > q0 + block_m - 1``); such a
tile needs no element mask. The Triton kernel uses exactly these rules (both of its tile schedules:
``tile_lists.classify_tiles`` is the one place they are written), so the numbers here are what it
actually computes.
"""

from __future__ import annotations

import torch

from ds_tree.kernel.tile_lists import classify_tiles


def block_stats(kv_end: torch.Tensor, block_m: int, block_n: int) -> dict:
    """Tile counts and tile efficiency of ``kv_end`` (``[N]`` or ``[B, N]``), summed over rows.

    Returns ``visited_tiles``, ``fully_visible_tiles``, ``total_tiles``, ``useful_elements``
    (visible query/key pairs), ``computed_elements`` (``visited_tiles * block_m * block_n``) and
    ``tile_efficiency`` (useful / computed).
    """
    kv_end = kv_end.reshape(-1, kv_end.shape[-1]).long()
    n = kv_end.shape[-1]
    visited, full = classify_tiles(kv_end, block_m, block_n)
    # Every query k..kv_end[k]-1 sees key k: the visible pairs are a plain sum.
    useful = int((kv_end - torch.arange(n, device=kv_end.device)).sum())
    visited_tiles = int(visited.sum())
    computed = visited_tiles * block_m * block_n
    return {
        "visited_tiles": visited_tiles,
        "fully_visible_tiles": int(full.sum()),
        "total_tiles": int(visited[0].numel() * kv_end.shape[0]),
        "useful_elements": useful,
        "computed_elements": computed,
        "tile_efficiency": useful / computed if computed else 0.0,
    }
