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
their parameters), and the scans are :mod:`ds_tree.scans.linear_scans` (transformers' chunked
fallbacks, with a state per sequence, computing in float64 for float64 models). The tree comes from
the ``kv_end`` model input that the tree attention receives too; without it (a plain sequence, a
cached decode) the stock forward runs. Gradients reach a shared parent state from every child
through autograd.

In the dfs walk (:mod:`ds_tree.engine.dfs`) a chunk's paths continue its parent token's path: its
root nodes start from that token's recurrent state and their conv windows reach into the K-1
inputs before it. A chain chunk records both, per recurrent layer, in the walk's ``PathCache``
next to the attention layers' keys and values (:class:`ChunkContext`); the walk turns them into
leaves that require grad for the chunks below and hands their gradients back through its
surrogate, as it does the keys' and values'.

Under sequence parallelism a mixer gets one shard of a row (or of a dfs chunk) and the whole row's
``kv_end``: it exchanges its shard's projections for the whole row of its heads, runs the same scan over
every node for those heads and returns to shards (:mod:`ds_tree.models.head_parallel`).

The families whose mixers run on trees say so in their spec (``recurrent``: their mixer classes and tree
forwards, :mod:`ds_tree.models.families`): ``Qwen3_5GatedDeltaNet``, ``Qwen3_5MoeGatedDeltaNet`` and
``Qwen3NextGatedDeltaNet`` (``qwen3_5_text``, ``qwen3_5_moe_text``, ``qwen3_next``), ``BambaMixer``,
``NemotronHMamba2Mixer`` and ``FalconH1Mixer`` (``bamba``, ``nemotron_h``, ``falcon_h1``). Other
hybrids (Jamba, granite-4, LFM2, Mamba) stay refused by :func:`ds_tree.models.token_mixing.check_layer_types`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ds_tree.models.families import family_of, family_of_model
from ds_tree.models.head_parallel import (
    HeadShards,
    channels_of,
    head_block,
    shared_block,
    sliced_conv_forward,
)
from ds_tree.models.tree_nodes import TreeNodes, chain_nodes, tree_nodes
from ds_tree.scans import fla_scan, linear_scans
from ds_tree.scans.linear_scans import compute_dtype

GATED_DELTA_CHUNK = 64
"""The chunk of transformers' ``torch_chunk_gated_delta_rule`` (its default, what the stock layer uses)."""

RECURRENT_SCANS = {"torch": linear_scans, "fla": fla_scan}
"""``model.recurrent_kernels`` (resolved; each mixer's ``tree_scans``) -> the module whose
``chunk_gated_delta_rule`` and ``chunk_mamba2`` the mixers call: the torch scans (CPU, float64 oracle) or
flash-linear-attention's Triton kernels (GPU)."""

RECURRENT_LAYER_TYPES = ("linear_attention", "hybrid")
"""The ``layer_types`` entries that name these mixers (``hybrid``: Falcon-H1, a Mamba2 mixer and attention
side by side in every layer)."""


def is_hybrid(config) -> bool:
    """Whether ``config`` is a hybrid model whose recurrent layers run on trees here (its family has
    recurrent layers, and its ``layer_types`` list some)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return family_of(config).recurrent is not None and any(
        kind in RECURRENT_LAYER_TYPES for kind in (getattr(text, "layer_types", None) or [])
    )


# ----------------------------------------------------------------------------------- shared steps
def tree_conv(
    conv: torch.nn.Conv1d,
    inputs: torch.Tensor,
    nodes: TreeNodes,
    activation: str,
    taps: torch.Tensor | None = None,
    channels: list[int] | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution of ``inputs`` ``[1, N, C]`` along root paths, then ``activation``.

    The row is laid out with every node preceded by its K-1 path-history inputs (zeros where the
    path is shorter), and ``conv`` (``padding = K-1``, the models' own module) runs once over it:
    each node's window then holds exactly its path. ``taps`` ``[K-1, C]`` (a dfs chunk): the K-1
    inputs on the path right before the row, nearest last, which every path of the row continues.
    Returns ``[1, N, C]`` in ``inputs``' dtype.
    """
    width = conv.kernel_size[0] - 1
    gather, place = nodes.conv_layout(width, inputs.device, context=taps is not None)
    n = inputs.shape[1]
    padded = torch.cat([inputs.new_zeros(1, 1, inputs.shape[-1]), inputs], dim=1)
    index = gather + 1
    if taps is not None:  # -2 - j: tap j, stored after the row's tokens
        padded = torch.cat([padded, taps.to(inputs.dtype)[None]], dim=1)
        index = torch.where(gather >= -1, index, n + 1 + (-2 - gather))
    laid_out = padded[:, index].transpose(1, 2)
    laid_out = laid_out.to(conv.weight.dtype)
    out = conv(laid_out) if channels is None else conv(laid_out, channels=channels)
    out = out[:, :, : laid_out.shape[-1]][:, :, place]
    return ACT2FN[activation](out).transpose(1, 2).to(inputs.dtype)


def scan_levels(
    nodes: TreeNodes,
    chunk: int,
    inputs: list[torch.Tensor],
    scan: Callable[[list[torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    root_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``scan`` over the tree, one call per group of a level (:meth:`TreeNodes.levels`).

    ``inputs``: per-token tensors ``[N, ...]``; each call gets them gathered to ``[n, length, ...]``
    (zeros past a node's end) and the nodes' initial states (the parents' final states; for the
    roots' level ``root_state`` — a dfs chunk's parent state, ``[...]`` — or None: zeros), and
    returns outputs ``[n, length, ...]`` and final states. Returns the outputs put back in row order,
    ``[N, ...]``, and the final states of the deepest level's nodes (of a one-node row: its final state).
    """
    zero_rows = [torch.cat([x.new_zeros(1, *x.shape[1:]), x]) for x in inputs]
    pieces, order = [], []
    previous: torch.Tensor | None = None
    for groups in nodes.levels(chunk):
        finals = []
        for group in groups:
            index = torch.as_tensor(group.tokens + 1, device=inputs[0].device)
            gathered = [x[index] for x in zero_rows]
            # Level 0 holds the roots (zero states, or the dfs chunk's parent state); every deeper
            # node has its parent one level up.
            if previous is None:
                initial = None if root_state is None else root_state.expand(len(group.nodes), *root_state.shape)
            else:
                initial = previous[torch.as_tensor(group.parent_slot, device=previous.device)]
            output, final = scan(gathered, initial)
            valid = group.tokens >= 0
            pieces.append(output[torch.as_tensor(valid, device=output.device)])
            order.append(group.tokens[valid])
            finals.append(final)
        previous = torch.cat(finals)
    inverse = np.empty(nodes.n_tokens, dtype=np.int64)
    inverse[np.concatenate(order)] = np.arange(nodes.n_tokens)
    return torch.cat(pieces)[torch.as_tensor(inverse, device=pieces[0].device)], previous


def state_key(layer: int) -> tuple[str, int]:
    """The :class:`~ds_tree.attention.cached.PathCache` key of decoder layer ``layer``'s recurrent entry
    (a layer may hold attention keys and values under its index too: Falcon-H1 runs both in one layer)."""
    return ("state", layer)


@dataclass
class ChunkContext:
    """A dfs chunk's recurrent context (:mod:`ds_tree.engine.dfs`): its parent token's state and conv taps.

    Every path of a dfs chunk continues the path to its parent token (the last token of its parent
    chunk), so its root nodes start from that token's recurrent state and their conv windows reach
    into the K-1 inputs before it. Both are cached with the parent chunk's keys and values in the
    :class:`~ds_tree.attention.cached.PathCache` (under :func:`state_key`, as the pair
    ``(state, taps)``): leaf tensors that require grad, so the chunk's backward accumulates their
    gradients and the walk's surrogate hands them to the parent chunk exactly as it does the keys'.
    A chain chunk (no ``kv_end``: one node) records its own last token's state and taps for its children.
    """

    cache: object
    layer: int
    state: torch.Tensor | None
    """``[...]`` (one sequence's state, no batch dimension); None: a root chunk (zeros)."""
    taps: torch.Tensor | None
    """``[K-1, C]`` pre-conv inputs before the chunk, nearest last; None: a root chunk (zeros)."""
    records: bool

    def record(self, state: torch.Tensor, taps: torch.Tensor) -> None:
        if self.records and self.cache.recording:
            self.cache.recorded[state_key(self.layer)] = (state, taps)


def _tree_inputs(
    self, hidden_states: torch.Tensor, kwargs: dict, cache
) -> tuple[TreeNodes | None, ChunkContext | None, HeadShards | None]:
    """The row's nodes (None for a plain sequence, no ``kv_end``: the stock forward is right), for a dfs
    chunk (the ``path_cache`` kwarg) its :class:`ChunkContext`, and for a sequence-parallel shard (fewer
    tokens than ``kv_end``: :class:`~ds_tree.packing.sequence_parallel.RowShard`) its group's
    :class:`~ds_tree.models.head_parallel.HeadShards` (the nodes are then the whole row's)."""
    kv_end = kwargs.get("kv_end")
    path_cache = kwargs.get("path_cache")
    if kv_end is None and path_cache is None:
        return None, None, None
    if cache is not None:
        raise ValueError("a recurrent layer on a packed tree runs without a cache (use_cache=False)")
    chunk_shards = kwargs.get("chunk_shards")
    shards = None
    if chunk_shards is not None:  # a dfs chunk sharded over the group (ds_tree/engine/dfs_sequence_parallel.py)
        shards = HeadShards.of_group(chunk_shards.group)
        kv_end = chunk_shards.kv_end  # the padded chunk's (its padding: roots of one token); None: a chain chunk
        if kv_end is None:  # the chain's real tokens only: its final state is the one its children start from
            nodes = chain_nodes(chunk_shards.n_real)
    elif kv_end is not None and hidden_states.shape[:2] != kv_end.shape:
        if hidden_states.shape[0] != 1 or kv_end.shape[0] != 1:
            raise ValueError(
                f"a recurrent layer got {tuple(hidden_states.shape[:2])} tokens and kv_end {tuple(kv_end.shape)}: "
                "a sequence-parallel shard is one row"
            )
        shards = HeadShards.of_shard(int(hidden_states.shape[1]), int(kv_end.shape[1]))
    if kv_end is not None:
        nodes = tree_nodes(kv_end)
    elif chunk_shards is None:
        nodes = chain_nodes(int(hidden_states.shape[1]))
    if path_cache is None:
        return nodes, None, shards
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a dfs chunk is one sequence, got a batch of {hidden_states.shape[0]}")
    layer = self.layer_idx
    state = taps = None
    if path_cache.ancestors:
        parent = path_cache.ancestors[-1]
        if state_key(layer) not in parent:
            raise ValueError(
                f"recurrent layer {layer}: the dfs parent chunk cached no state for it (a chunk with children "
                "must be a chain chunk, which records its last token's state; see ds_tree/packing/dfs_chunks.py)"
            )
        state, taps = parent[state_key(layer)]
    return nodes, ChunkContext(path_cache, layer, state, taps, records=kv_end is None), shards


def _to_heads(
    shards: HeadShards, nodes: TreeNodes, layout: tuple[list[list[int]], list[list[int]]], pre_conv, *per_head
) -> tuple[list[int], list[torch.Tensor]]:
    """This rank's conv channels, and ``pre_conv`` ``[1, n, C]`` and the ``per_head`` tensors ``[n, H]`` of its
    shard exchanged for the whole row of its heads (``layout``: every rank's pre-conv channels and heads);
    rows past ``nodes`` (a sharded chain chunk's padding) are left out of the scan."""
    pre_conv_channels, heads = layout
    real = nodes.n_tokens
    exchanged = [shards.to_heads(pre_conv[0], pre_conv_channels)[None, :real]]
    exchanged += [shards.to_heads(tensor, heads)[:real] for tensor in per_head]
    return pre_conv_channels[shards.position], exchanged


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` ``[n, C]`` with zero rows appended up to ``rows`` (a sharded chain chunk's padding)."""
    return F.pad(tensor, (0, 0, 0, rows - tensor.shape[0]))


def _chunk_taps(context: ChunkContext, inputs: torch.Tensor, width: int) -> torch.Tensor:
    """The K-1 pre-conv inputs ending at a chain chunk's last token (``inputs`` ``[N, C]``), nearest last."""
    before = context.taps if context.taps is not None else inputs.new_zeros(width, inputs.shape[-1])
    return torch.cat([before.to(inputs.dtype), inputs])[-width:]


# ------------------------------------------------------------------------------- Gated DeltaNet
def gated_delta_net_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """``Qwen3_5GatedDeltaNet.forward`` over the tree of ``kwargs['kv_end']`` (module docstring)."""
    nodes, context, shards = _tree_inputs(self, hidden_states, kwargs, cache)
    if nodes is None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    projected = self.in_proj_qkv(hidden_states)
    z = self.in_proj_z(hidden_states)
    b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    return _gated_delta_tree(self, hidden_states.shape, nodes, context, shards, projected, z, b, a)


def qwen3_next_gated_delta_net_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """``Qwen3NextGatedDeltaNet.forward`` over the tree of ``kwargs['kv_end']``: Qwen3.5's layer with
    fused projections (``in_proj_qkvz``, ``in_proj_ba``, grouped per key head; the model's own
    ``fix_query_key_value_ordering`` unpacks them)."""
    nodes, context, shards = _tree_inputs(self, hidden_states, kwargs, cache)
    if nodes is None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    query, key, value, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
    )
    projected = torch.cat([x.reshape(*x.shape[:2], -1) for x in (query, key, value)], dim=-1)
    return _gated_delta_tree(self, hidden_states.shape, nodes, context, shards, projected, z, b, a)


def _gated_delta_channels(self, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per rank of ``size``: its pre-conv channels (q and k of its key heads, v of its value heads) and its
    value heads (:mod:`ds_tree.models.head_parallel`)."""
    key_heads = [shared_block(self.num_k_heads, self.num_v_heads, size, q) for q in range(size)]
    value_heads = [head_block(self.num_v_heads, size, q) for q in range(size)]
    k, v = self.head_k_dim, self.head_v_dim
    pre_conv = [
        channels_of([(0, k, keys), (self.key_dim, k, keys), (2 * self.key_dim, v, values)])
        for keys, values in zip(key_heads, value_heads, strict=True)
    ]
    return pre_conv, [channels_of([(0, 1, values)]) for values in value_heads]


def _gated_delta_tree(self, shape, nodes: TreeNodes, context: ChunkContext | None, shards, projected, z, b, a):
    """The Gated DeltaNet mixer from its projections: ``projected`` ``[1, N, 2 Dk + Dv]`` (pre-conv q, k, v),
    ``z`` (the output gate, ``N * Hv`` heads of ``Dv``), ``b``, ``a`` ``[1, N, Hv]``. With ``shards`` they
    are this rank's shard of the row, exchanged for the whole row of its heads around the scan."""
    batch, length, _ = shape
    beta = b.reshape(length, -1).sigmoid()
    # The stock layer takes A_log and a in float32 (".float()", against -inf in fp16): at least float32.
    dtype = compute_dtype(projected.dtype)
    g = -self.A_log.to(dtype).exp() * F.softplus(a.reshape(length, -1).to(dtype) + self.dt_bias)
    channels, key_dim, value_dim = None, self.key_dim, self.value_dim
    if shards is not None:
        layout = _gated_delta_channels(self, shards.size)
        channels, (projected, beta, g) = _to_heads(shards, nodes, layout, projected, beta, g)
        key_dim = len(shared_block(self.num_k_heads, self.num_v_heads, shards.size, 0)) * self.head_k_dim
        value_dim = value_dim // shards.size
    taps = None if context is None else context.taps
    if context is not None and taps is None:  # a root chunk: its paths start at the chunk
        taps = projected.new_zeros(self.conv1d.kernel_size[0] - 1, projected.shape[-1])
    mixed = tree_conv(self.conv1d, projected, nodes, self.activation, taps, channels)
    rows = mixed.shape[1]
    query, key, value = torch.split(mixed[0], [key_dim, key_dim, value_dim], dim=-1)
    query = query.reshape(rows, -1, self.head_k_dim)
    key = key.reshape(rows, -1, self.head_k_dim)
    value = value.reshape(rows, -1, self.head_v_dim)

    def scan(gathered, initial):
        scans = RECURRENT_SCANS[self.tree_scans]
        return scans.chunk_gated_delta_rule(*gathered, initial, chunk=GATED_DELTA_CHUNK, l2_norm_qk=True)

    root_state = None if context is None else context.state
    core, final = scan_levels(nodes, GATED_DELTA_CHUNK, [query, key, value, g, beta], scan, root_state)
    if context is not None:
        context.record(final[0], _chunk_taps(context, projected[0], self.conv1d.kernel_size[0] - 1))
    if shards is not None:
        core = shards.to_shards(_padded(core.reshape(rows, -1), shards.size * length))
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch, length, -1))


# ------------------------------------------------------------------------------------------ Mamba2
def _mamba2_channels(self, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per rank of ``size``: its pre-conv channels (x of its heads, B and C of the groups they read) and its heads."""
    heads = [head_block(self.num_heads, size, q) for q in range(size)]
    groups = [shared_block(self.n_groups, self.num_heads, size, q) for q in range(size)]
    n, x_width = self.ssm_state_size, self.intermediate_size
    pre_conv = [
        channels_of([(0, self.head_dim, mine), (x_width, n, read), (x_width + self.n_groups * n, n, read)])
        for mine, read in zip(heads, groups, strict=True)
    ]
    return pre_conv, [channels_of([(0, 1, mine)]) for mine in heads]


def mamba2_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """``BambaMixer.forward`` (its torch path) over the tree of ``kwargs['kv_end']`` (module docstring); with a
    sequence-parallel shard, head-parallel (:mod:`ds_tree.models.head_parallel`)."""
    nodes, context, shards = _tree_inputs(self, hidden_states, kwargs, cache)
    if nodes is None:
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    batch, length, _ = hidden_states.shape
    dtype = hidden_states.dtype
    falcon = hasattr(self, "mup_vector")  # Falcon-H1: muP multipliers on the input and the projections
    projected = self.in_proj(hidden_states * self.ssm_in_multiplier if falcon else hidden_states)
    if falcon:
        projected = projected * self.mup_vector
    gate, pre_conv, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    work = compute_dtype(dtype)
    # dt discretised before the scan (the stock scan does it inside): padding must have dt = 0 exactly.
    dt = F.softplus(dt[0].to(work) + self.dt_bias.to(work)).clamp(*self.time_step_limit)
    A, D = -torch.exp(self.A_log.to(work)), self.D
    channels, heads, groups = None, self.num_heads, self.n_groups
    if shards is not None:
        layout = _mamba2_channels(self, shards.size)
        channels, (pre_conv, dt) = _to_heads(shards, nodes, layout, pre_conv, dt)
        mine = torch.as_tensor(layout[1][shards.position], device=A.device)
        A, D, heads = A[mine], D[mine], len(mine)
        groups = len(shared_block(self.n_groups, self.num_heads, shards.size, 0))
    taps = None if context is None else context.taps
    if context is not None and taps is None:  # a root chunk: its paths start at the chunk
        taps = pre_conv.new_zeros(self.conv1d.kernel_size[0] - 1, pre_conv.shape[-1])
    xbc = tree_conv(self.conv1d, pre_conv, nodes, self.activation, taps, channels)[0]
    rows = xbc.shape[0]
    x, B, C = torch.split(
        xbc, [heads * self.head_dim, groups * self.ssm_state_size, groups * self.ssm_state_size], dim=-1
    )
    x = x.reshape(rows, heads, self.head_dim)
    B = B.reshape(rows, groups, self.ssm_state_size)
    C = C.reshape(rows, groups, self.ssm_state_size)

    def scan(gathered, initial):
        return RECURRENT_SCANS[self.tree_scans].chunk_mamba2(
            gathered[0], gathered[1], A, gathered[2], gathered[3], D, initial, self.chunk_size
        )

    root_state = None if context is None else context.state
    y, final = scan_levels(nodes, self.chunk_size, [x, dt, B, C], scan, root_state)
    if context is not None:
        context.record(final[0], _chunk_taps(context, pre_conv[0], self.conv1d.kernel_size[0] - 1))
    if shards is not None:
        y = shards.to_shards(_padded(y.reshape(rows, -1), shards.size * length))
    y = y.reshape(batch, length, -1)
    if falcon and not self.mamba_rms_norm:  # Falcon-H1 without its gated norm: the gate alone
        y = y * F.silu(gate.to(y.dtype))
    else:
        y = self.norm(y, gate)
    return self.out_proj(y.to(dtype))


def gated_delta_sizes(module) -> dict:
    """What the memory model needs of a Gated DeltaNet mixer (``ds_tree.memory.predict.RecurrentMixer``'s
    fields): the attributes its tree forward reads, and the scan's chunk."""
    conv = module.conv1d
    return dict(
        kind="gated_delta",
        heads=module.num_v_heads,
        key_dim=module.head_k_dim,
        value_dim=module.head_v_dim,
        groups=module.num_k_heads,
        conv_channels=conv.in_channels,
        conv_kernel=conv.kernel_size[0],
        chunk=GATED_DELTA_CHUNK,
    )


def mamba2_sizes(module) -> dict:
    """What the memory model needs of a Mamba2 mixer (:func:`gated_delta_sizes`)."""
    conv = module.conv1d
    return dict(
        kind="mamba2",
        heads=module.num_heads,
        key_dim=module.ssm_state_size,
        value_dim=module.head_dim,
        groups=module.n_groups,
        conv_channels=conv.in_channels,
        conv_kernel=conv.kernel_size[0],
        chunk=module.chunk_size,
        projected=module.in_proj.out_features,
    )


def install_tree_mixers(model: torch.nn.Module, scans: str = "torch") -> int:
    """Replace the ``forward`` of every recurrent mixer of ``model`` that its family runs on trees by its tree
    forward, scanning with :data:`RECURRENT_SCANS` ``[scans]`` (``torch`` or ``fla``, resolved by
    :func:`~ds_tree.scans.fla_scan.resolve_recurrent_kernels`). Returns how many mixers. (A float64 model's
    gated norms compute in float64 like its other norms: :mod:`ds_tree.models.float64`.)"""
    recurrent = family_of_model(model).recurrent
    forwards = {} if recurrent is None else recurrent.tree_forwards
    installed = 0
    for module in model.modules():
        forward = forwards.get(type(module).__name__)
        if forward is not None:
            module.forward = forward.__get__(module)
            module.tree_scans = scans  # a name, not the module: a model with it still deep-copies
            module.conv1d.forward = sliced_conv_forward.__get__(module.conv1d)
            installed += 1
    return installed
