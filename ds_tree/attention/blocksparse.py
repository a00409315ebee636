"""Block-sparse tree attention for the CPU (and any device torch runs on), with autograd.

Queries are cut into blocks of ``block`` tokens. For each query block only the key blocks that
some of its queries can see are gathered: key block ``j`` is visible to query block ``i`` iff
``j <= i`` and ``max(kv_end[block j]) > first query of block i``. In DFS pre-order those are the
blocks of the queries' ancestors, so the work and the memory grow with the visible pairs (at block
granularity), not with N^2. Each block is handed to ``scaled_dot_product_attention`` with the
element mask (or none when every pair is visible) and ``enable_gqa``, so k/v heads are never
repeated in memory and the backward is PyTorch's own (its CPU flash path keeps only the
log-sum-exp, not the probabilities).

The block plan depends only on ``kv_end``, which every layer of a forward shares: it is built once
and cached by the bytes of ``kv_end``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

DEFAULT_BLOCK = 128


@dataclass
class _BlockTask:
    query: slice
    keys: slice | np.ndarray
    """A contiguous key range (a view, no copy) or the indices of the visible key blocks' tokens."""
    mask: np.ndarray | None
    """``[queries, keys]`` visibility, or None when every pair in the tile is visible."""


_PLANS: OrderedDict[bytes, list[_BlockTask]] = OrderedDict()
_PLAN_CACHE_SIZE = 16


def _runs(blocks: np.ndarray, block: int, n: int) -> list[tuple[int, int]]:
    """Contiguous token ranges covered by sorted key block ids."""
    runs: list[tuple[int, int]] = []
    for j in blocks.tolist():
        start, end = j * block, min(n, (j + 1) * block)
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


def block_plan(kv_end: np.ndarray, block: int) -> list[_BlockTask]:
    """Visible key tokens and masks of every query block for one row's ``kv_end``."""
    n = kv_end.size
    n_blocks = -(-n // block)
    padded = np.zeros(n_blocks * block, dtype=np.int64)
    padded[:n] = kv_end
    block_max = padded.reshape(n_blocks, block).max(axis=1)
    tasks = []
    for i in range(n_blocks):
        q0, q1 = i * block, min(n, (i + 1) * block)
        visible = np.flatnonzero(block_max[: i + 1] > q0)
        runs = _runs(visible, block, n)
        keys = np.concatenate([np.arange(s, e) for s, e in runs])
        queries = np.arange(q0, q1)
        mask = (keys[None, :] <= queries[:, None]) & (queries[:, None] < kv_end[keys][None, :])
        tasks.append(
            _BlockTask(
                query=slice(q0, q1),
                keys=slice(*runs[0]) if len(runs) == 1 else keys,
                mask=None if mask.all() else mask,
            )
        )
    return tasks


def _cached_plan(kv_end: torch.Tensor, block: int) -> list[_BlockTask]:
    values = kv_end.detach().to("cpu", torch.int64).numpy()
    cache_key = values.tobytes() + block.to_bytes(4, "little")
    plan = _PLANS.get(cache_key)
    if plan is None:
        plan = block_plan(values, block)
        _PLANS[cache_key] = plan
        if len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(cache_key)
    return plan


def blocksparse_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    scale: float | None = None,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Tree attention, ``[B, Hq, N, D]`` x ``[B, Hkv, N, D]`` -> ``[B, N, Hq, D]`` (see reference)."""
    batch, heads_q, n, head_dim = query.shape
    if heads_q % key.shape[1]:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({key.shape[1]})")
    if scale is None:
        scale = head_dim**-0.5
    gqa = heads_q != key.shape[1]
    rows = []
    for b in range(batch):
        q_row, k_row, v_row = query[b : b + 1], key[b : b + 1], value[b : b + 1]
        pieces = []
        for task in _cached_plan(kv_end[b], block):
            if isinstance(task.keys, slice):
                k_tile, v_tile = k_row[:, :, task.keys], v_row[:, :, task.keys]
            else:
                index = torch.as_tensor(task.keys, device=key.device)
                k_tile, v_tile = k_row.index_select(2, index), v_row.index_select(2, index)
            mask = None if task.mask is None else torch.as_tensor(task.mask, device=query.device)
            pieces.append(
                F.scaled_dot_product_attention(
                    q_row[:, :, task.query], k_tile, v_tile, attn_mask=mask, scale=scale, enable_gqa=gqa
                )
            )
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous()
