"""Dense reference implementation of tree attention: the oracle for every other engine.

The whole tree mask is described by one integer per key: query ``q`` may attend key ``k``
iff ``k <= q < kv_end[k]`` (docs/DESIGN.md section 2). A sliding window ``w`` (Mistral, Qwen2's
sliding layers, Gemma2/3's local layers) also needs the tokens' depths, the packed row's
``position_ids``: ``k`` must then be within ``w`` tokens of ``q`` along their root path,
``positions[q] - positions[k] < w``, which on a plain sequence is transformers' own rule
(``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - w``). Soft-capping (Gemma2's
``attn_logit_softcapping``) maps the scaled scores ``s`` to ``cap * tanh(s / cap)`` before the mask.
This module materialises the mask densely, works in any dtype (float64 included) and repeats
k/v heads for GQA, so it is only meant for tests, verification and small inputs.
"""

from __future__ import annotations

import torch


def visibility_mask(
    kv_end: torch.Tensor, positions: torch.Tensor | None = None, window: int | None = None
) -> torch.Tensor:
    """Boolean mask ``[B, N(query), N(key)]`` from ``kv_end`` ``[B, N]`` (and ``positions`` ``[B, N]``
    with a ``window``)."""
    n = kv_end.shape[-1]
    index = torch.arange(n, device=kv_end.device)
    causal = index[None, :] <= index[:, None]  # [q, k]: k <= q
    inside = index[None, :, None] < kv_end[:, None, :]  # [b, q, k]: q < kv_end[k]
    mask = causal[None] & inside
    if window is not None:
        check_window(positions, window, kv_end.shape)
        mask &= positions[:, :, None] - positions[:, None, :] < window  # [b, q, k]
    return mask


def check_window(positions: torch.Tensor | None, window: int, shape: torch.Size) -> None:
    """A window needs ``positions`` shaped like ``kv_end`` and is at least one token (the query itself)."""
    if window < 1:
        raise ValueError(f"sliding window must be at least 1 token, got {window}")
    if positions is None or tuple(positions.shape) != tuple(shape):
        got = None if positions is None else tuple(positions.shape)
        raise ValueError(f"a sliding window needs the token depths (position_ids) shaped {tuple(shape)}, got {got}")


def gqa_group(query: torch.Tensor, key: torch.Tensor) -> int:
    """Query heads per key/value head (GQA) of query ``[B, Hq, N, D]`` and key ``[B, Hkv, N, D]``; a
    ValueError unless ``Hq`` is a multiple of ``Hkv``."""
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    return heads_q // heads_kv


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)``, Gemma2's attention-logit soft-capping; identity for None."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def tree_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    scale: float | None = None,
    *,
    positions: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Tree attention with a dense mask.

    query ``[B, Hq, N, D]``, key/value ``[B, Hkv, N, D]`` with ``Hq % Hkv == 0``, ``kv_end``
    ``[B, N]`` integer; ``positions`` ``[B, N]`` (the depths) when ``window`` is given, which
    limits each query to keys less than ``window`` deeper-up its path; ``softcap`` caps the
    scaled scores. Returns ``[B, N, Hq, D]`` in the input dtype.
    """
    _, _, _, head_dim = query.shape
    group = gqa_group(query, key)
    if scale is None:
        scale = head_dim**-0.5
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = soft_cap(torch.matmul(query, key.transpose(-1, -2)) * scale, softcap)
    mask = visibility_mask(kv_end, positions, window)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()
