"""Hybrid models on trees: Gated DeltaNet (Qwen3.5) and Mamba2 (Bamba) mixers run per tree node.

Run along a packed row, a recurrent mixer carries one branch's state into its siblings (and one
tree's into the next). Run over the tree it is exact: each node starts from its **parent's final
recurrent state**, and its causal convolution sees the **last K-1 inputs along its root path**
(:mod:`ds_tree.models.tree_nodes`, docs/MODELS.md "Hybrid models")::

    row:    [ prompt P ][ answer A ][ answer B ]        kv_end says A and B both follow P
    scan:   level 0: P from a zero state                 -> final state S_P
            level 1: A and B batched, both from S_P      (right-padded with g = 0, beta = 0 / dt = 0)
    conv:   A and B each see P's last K-1 inputs as their window (a node shorter than K-1 tokens
            passes its own and its ancestors' inputs on to its children)

The layers are the models' own modules with ``forward`` replaced per instance (:func:`install_tree_mixers`):
the projections, ``conv1d``, norms and ``out_proj`` are called as modules (so ZeRO-3's hooks gather
their parameters), and the scans are :mod:`ds_tree.models.linear_scans` (transformers' chunked
fallbacks, with a state per sequence, computing in float64 for float64 models). The tree comes from
the ``kv_end`` model input that the tree attention receives too; without it (a plain sequence, a
cached decode) the stock forward runs. Gradients reach a shared parent state from every child
through autograd.

Supported mixers (:data:`TREE_MIXERS`): ``Qwen3_5GatedDeltaNet`` and ``Qwen3_5MoeGatedDeltaNet``
(``qwen3_5_text``, ``qwen3_5_moe_text``), ``BambaMixer`` (``bamba``). Other hybrids (Qwen3-Next,
Falcon-H1, Nemotron-H, Jamba, Mamba) stay refused by :func:`ds_tree.models.token_mixing.check_layer_types`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ds_tree.models.linear_scans import chunk_gated_delta_rule, chunk_mamba2, compute_dtype
from ds_tree.models.tree_nodes import TreeNodes, tree_nodes

GATED_DELTA_CHUNK = 64
"""The chunk of transformers' ``torch_chunk_gated_delta_rule`` (its default, what the stock layer uses)."""

HYBRID_MODEL_TYPES = {"qwen3_5_text": "Gated DeltaNet", "qwen3_5_moe_text": "Gated DeltaNet", "bamba": "Mamba2"}
"""``model_type`` -> its recurrent mixer, for the model types whose ``linear_attention`` layers run on trees."""

RECURRENT_LAYER_TYPES = ("linear_attention",)
"""The ``layer_types`` entries that name these mixers."""


def is_hybrid(config) -> bool:
    """Whether ``config`` is a hybrid model whose recurrent layers run on trees here."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None) in HYBRID_MODEL_TYPES and any(
        kind in RECURRENT_LAYER_TYPES for kind in (getattr(text, "layer_types", None) or [])
    )


# ----------------------------------------------------------------------------------- shared steps
def tree_conv(conv: torch.nn.Conv1d, inputs: torch.Tensor, nodes: TreeNodes, activation: str) -> torch.Tensor:
    """Depthwise causal convolution of ``inputs`` ``[1, N, C]`` along root paths, then ``activation``.

    The row is laid out with every node preceded by its K-1 path-history inputs (zeros where the
    path is shorter), and ``conv`` (``padding = K-1``, the models' own module) runs once over it:
    each node's window then holds exactly its path. Returns ``[1, N, C]`` in ``inputs``' dtype.
    """
    width = conv.kernel_size[0] - 1
    gather, place = nodes.conv_layout(width, inputs.device)
    padded = torch.cat([inputs.new_zeros(1, 1, inputs.shape[-1]), inputs], dim=1)
    laid_out = padded[:, gather + 1].transpose(1, 2)
    out = conv(laid_out.to(conv.weight.dtype))[:, :, : laid_out.shape[-1]][:, :, place]
    return ACT2FN[activation](out).transpose(1, 2).to(inputs.dtype)


def scan_levels(
    nodes: TreeNodes,
    chunk: int,
    inputs: list[torch.Tensor],
    scan: Callable[[list[torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Run ``scan`` over the tree, one call per group of a level (:meth:`TreeNodes.levels`).

    ``inputs``: per-token tensors ``[N, ...]``; each call gets them gathered to ``[n, length, ...]``
    (zeros past a node's end) and the nodes' initial states (the parents' final states; None for
    the roots' level: zeros), and returns outputs ``[n, length, ...]`` and final states. The
    outputs are put back in row order, ``[N, ...]``.
    """
    zero_rows = [torch.cat([x.new_zeros(1, *x.shape[1:]), x]) for x in inputs]
    pieces, order = [], []
    previous: torch.Tensor | None = None
    for groups in nodes.levels(chunk):
        finals = []
        for group in groups:
            index = torch.as_tensor(group.tokens + 1, device=inputs[0].device)
            gathered = [x[index] for x in zero_rows]
            # Level 0 holds the roots (zero states); every deeper node has its parent one level up.
            initial = None if previous is None else previous[torch.as_tensor(group.parent_slot, device=previous.device)]
            output, final = scan(gathered, initial)
            valid = group.tokens >= 0
            pieces.append(output[torch.as_tensor(valid, device=output.device)])
            order.append(group.tokens[valid])
            finals.append(final)
        previous = torch.cat(finals)
    inverse = np.empty(nodes.n_tokens, dtype=np.int64)
    inverse[np.concatenate(order)] = np.arange(nodes.n_tokens)
    return torch.cat(pieces)[torch.as_tensor(inverse, device=pieces[0].device)]


def _tree_inputs(hidden_states: torch.Tensor, kwargs: dict, cache) -> TreeNodes | None:
    """The row's nodes; None for a plain sequence (no ``kv_end``: the stock forward is right)."""
    if "path_cache" in kwargs:
        raise ValueError(
            "dfs mode (packing.mode: dfs, verify --dfs-chunk) walks a tree in chunks, and a recurrent layer "
            "would start each chunk from a zero state: not supported for hybrid models (use tree mode)"
        )
    kv_end = kwargs.get("kv_end")
    if kv_end is None:
        return None
    if cache is not None:
        raise ValueError("a recurrent layer on a packed tree runs without a cache (use_cache=False)")
    if hidden_states.shape[:2] != kv_end.shape:
        raise ValueError(
            f"a recurrent layer got {tuple(hidden_states.shape[:2])} tokens and kv_end {tuple(kv_end.shape)}: "
            "it runs on whole packed rows (sequence-parallel shards are not supported for hybrid models)"
        )
    return tree_nodes(kv_end)


# ------------------------------------------------------------------------------- Gated DeltaNet
def gated_delta_net_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward`` over the tree of ``kwargs['kv_end']`` (module docstring)."""
    nodes = _tree_inputs(hidden_states, kwargs, cache)
    if nodes is None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    batch, length, _ = hidden_states.shape
    mixed = tree_conv(self.conv1d, self.in_proj_qkv(hidden_states), nodes, self.activation)
    query, key, value = torch.split(mixed[0], [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(length, -1, self.head_k_dim)
    key = key.reshape(length, -1, self.head_k_dim)
    value = value.reshape(length, -1, self.head_v_dim)
    z = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)
    beta = self.in_proj_b(hidden_states)[0].sigmoid()
    # The stock layer takes A_log and a in float32 (".float()", against -inf in fp16): at least float32.
    dtype = compute_dtype(hidden_states.dtype)
    g = -self.A_log.to(dtype).exp() * F.softplus(self.in_proj_a(hidden_states)[0].to(dtype) + self.dt_bias)

    def scan(gathered, initial):
        return chunk_gated_delta_rule(*gathered, initial, chunk=GATED_DELTA_CHUNK, l2_norm_qk=True)

    core = scan_levels(nodes, GATED_DELTA_CHUNK, [query, key, value, g, beta], scan)
    core = self.norm(core.reshape(-1, self.head_v_dim), z)
    return self.out_proj(core.reshape(batch, length, -1))


# ------------------------------------------------------------------------------------------ Mamba2
def mamba2_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """``BambaMixer.forward`` (its torch path) over the tree of ``kwargs['kv_end']`` (module docstring)."""
    nodes = _tree_inputs(hidden_states, kwargs, cache)
    if nodes is None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    batch, length, _ = hidden_states.shape
    dtype = hidden_states.dtype
    projected = self.in_proj(hidden_states)
    gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    xbc = tree_conv(self.conv1d, xbc, nodes, self.activation)[0]
    x, B, C = torch.split(
        xbc, [self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size], dim=-1
    )
    work = compute_dtype(dtype)
    A = -torch.exp(self.A_log.to(work))
    # dt discretised before the scan (the stock scan does it inside): padding must have dt = 0 exactly.
    dt = F.softplus(dt[0].to(work) + self.dt_bias.to(work)).clamp(*self.time_step_limit)
    x = x.reshape(length, self.num_heads, self.head_dim)
    B = B.reshape(length, self.n_groups, self.ssm_state_size)
    C = C.reshape(length, self.n_groups, self.ssm_state_size)

    def scan(gathered, initial):
        return chunk_mamba2(gathered[0], gathered[1], A, gathered[2], gathered[3], self.D, initial, self.chunk_size)

    y = scan_levels(nodes, self.chunk_size, [x, dt, B, C], scan)
    y = self.norm(y.reshape(batch, length, -1), gate)
    return self.out_proj(y.to(dtype))


TREE_MIXERS: dict[str, Callable] = {
    "Qwen3_5GatedDeltaNet": gated_delta_net_forward,
    "Qwen3_5MoeGatedDeltaNet": gated_delta_net_forward,
    "BambaMixer": mamba2_forward,
}
"""Mixer class name -> its tree forward."""


# ------------------------------------------------------------------------- float64 gated norms
def _gated_norm_norm_first_float64(self, hidden_states, gate):
    """Qwen3.5's gated RMSNorm (normalise, scale, then ``* silu(gate)``) without its float32 casts."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
    return hidden_states * ACT2FN[self.activation](gate)


def _gated_norm_gate_first_float64(self, hidden_states, gate=None):
    """Bamba's grouped gated RMSNorm (``* silu(gate)`` first, then per group) without its float32 casts."""
    if gate is not None:
        hidden_states = hidden_states * F.silu(gate)
    *prefix, last = hidden_states.shape
    grouped = hidden_states.view(*prefix, last // self.group_size, self.group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * grouped.view(*prefix, last)


FLOAT64_GATED_NORMS = {
    "Qwen3_5RMSNormGated": _gated_norm_norm_first_float64,
    "Qwen3_5MoeRMSNormGated": _gated_norm_norm_first_float64,
    "BambaRMSNormGated": _gated_norm_gate_first_float64,
}


def install_tree_mixers(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace the ``forward`` of every supported recurrent mixer of ``model`` by its tree forward;
    for a float64 model (``dtype``) also lift the gated norms' float32 casts (the stock norms round
    every mixer output to float32: float64 verification could not see float64 round-off). Returns
    how many mixers."""
    installed = 0
    float64 = dtype == torch.float64
    for module in model.modules():
        name = type(module).__name__
        if name in TREE_MIXERS:
            module.forward = TREE_MIXERS[name].__get__(module)
            installed += 1
        elif float64 and name in FLOAT64_GATED_NORMS:
            module.forward = FLOAT64_GATED_NORMS[name].__get__(module)
    return installed
