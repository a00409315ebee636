"""Forking a hybrid model's generation cache at branch points (the tree sampler, :mod:`ds_tree.sampling.hf`).

A hybrid's :class:`transformers.DynamicCache` holds, per layer, either an attention layer's keys and
values (``DynamicLayer``) or a recurrent layer's state (``LinearAttentionLayer``: the causal conv's
last K inputs ``[B, C, K]`` and the recurrent state, ``[B, H, Dk, Dv]`` for Gated DeltaNet, ``[B, H,
P, N]`` for Mamba2). The sampler keeps one entry per layer and branch and forks by sharing it:

- attention: ``(keys, values)`` of every token on the path, grown by each decode step;
- recurrent: ``(conv_state, recurrent_state)`` after the path's last fed token: a fixed size, which
  *replaces* the entry at each step. A fork is exactly a copy of both (the children continue from the
  parent's state and conv window, as in training: docs/MODELS.md, "Hybrid models").

- both (Falcon-H1: a Mamba2 mixer and attention side by side in every layer, one
  ``LinearAttentionAndFullAttentionLayer``): ``(keys, values, conv_state, recurrent_state)``, the
  keys/values grown, the states replaced, each part as above;
- none (an MLP-only layer: Nemotron-H's ``DummyLayer``).

A hybrid family lists its cache layers in its spec (``recurrent.cache_layers``,
:mod:`ds_tree.models.families`): the sampler forks those.

All are batched by concatenating branches along the batch dimension into a fresh cache
(:func:`stacked_cache`): the model updates that cache in place (``causal_conv1d_update``,
``copy_`` of the new state), never a branch's own tensors. What a recurrent entry cannot do is be
cropped back to an earlier token (its state is the path's last): the sampler re-encodes the path
to re-branch (:func:`has_recurrent_layers`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    LinearAttentionLayer,
)

LayerEntry = tuple[torch.Tensor, ...]
"""One layer of one branch (module docstring), batch dimension 1."""


def is_recurrent(layer) -> bool:
    return isinstance(layer, LinearAttentionLayer)


def has_recurrent_layers(config) -> bool:
    """Whether a generation cache for ``config`` holds recurrent layers."""
    return any(is_recurrent(layer) for layer in DynamicCache(config=config).layers)


def has_keys(layer) -> bool:
    """Whether a cache layer holds attention keys/values (a recurrent state may sit beside them)."""
    return isinstance(layer, DynamicLayer)


def layer_row(layer, row: int) -> LayerEntry:
    """Row ``row`` of a batched cache layer, as views: keys and values, then the conv and recurrent states."""
    if isinstance(layer, DummyLayer):
        return None, None
    entry = (layer.keys[row : row + 1], layer.values[row : row + 1]) if has_keys(layer) else ()
    if is_recurrent(layer):
        if not (layer.is_conv_states_initialized[0] and layer.is_recurrent_states_initialized[0]):
            raise RuntimeError("a recurrent cache layer was read before the model filled it")
        entry += (layer.conv_states[0][row : row + 1], layer.recurrent_states[0][row : row + 1])
    return entry


def stacked_cache(config, entries: list[list[LayerEntry]]) -> DynamicCache:
    """A fresh cache for ``config`` holding branch ``b``'s ``entries[b]`` (one per layer) as batch row ``b``."""
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer):
            continue
        parts = [torch.cat([entry[index][part] for entry in entries]) for part in range(len(entries[0][index]))]
        if has_keys(layer):
            DynamicLayer.update(layer, parts[0], parts[1])  # the attention part (a combined layer: not its states)
            parts = parts[2:]
        if not is_recurrent(layer):
            continue
        conv, recurrent = parts
        # What LinearAttentionLayer.lazy_initialization and a prefill's updates leave behind, with these states.
        layer.dtype, layer.device = conv.dtype, conv.device
        layer.conv_kernel_size[0] = conv.shape[-1]
        layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True
    return cache
