"""Block-sparse tree attention for the CPU, with its own autograd function.

Queries are cut into blocks of ``block`` tokens. For each query block only the keys that some of
its queries can see are gathered: key ``k`` is visible to the block ``[q0, q1)`` iff ``k < q1``
and ``kv_end[k] > q0``. In DFS pre-order those are the queries' ancestors, so the work grows
with the visible pairs, not with N^2; a flat layout's keys are one contiguous range (a view).
Each block goes to PyTorch's CPU flash-attention kernel with the element mask (or none when
every pair is visible); a group's query heads are stacked along the sequence axis, so GQA never
repeats k/v in memory. The autograd function saves only q, k, v, the output and the
log-sum-exp, and the backward regathers each tile: saved memory is O(N), plus one tile at a time.

The block plan depends only on ``kv_end``, which every layer of a forward shares: it is built once
and cached by the bytes of ``kv_end``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

DEFAULT_BLOCK = 128


@dataclass
class _BlockTask:
    query: slice
    keys: slice | np.ndarray
    """A contiguous key range (a view, no copy) or the indices of the visible keys."""
    mask: np.ndarray | None
    """``[queries, keys]`` visibility, or None when every pair in the tile is visible."""
    additive: dict = field(default_factory=dict)
    """The mask as the flash kernel takes it, per (dtype, device, GQA group), built once."""


_PLANS: OrderedDict[bytes, list[_BlockTask]] = OrderedDict()
_PLAN_CACHE_SIZE = 16


def block_plan(kv_end: np.ndarray, block: int) -> list[_BlockTask]:
    """Visible keys and masks of every query block for one row's ``kv_end``.

    The keys gathered for a query block are exactly those visible to at least one of its queries
    (``k < q1`` and ``kv_end[k] > q0``), at token granularity: ancestors' siblings that merely
    share a block with an ancestor are left out (about 30% fewer computed scores than gathering
    whole key blocks, on agentic trees with 128-token blocks).
    """
    n = kv_end.size
    positions = np.arange(n)
    tasks = []
    for q0 in range(0, n, block):
        q1 = min(n, q0 + block)
        keys = np.flatnonzero(kv_end[:q1] > q0)
        queries = positions[q0:q1]
        mask = (keys[None, :] <= queries[:, None]) & (queries[:, None] < kv_end[keys][None, :])
        contiguous = keys[-1] - keys[0] + 1 == keys.size
        tasks.append(
            _BlockTask(
                query=slice(q0, q1),
                keys=slice(int(keys[0]), int(keys[-1]) + 1) if contiguous else keys,
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


_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _grouped(tensor: torch.Tensor, heads_kv: int, rows: slice) -> torch.Tensor:
    """``[1, Hq, N, D]`` rows -> ``[1, Hkv, G * rows, D]``: a group's query heads stacked along the
    sequence axis, so one k/v head serves them all without repeating k/v in memory."""
    _, heads_q, _, dim = tensor.shape
    if heads_q == heads_kv:  # no GQA: a strided view, which the flash kernel takes without a copy
        return tensor[:, :, rows]
    block = tensor[:, :, rows].reshape(1, heads_kv, heads_q // heads_kv, -1, dim)
    return block.reshape(1, heads_kv, -1, dim)


def _ungrouped(block: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Inverse of :func:`_grouped` for one block: ``[1, Hkv, G * r, D]`` -> ``[1, Hq, r, D]``."""
    return block.reshape(1, heads_q, -1, block.shape[-1])


def _tile(tensor: torch.Tensor, keys: slice | np.ndarray) -> torch.Tensor:
    if isinstance(keys, slice):
        return tensor[:, :, keys]
    return tensor.index_select(2, torch.as_tensor(keys, device=tensor.device))


def _additive_mask(task: _BlockTask, group: int, like: torch.Tensor) -> torch.Tensor | None:
    """The flash kernel takes an additive mask in the query dtype, one row per stacked query."""
    if task.mask is None:
        return None
    key = (like.dtype, like.device, group)
    mask = task.additive.get(key)
    if mask is None:
        mask = torch.zeros(task.mask.shape, dtype=like.dtype, device=like.device)
        mask.masked_fill_(~torch.as_tensor(task.mask, device=like.device), float("-inf"))
        mask = task.additive[key] = mask.repeat(group, 1)
    return mask


class _BlockSparseAttention(torch.autograd.Function):
    """One row of tree attention on PyTorch's CPU flash kernels, saving only q, k, v, out and lse.

    Letting autograd trace the per-block calls would keep every gathered k/v tile and mask alive
    until backward (more memory per token than the flat layout, whose tiles are views). Here the
    backward regathers each tile and calls the flash backward per block instead.
    """

    @staticmethod
    def forward(ctx, query, key, value, plan, scale):
        heads_q, heads_kv = query.shape[1], key.shape[1]
        group = heads_q // heads_kv
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:3], dtype=torch.float64 if query.dtype == torch.float64 else torch.float32)
        for task in plan:
            block_out, block_lse = _flash_forward(
                _grouped(query, heads_kv, task.query),
                _tile(key, task.keys),
                _tile(value, task.keys),
                0.0,
                False,
                attn_mask=_additive_mask(task, group, query),
                scale=scale,
            )
            out[:, :, task.query] = _ungrouped(block_out, heads_q)
            lse[:, :, task.query] = block_lse.reshape(1, heads_q, -1)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        heads_q, heads_kv = query.shape[1], key.shape[1]
        group = heads_q // heads_kv
        grad_out = grad_out.contiguous()
        grad_query = torch.empty_like(query)
        grad_key = torch.zeros_like(key)
        grad_value = torch.zeros_like(value)
        for task in ctx.plan:
            block_lse = lse[:, :, task.query].reshape(1, heads_kv, -1)
            d_query, d_key, d_value = _flash_backward(
                _grouped(grad_out, heads_kv, task.query),
                _grouped(query, heads_kv, task.query),
                _tile(key, task.keys),
                _tile(value, task.keys),
                _grouped(out, heads_kv, task.query),
                block_lse,
                0.0,
                False,
                attn_mask=_additive_mask(task, group, query),
                scale=ctx.scale,
            )
            grad_query[:, :, task.query] = _ungrouped(d_query, heads_q)
            if isinstance(task.keys, slice):
                grad_key[:, :, task.keys] += d_key
                grad_value[:, :, task.keys] += d_value
            else:
                index = torch.as_tensor(task.keys, device=key.device)
                grad_key.index_add_(2, index, d_key)
                grad_value.index_add_(2, index, d_value)
        return grad_query, grad_key, grad_value, None, None


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
    rows = [
        _BlockSparseAttention.apply(
            query[b : b + 1], key[b : b + 1], value[b : b + 1], _cached_plan(kv_end[b], block), scale
        )
        for b in range(batch)
    ]
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous()
