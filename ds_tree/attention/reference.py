"""Dense reference implementation of tree attention: the oracle for every other engine.

The whole tree mask is described by one integer per key: query ``q`` may attend key ``k``
iff ``k <= q < kv_end[k]`` (docs/DESIGN.md section 2). This module materialises that mask densely,
works in any dtype (float64 included) and repeats k/v heads for GQA, so it is only meant for
tests, verification and small inputs.
"""

from __future__ import annotations

import torch


def visibility_mask(kv_end: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``[B, N(query), N(key)]`` from ``kv_end`` ``[B, N]``."""
    n = kv_end.shape[-1]
    index = torch.arange(n, device=kv_end.device)
    causal = index[None, :] <= index[:, None]  # [q, k]: k <= q
    inside = index[None, :, None] < kv_end[:, None, :]  # [b, q, k]: q < kv_end[k]
    return causal[None] & inside


def tree_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Tree attention with a dense mask.

    query ``[B, Hq, N, D]``, key/value ``[B, Hkv, N, D]`` with ``Hq % Hkv == 0``, ``kv_end``
    ``[B, N]`` integer. Returns ``[B, N, Hq, D]`` in the input dtype.
    """
    batch, heads_q, n, head_dim = query.shape
    heads_kv = key.shape[1]
    if heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    if scale is None:
        scale = head_dim**-0.5
    group = heads_q // heads_kv
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    mask = visibility_mask(kv_end)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()
