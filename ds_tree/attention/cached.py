"""Attention of one chunk of tokens on its ancestors' cached keys and values (the dfs mode).

The dfs mode (docs/DESIGN.md section 5, :mod:`ds_tree.engine.dfs`) forwards a tree one chunk at a
time: a chunk is a run of consecutive tokens of one node (a whole node when it is short enough),
and its context is the tokens of its ancestor chunks, root first. Its queries see every ancestor
key and, causally, the chunk's own keys; nothing else exists in the forward, so no tree mask is
needed.

A :class:`PathCache` travels as the model kwarg ``path_cache``: it holds, per decoder layer, the
(post-RoPE, per key/value head) keys and values of the ancestor chunks — leaf tensors that require
grad, so the chunk's backward accumulates their gradients — and records the chunk's own keys and
values, still attached to its graph, for the walk to turn into its children's context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

IMPLEMENTATION = "tree_dfs"
"""The ``attn_implementation`` under which :func:`cached_attention` is registered."""

LayerKV = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""Decoder layer index -> ``(key, value)``, each ``[batch, kv_heads, tokens, head_dim]``."""


@dataclass
class PathCache:
    """The ancestors' keys and values of the chunk being forwarded, and what its forward records."""

    ancestors: list[LayerKV] = field(default_factory=list)
    """One entry per ancestor chunk, root first."""
    recorded: LayerKV = field(default_factory=dict)
    """The keys and values of the last forward, per layer (attached to its graph when it had one)."""

    def context(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys = [entry[layer][0] for entry in self.ancestors]
        values = [entry[layer][1] for entry in self.ancestors]
        return keys, values

    def take_recorded(self) -> LayerKV:
        recorded, self.recorded = self.recorded, {}
        return recorded

    def nbytes(self) -> int:
        """Bytes of the cached ancestor keys and values."""
        return sum(t.nbytes for entry in self.ancestors for pair in entry.values() for t in pair)


def cached_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention: ``query [B, Hq, n, D]``, ``key``/``value [B, Hkv, n, D]`` -> ``[B, n, Hq, D]``."""
    cache = kwargs.get("path_cache")
    if not isinstance(cache, PathCache):
        raise ValueError(
            f"attention {IMPLEMENTATION!r} needs a PathCache as the model kwarg `path_cache` "
            "(it runs inside ds_tree.engine.dfs only)"
        )
    if dropout:
        raise ValueError("tree attention does not implement attention dropout; set attention_dropout=0")
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"tree attention does not support {unsupported} (layer {module.__class__.__name__})")
    layer = module.layer_idx
    cache.recorded[layer] = (key, value)
    past_keys, past_values = cache.context(layer)
    keys = torch.cat([*past_keys, key], dim=2) if past_keys else key
    values = torch.cat([*past_values, value], dim=2) if past_values else value
    n, context = query.shape[2], keys.shape[2] - key.shape[2]
    own = torch.arange(n, device=query.device)
    visible = torch.cat(
        [torch.ones(n, context, dtype=torch.bool, device=query.device), own[None, :] <= own[:, None]], dim=1
    )
    output = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=visible, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return output.transpose(1, 2).contiguous(), None


def register_cached_attention() -> None:
    """Register :func:`cached_attention` with transformers as ``tree_dfs`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, cached_attention)
