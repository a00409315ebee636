"""Attention of one chunk of tokens on its ancestors' cached keys and values (the dfs mode).

The dfs mode (docs/DESIGN.md section 5, :mod:`ds_tree.engine.dfs`) forwards a tree one chunk at a
time (:mod:`ds_tree.packing.dfs_chunks`): a chunk is a piece of a node chain, or whole subtrees
below one token, and its context is the path to that token: the tokens of its ancestor chunks, root
first. Its queries see every ancestor key and the chunk's own keys causally, or, for subtrees, by
the chunk's own ``kv_end`` (the model kwarg, in the chunk's indices) as in a packed row.

A sliding window (Mistral, Qwen2/3 sliding layers, Gemma2/3 local layers) limits query ``q`` to keys
with ``positions[q] - positions[k] < window`` (reference module). The context is the path from the
root, so its keys sit at depths ``0 .. context - 1`` and the chunk's own tokens continue it: that is
checked on the chunk's ``position_ids``. Ancestor keys below ``context - window + 1`` are seen by no
query of the chunk, so they are not gathered (no gradient reaches them from this chunk, as none would
through a masked score). Soft-capping (Gemma2's ``attn_logit_softcapping``) needs the scores
explicitly; without window and cap the attention is one SDPA call on the whole context.

A :class:`PathCache` travels as the model kwarg ``path_cache``: it holds, per decoder layer, the
(post-RoPE, per key/value head) keys and values of the ancestor chunks — leaf tensors that require
grad, so the chunk's backward accumulates their gradients — and records the chunk's own keys and
values, still attached to its graph, for the walk to turn into its children's context.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ds_tree.attention.reference import check_window, soft_cap

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
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)
    """The attention masks of the current forward, made once and shared by its layers: SDPA saves its
    mask for the backward, so one per layer would hold ``layers`` copies of a ``chunk x context`` mask."""
    recording: bool = True
    """False during a backward whose checkpointed layers recompute their forward (:meth:`replaying`):
    their keys and values are not the chunk's to record (kept, each would hold its layer's recomputed
    graph up to the layer's input until the next forward), nor are their masks shared."""

    def context(self, layer: int, first: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The ancestors' keys and values of ``layer`` from context token ``first`` on, root first."""
        keys, values = [], []
        offset = 0
        for entry in self.ancestors:
            key, value = entry[layer]
            length = key.shape[2]
            if offset + length > first:
                skip = max(first - offset, 0)
                keys.append(key[:, :, skip:] if skip else key)
                values.append(value[:, :, skip:] if skip else value)
            offset += length
        return keys, values

    def context_length(self, layer: int) -> int:
        return sum(entry[layer][0].shape[2] for entry in self.ancestors)

    def take_recorded(self) -> LayerKV:
        """What the forward recorded; its masks are forgotten (the next forward's chunk differs)."""
        recorded, self.recorded = self.recorded, {}
        self.masks = {}
        return recorded

    @contextmanager
    def replaying(self):
        """Around a backward call: recomputed layers attend on this cache but record nothing."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def mask(
        self,
        n: int,
        context: int,
        window: int | None,
        additive_dtype: torch.dtype | None,
        device,
        kv_end: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
    ):
        """Which of the ``context`` gathered ancestor keys and the chunk's ``n`` own keys each query of the
        chunk sees (``[n, context + n]``): boolean, or as SDPA's additive mask (0 or -inf) of
        ``additive_dtype``; made once per forward for each distinct argument tuple. The own keys are
        seen causally, or with ``kv_end`` (``[n]``, the chunk's own indices) as in a packed row; a
        ``window`` needs the own tokens' ``depths`` (``[n]``; the gathered keys are at the depths
        right below the chunk's first token's)."""
        key = (n, context, window, additive_dtype, str(device))
        if key in self.masks and self.recording:
            return self.masks[key]
        if window is None and kv_end is None and additive_dtype is not None:  # in place: no second chunk x context
            mask = torch.zeros(n, context + n, dtype=additive_dtype, device=device)
            mask[:, context:] = torch.full((n, n), float("-inf"), dtype=additive_dtype, device=device).triu_(1)
        else:
            own = torch.arange(n, device=device)
            seen = own[None, :] <= own[:, None]
            if kv_end is not None:
                seen &= own[:, None] < kv_end.reshape(-1)[None, :]
            mask = torch.cat([torch.ones(n, context, dtype=torch.bool, device=device), seen], dim=1)
            if window is not None:
                depths = depths.reshape(-1).to(device)
                first = int(depths[0]) - context  # the gathered keys: the path's last ``context`` tokens
                keys = torch.cat([torch.arange(first, first + context, device=device), depths])
                mask &= depths[:, None] - keys[None, :] < window
            if additive_dtype is not None:  # what SDPA makes of a boolean mask, in every call
                mask = torch.zeros(mask.shape, dtype=additive_dtype, device=device).masked_fill_(~mask, float("-inf"))
        if self.recording:
            self.masks[key] = mask
        return mask

    def nbytes(self) -> int:
        """Bytes of the cached ancestor keys and values."""
        return sum(t.nbytes for entry in self.ancestors for pair in entry.values() for t in pair)


def cached_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention: ``query [B, Hq, n, D]``, ``key``/``value [B, Hkv, n, D]`` -> ``[B, n, Hq, D]``."""
    shards = kwargs.pop("chunk_shards", None)
    if shards is not None:  # this rank's shard of a chunk (ds_tree.engine.dfs_sequence_parallel): Ulysses around this
        return shards.attention(cached_attention, module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    cache = kwargs.get("path_cache")
    if not isinstance(cache, PathCache):
        raise ValueError(
            f"attention {IMPLEMENTATION!r} needs a PathCache as the model kwarg `path_cache` "
            "(it runs inside ds_tree.engine.dfs only)"
        )
    if dropout:
        raise ValueError("tree attention does not implement attention dropout; set attention_dropout=0")
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    layer = module.layer_idx
    if cache.recording:
        cache.recorded[layer] = (key, value)
    n = query.shape[2]
    first = 0  # the first context token any query of the chunk sees
    if window is not None:
        path = cache.context_length(layer)
        _check_positions(module, kwargs.get("position_ids"), path, n, window, kwargs.get("kv_end") is not None)
        first = max(path - window + 1, 0)
    past_keys, past_values = cache.context(layer, first)
    keys = torch.cat([*past_keys, key], dim=2) if past_keys else key
    values = torch.cat([*past_values, value], dim=2) if past_values else value
    context = keys.shape[2] - n
    own = (kwargs.get("kv_end"), kwargs.get("position_ids"))  # a packed chunk's own mask; depths for a window
    if softcap is None:
        visible = cache.mask(n, context, window, query.dtype, query.device, *own)
        output = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=visible, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
    else:
        visible = cache.mask(n, context, window, None, query.device, *own)
        output = _capped_attention(query, keys, values, visible, scaling, softcap)
    return output.transpose(1, 2).contiguous(), None


def _check_positions(
    module, positions: torch.Tensor | None, context: int, n: int, window: int, packed: bool = False
) -> None:
    """The window rule is applied on depths: the chunk's must continue its context (root at depth 0): a
    chain chunk's run on from it, a packed chunk's subtrees each start right below it."""
    name = module.__class__.__name__
    if positions is None:
        raise ValueError(
            f"{name} uses a sliding window ({window}): attention {IMPLEMENTATION!r} needs the chunk's depths, "
            "pass its position_ids to the model's forward"
        )
    check_window(positions.reshape(1, -1), window, torch.Size((1, n)))
    depths = positions.reshape(-1)
    if packed:
        continues = bool(depths[0] == context) and bool((depths >= context).all())
    else:
        continues = bool((depths == torch.arange(context, context + n, device=positions.device)).all())
    if not continues:
        raise ValueError(
            f"{name} uses a sliding window ({window}): the chunk's position_ids must continue its ancestors' "
            f"{context} cached tokens ({context}..{context + n - 1}), got {positions.reshape(-1).tolist()}"
        )


def _capped_attention(query, keys, values, visible, scale, softcap) -> torch.Tensor:
    """Attention with soft-capped scores, computed explicitly (SDPA has no cap): ``[B, Hq, n, D]``."""
    batch, heads, n, head_dim = query.shape
    kv_heads = keys.shape[1]
    if scale is None:
        scale = head_dim**-0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, n, head_dim)
    scores = soft_cap(torch.matmul(grouped, keys[:, :, None].transpose(-1, -2)) * scale, softcap)
    # softmax in float32 at least, as transformers' eager attention (bf16 would lose digits)
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    probabilities = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1, dtype=softmax_dtype)
    probabilities = probabilities.to(values.dtype)
    return torch.matmul(probabilities, values[:, :, None]).reshape(batch, heads, n, head_dim)


def register_cached_attention() -> None:
    """Register :func:`cached_attention` with transformers as ``tree_dfs`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, cached_attention)
