"""Block-sparse tree attention for the CPU, with its own autograd function.

Queries are cut into blocks of ``block`` tokens. For each query block only the keys that some of
its queries can see are gathered: key ``k`` is visible to the block ``[q0, q1)`` iff ``k < q1``
and ``kv_end[k] > q0``. In DFS pre-order those are the queries' ancestors, so the work grows
with the visible pairs, not with N^2; a flat layout's keys are one contiguous range (a view).
Each block goes to PyTorch's CPU flash-attention kernel with the element mask (or none when
every pair is visible); a group's query heads are stacked along the sequence axis, so GQA never
repeats k/v in memory. The autograd function saves only q, k, v, the output and the
log-sum-exp, and the backward regathers each tile: saved memory is O(N), plus one tile at a time.

Shared prefixes ("hubs") skip the gather. A run of tokens ``[a, b)`` with one common
``kv_end = E`` is a chain (each token is the next one's parent), and every query in ``[b, E)``
descends from all of it. When the run is long and has many such queries (a system prompt under a
GRPO group, the task under its trials), its keys are left out of the query blocks that start at
or after ``b`` (rounded up to a block) and attended instead by one unmasked flash call over all
those queries at once, merged into the blocks' output by log-sum-exp. Backward runs the flash
backward of that call with the merged output and log-sum-exp, which gives exactly the gradient
share of those keys. A flat row has no hub (no token's subtree reaches past its own sequence), so
flat mode runs the same per-block calls as without hubs.

A sliding window (``positions[q] - positions[k] < window``, reference module) enters the plan
only: the element masks carry it, keys that no query of a block sees inside the window are not
gathered, and a hub is kept only where every one of its queries has all of its keys in the window.
Soft-capping (``cap * tanh(s / cap)`` on the scaled scores) has no flash kernel: each tile then
runs a plain softmax of the capped scores, with a hand-written backward that recomputes them.

The plan depends only on ``kv_end`` (and the positions when there is a window), which every
layer of a forward shares: it is built once and cached by their bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ds_tree.attention.reference import check_window, gqa_group, soft_cap

DEFAULT_BLOCK = 128
HUB_MIN_KEYS = 64
"""A shared run shorter than this stays in the per-block gathers: a flash call has fixed costs."""
HUB_MIN_QUERIES = 128


@dataclass
class _BlockTask:
    query: slice
    keys: slice | np.ndarray
    """A contiguous key range (a view, no copy) or the indices of the visible keys."""
    mask: np.ndarray | None
    """``[queries, keys]`` visibility, or None when every pair in the tile is visible."""
    additive: dict = field(default_factory=dict)
    """The mask as the flash kernel takes it, per (dtype, device, GQA group), built once."""
    merge: bool = False
    """A hub: its queries already have a block result, which this call's is merged into by
    log-sum-exp (and its dq added to), instead of written."""


@dataclass
class RowPlan:
    tasks: list[_BlockTask]
    """Query blocks, which partition the row's queries."""
    hubs: list[_BlockTask]
    """Chains of tokens with one common ``kv_end``, attended by all their later descendants at once
    (``keys`` the chain, ``query`` those descendants, no mask), run after the blocks."""
    visible_pairs: int
    """(query, key) pairs the tree mask lets through: what any exact engine must compute."""

    def computed_scores(self) -> int:
        """Scores the plan computes: each task's queries x its keys, masked-out pairs included."""
        return sum(_pairs(task) for task in (*self.tasks, *self.hubs))


_PLANS: OrderedDict[bytes, RowPlan] = OrderedDict()
_PLAN_CACHE_SIZE = 16


def find_hubs(
    kv_end: np.ndarray,
    block: int,
    min_keys: int,
    min_queries: int,
    positions: np.ndarray | None = None,
    window: int | None = None,
) -> list[_BlockTask]:
    """Runs ``[a, b)`` of equal ``kv_end = E`` with at least ``min_keys`` tokens and at least
    ``min_queries`` queries in ``[ceil(b / block) * block, E)``: those queries all see the run
    (with a window, only runs whose first key is within it of every such query qualify)."""
    n = kv_end.size
    starts = np.flatnonzero(np.diff(kv_end, prepend=-1) != 0)
    ends = np.append(starts[1:], n)
    hubs = []
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        end = int(kv_end[a])
        first = -(-b // block) * block  # whole query blocks only: queries before it see the run causally
        if b - a < min_keys or end - first < min_queries:
            continue
        if window is not None and positions[first:end].max() - positions[a:b].min() >= window:
            continue
        hubs.append(_BlockTask(query=slice(first, end), keys=slice(a, b), mask=None, merge=True))
    return hubs


def block_plan(
    kv_end: np.ndarray,
    block: int,
    hub_min_keys: int = HUB_MIN_KEYS,
    hub_min_queries: int = HUB_MIN_QUERIES,
    positions: np.ndarray | None = None,
    window: int | None = None,
) -> RowPlan:
    """Hubs, then the visible keys and masks of every query block for one row's ``kv_end``.

    The keys gathered for a query block are exactly those visible to at least one of its queries
    (``k < q1`` and ``kv_end[k] > q0``), at token granularity, less the keys of hubs whose query
    range holds the block: ancestors' siblings that merely share a block with an ancestor are
    left out (about 30% fewer computed scores than gathering whole key blocks, on agentic trees
    with 128-token blocks). With a ``window`` (and the tokens' ``positions``) the masks also hold
    ``positions[q] - positions[k] < window`` and keys outside every query's window are left out.
    """
    n = kv_end.size
    index = np.arange(n)
    hubs = find_hubs(kv_end, block, hub_min_keys, hub_min_queries, positions, window)
    tasks = []
    for q0 in range(0, n, block):
        q1 = min(n, q0 + block)
        visible = kv_end[:q1] > q0
        for hub in hubs:
            if hub.query.start <= q0 < hub.query.stop:
                visible[hub.keys] = False  # the hub's call covers every query of this block that sees them
        keys = np.flatnonzero(visible)  # never empty: q0 sees itself, and q0 >= any hub's run end
        queries = index[q0:q1]
        mask = (keys[None, :] <= queries[:, None]) & (queries[:, None] < kv_end[keys][None, :])
        if window is not None:
            mask &= positions[q0:q1, None] - positions[keys][None, :] < window
            seen = mask.any(axis=0)  # never empty: every query sees itself
            keys, mask = keys[seen], mask[:, seen]
        contiguous = keys[-1] - keys[0] + 1 == keys.size
        tasks.append(
            _BlockTask(
                query=slice(q0, q1),
                keys=slice(int(keys[0]), int(keys[-1]) + 1) if contiguous else keys,
                mask=None if mask.all() else mask,
            )
        )
    if window is None:
        visible_pairs = int((kv_end - index).sum())
    else:  # the tasks' masks and the (unmasked) hubs partition the visible pairs
        visible_pairs = sum(int(task.mask.sum()) if task.mask is not None else _pairs(task) for task in tasks)
        visible_pairs += sum(_pairs(hub) for hub in hubs)
    return RowPlan(tasks=tasks, hubs=hubs, visible_pairs=visible_pairs)


def _pairs(task: _BlockTask) -> int:
    keys = task.keys.stop - task.keys.start if isinstance(task.keys, slice) else task.keys.size
    return (task.query.stop - task.query.start) * keys


def _cached_plan(
    kv_end: torch.Tensor,
    block: int,
    hub_min_keys: int,
    hub_min_queries: int,
    positions: torch.Tensor | None,
    window: int | None,
) -> RowPlan:
    values = kv_end.detach().to("cpu", torch.int64).numpy()
    settings = [block, hub_min_keys, hub_min_queries, -1 if window is None else window]
    cache_key = values.tobytes() + np.array(settings, dtype=np.int64).tobytes()
    if window is not None:
        positions = positions.detach().to("cpu", torch.int64).numpy()
        cache_key += positions.tobytes()
    plan = _PLANS.get(cache_key)
    if plan is None:
        plan = block_plan(values, block, hub_min_keys, hub_min_queries, positions, window)
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


def _tile_forward(query, key, value, mask, scale, softcap):
    """One tile's output and natural log-sum-exp: the flash kernel, or the capped softmax by hand."""
    if softcap is None:
        return _flash_forward(query, key, value, 0.0, False, attn_mask=mask, scale=scale)
    scores = soft_cap(torch.matmul(query, key.transpose(-1, -2)) * scale, softcap)
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value), lse.to(_lse_dtype(query))


def _tile_backward(grad_out, query, key, value, out, lse, mask, scale, softcap):
    """dq, dk, dv of one tile given the row's final output and log-sum-exp (FlashAttention-2 style)."""
    if softcap is None:
        return _flash_backward(grad_out, query, key, value, out, lse, 0.0, False, attn_mask=mask, scale=scale)
    capped = torch.tanh(torch.matmul(query, key.transpose(-1, -2)) * (scale / softcap))
    scores = capped * softcap
    if mask is not None:
        scores = scores + mask
    probs = torch.exp(scores - lse.to(query.dtype).unsqueeze(-1))
    delta = (grad_out * out).sum(-1, keepdim=True)
    # d(cap * tanh(s / cap)) / ds = 1 - tanh^2, and s = scale * q . k
    grad_scores = probs * (torch.matmul(grad_out, value.transpose(-1, -2)) - delta) * (1 - capped * capped) * scale
    return (
        torch.matmul(grad_scores, key),
        torch.matmul(grad_scores.transpose(-1, -2), query),
        torch.matmul(probs.transpose(-1, -2), grad_out),
    )


def _lse_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


class _BlockSparseAttention(torch.autograd.Function):
    """One row of tree attention on PyTorch's CPU flash kernels, saving only q, k, v, out and lse.

    Letting autograd trace the per-block calls would keep every gathered k/v tile and mask alive
    until backward (more memory per token than the flat layout, whose tiles are views). Here the
    backward regathers each tile and calls the flash backward per block instead.
    """

    @staticmethod
    def forward(ctx, query, key, value, plan, scale, softcap):
        heads_q, heads_kv = query.shape[1], key.shape[1]
        group = heads_q // heads_kv
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:3], dtype=_lse_dtype(query))
        for task in (*plan.tasks, *plan.hubs):
            block_out, block_lse = _tile_forward(
                _grouped(query, heads_kv, task.query),
                _tile(key, task.keys),
                _tile(value, task.keys),
                _additive_mask(task, group, query),
                scale,
                softcap,
            )
            block_out, block_lse = _ungrouped(block_out, heads_q), block_lse.reshape(1, heads_q, -1)
            if not task.merge:
                out[:, :, task.query] = block_out
                lse[:, :, task.query] = block_lse
                continue
            # softmax over the union of two disjoint key sets: rescale both partial outputs
            old_lse = lse[:, :, task.query]
            new_lse = torch.logaddexp(old_lse, block_lse)
            block_out.mul_(torch.exp(block_lse - new_lse).unsqueeze(-1))
            out[:, :, task.query].mul_(torch.exp(old_lse - new_lse).unsqueeze(-1)).add_(block_out)
            old_lse.copy_(new_lse)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale, ctx.softcap = plan, scale, softcap
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
        # A hub's flash backward with the merged output and log-sum-exp yields exactly its keys'
        # share of every gradient.
        for task in (*ctx.plan.tasks, *ctx.plan.hubs):
            block_lse = lse[:, :, task.query].reshape(1, heads_kv, -1)
            d_query, d_key, d_value = _tile_backward(
                _grouped(grad_out, heads_kv, task.query),
                _grouped(query, heads_kv, task.query),
                _tile(key, task.keys),
                _tile(value, task.keys),
                _grouped(out, heads_kv, task.query),
                block_lse,
                _additive_mask(task, group, query),
                ctx.scale,
                ctx.softcap,
            )
            if task.merge:
                grad_query[:, :, task.query] += _ungrouped(d_query, heads_q)
            else:
                grad_query[:, :, task.query] = _ungrouped(d_query, heads_q)
            if isinstance(task.keys, slice):
                grad_key[:, :, task.keys] += d_key
                grad_value[:, :, task.keys] += d_value
            else:
                index = torch.as_tensor(task.keys, device=key.device)
                grad_key.index_add_(2, index, d_key)
                grad_value.index_add_(2, index, d_value)
        return grad_query, grad_key, grad_value, None, None, None


def blocksparse_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    scale: float | None = None,
    block: int = DEFAULT_BLOCK,
    hub_min_keys: int = HUB_MIN_KEYS,
    hub_min_queries: int = HUB_MIN_QUERIES,
    *,
    positions: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Tree attention, ``[B, Hq, N, D]`` x ``[B, Hkv, N, D]`` -> ``[B, N, Hq, D]``; ``positions``,
    ``window`` and ``softcap`` as in the reference."""
    batch, _, _, head_dim = query.shape
    gqa_group(query, key)  # Hq a multiple of Hkv
    if window is not None:
        check_window(positions, window, kv_end.shape)
    if scale is None:
        scale = head_dim**-0.5
    rows = []
    for b in range(batch):
        row_positions = None if window is None else positions[b]
        plan = _cached_plan(kv_end[b], block, hub_min_keys, hub_min_queries, row_positions, window)
        row = slice(b, b + 1)
        rows.append(_BlockSparseAttention.apply(query[row], key[row], value[row], plan, scale, softcap))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous()
