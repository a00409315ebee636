"""Autograd wrapper and public entry point of the Triton tree-attention kernels.

The kernels want contiguous tensors, int32 ``kv_end`` and a power-of-two head dim >= 16; this
layer provides all three. Other head dims (32 is native; 48, 80, 96, ...) are zero-padded: zero
query/key columns add nothing to the scores and zero value columns produce output columns that
are sliced away, so the result and the gradients of the real columns are exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds_tree.attention.reference import check_window, gqa_group
from ds_tree.kernel import kernels
from ds_tree.kernel.tile_lists import resolve_schedule

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The input dtypes the kernels take."""


def _padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _pad(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return F.pad(x, (0, head_dim - x.shape[-1])).contiguous()


class TreeAttentionFunction(torch.autograd.Function):
    """``tree_attention`` forward/backward on the Triton kernels (FlashAttention-2 style)."""

    @staticmethod
    def forward(ctx, query, key, value, kv_end, scale, positions, window, softcap, tile_schedule):
        head_dim = query.shape[-1]
        padded = _padded_head_dim(head_dim)
        query, key, value = (_pad(x, padded) for x in (query, key, value))
        kv_end = kv_end.to(device=query.device, dtype=torch.int32).contiguous()
        if window is not None:
            positions = positions.to(device=query.device, dtype=torch.int32).contiguous()
        out, lse = kernels.forward(query, key, value, kv_end, scale, positions, window, softcap, tile_schedule)
        ctx.save_for_backward(query, key, value, out, lse, kv_end, positions)
        ctx.scale, ctx.window, ctx.softcap, ctx.tile_schedule = scale, window, softcap, tile_schedule
        ctx.head_dim = head_dim
        return out if padded == head_dim else out[..., :head_dim].contiguous()

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, kv_end, positions = ctx.saved_tensors
        grad_out = _pad(grad_out, query.shape[-1])
        grads = kernels.backward(
            grad_out,
            query,
            key,
            value,
            out,
            lse,
            kv_end,
            ctx.scale,
            positions,
            ctx.window,
            ctx.softcap,
            ctx.tile_schedule,
        )
        grad_q, grad_k, grad_v = (g[..., : ctx.head_dim] for g in grads)
        return grad_q, grad_k, grad_v, None, None, None, None, None, None


def triton_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    scale: float | None = None,
    *,
    positions: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    tile_schedule: str | None = None,
) -> torch.Tensor:
    """Tree attention (docs/DESIGN.md section 4 contract) on the Triton kernels.

    query ``[B, Hq, N, D]``, key/value ``[B, Hkv, N, D]`` with ``Hq % Hkv == 0`` (query head
    ``h`` uses kv head ``h // (Hq // Hkv)``), ``kv_end`` ``[B, N]`` integer: query ``q`` sees key
    ``k`` iff ``k <= q < kv_end[k]`` (and, with a ``window``, ``positions[q] - positions[k] <
    window``, ``positions`` ``[B, N]`` the depths). ``softcap`` (Gemma 2's ``attn_logit_softcapping``, > 0)
    maps the scaled scores ``s`` to ``softcap * tanh(s / softcap)`` before the mask. fp32, fp16 or bf16.
    ``tile_schedule``: ``loop`` or ``list`` (``kernels`` module docstring, "Tile schedules"); None reads
    ``$DS_TREE_TRITON_TILES``, else ``tile_lists.DEFAULT_SCHEDULE``.
    Returns ``[B, N, Hq, D]`` in the input dtype; differentiable in query, key and value.
    """
    if not (kernels.INTERPRET or (torch.cuda.is_available() and query.is_cuda)):
        raise RuntimeError(
            "triton_tree_attention needs CUDA tensors on a GPU, or TRITON_INTERPRET=1 set before "
            "triton is first imported (CPU interpreter, for tests); use the torch backend otherwise"
        )
    batch, _, n, head_dim = query.shape
    if key.shape != value.shape or key.shape[0] != batch or key.shape[2:] != (n, head_dim):
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be [B, Hkv, N, D] "
            f"matching query {tuple(query.shape)}"
        )
    gqa_group(query, key)  # Hq a multiple of Hkv
    if kv_end.shape != (batch, n):
        raise ValueError(f"kv_end must be [B, N] = {(batch, n)}, got {tuple(kv_end.shape)}")
    if query.dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {query.dtype}: use float32, float16 or bfloat16")
    if window is not None:
        check_window(positions, window, kv_end.shape)
        window = int(window)
    if softcap is not None:
        softcap = float(softcap)
        if not 0.0 < softcap < float("inf"):  # NaN fails too
            raise ValueError(
                f"attention soft-cap (attn_logit_softcapping) must be a positive finite number, got {softcap}"
            )
    tile_schedule = resolve_schedule(tile_schedule)
    if scale is None:
        scale = head_dim**-0.5
    return TreeAttentionFunction.apply(
        query, key, value, kv_end, float(scale), positions, window, softcap, tile_schedule
    )
