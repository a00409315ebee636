"""How much of a block-sparse attention pass is useful work, for a given ``kv_end``.

A blocked kernel (the Triton one, flash-attn) tiles the ``[query, key]`` score matrix into
``block_m x block_n`` tiles and computes every element of each tile it visits. With the tree mask
(``k <= q < kv_end[k]``, docs/DESIGN.md section 2) a tile is visited only if it may hold a visible pair:

- key block ``j`` starts at or before the tile's last (real) query, and
- some key of block ``j`` is still visible at the tile's first query: ``max(kv_end[block j]) > q0``.

A visited tile is *fully visible* when every key of the block precedes the first query and every
key's ``kv_end`` is past the tile's last row (``min(kv_end[block j]) > q0 + block_m - 1``); such a
tile needs no element mask. The Triton kernel uses exactly these rules and the per-key-block
bounds from :func:`key_block_end_bounds`, so the numbers here are what it actually computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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

    With a sliding window the Triton kernels skip a tile when its shallowest query is ``window`` or
    more deeper than its deepest key, and drop the element mask when even its deepest query is
    within ``window`` of its shallowest key.
    """
    positions = positions.reshape(-1, positions.shape[-1]).to(torch.int32)
    n = positions.shape[-1]
    num_blocks = -(-n // block)
    missing = num_blocks * block - n
    highest = F.pad(positions, (0, missing), value=-(2**30)).view(positions.shape[0], num_blocks, block)
    lowest = F.pad(positions, (0, missing), value=2**30).view(positions.shape[0], num_blocks, block)
    return highest.amax(dim=-1).contiguous(), lowest.amin(dim=-1).contiguous()


def block_stats(kv_end: torch.Tensor, block_m: int, block_n: int) -> dict:
    """Tile counts and tile efficiency of ``kv_end`` (``[N]`` or ``[B, N]``), summed over rows.

    Returns ``visited_tiles``, ``fully_visible_tiles``, ``total_tiles``, ``useful_elements``
    (visible query/key pairs), ``computed_elements`` (``visited_tiles * block_m * block_n``) and
    ``tile_efficiency`` (useful / computed).
    """
    kv_end = kv_end.reshape(-1, kv_end.shape[-1]).long()
    n = kv_end.shape[-1]
    max_end, min_end = (bound.long() for bound in key_block_end_bounds(kv_end, block_n))
    query_start = torch.arange(0, n, block_m, device=kv_end.device)[:, None]  # [query blocks, 1]
    query_last = torch.clamp(query_start + block_m, max=n) - 1
    key_start = torch.arange(0, n, block_n, device=kv_end.device)[None, :]  # [1, key blocks]
    visited = (key_start <= query_last) & (max_end[:, None, :] > query_start)
    full = (key_start + block_n - 1 <= query_start) & (min_end[:, None, :] > query_start + block_m - 1)
    # Every query k..kv_end[k]-1 sees key k: the visible pairs are a plain sum.
    useful = int((kv_end - torch.arange(n, device=kv_end.device)).sum())
    visited_tiles = int(visited.sum())
    computed = visited_tiles * block_m * block_n
    return {
        "visited_tiles": visited_tiles,
        "fully_visible_tiles": int((visited & full).sum()),
        "total_tiles": int(visited[0].numel() * kv_end.shape[0]),
        "useful_elements": useful,
        "computed_elements": computed,
        "tile_efficiency": useful / computed if computed else 0.0,
    }
