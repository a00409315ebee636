"""Chunked scans of the two recurrent mixers, with an initial state per sequence and its final state.

Both are the chunked algorithms of transformers 5.24's torch fallbacks (``torch_chunk_gated_delta_rule``
in ``models/qwen3_5``, ``mamba2_chunk_scan`` in ``models/bamba``), written here for two reasons:

- precision: the fallbacks cast their inputs to float32 (``.to(torch.float32)``, ``.float()``), a
  choice for bf16 training. These compute in ``promote_types(dtype, float32)``: float32 for
  float32/bf16/fp16 inputs, as the fallbacks do, and float64 for float64 inputs, so that ``verify``
  in float64 checks the tree to float64 round-off (with the float32 casts, tree and flat gradients
  differ at ~1e-4 relative, the casts' round-off carried through the states);
- batching: every sequence of a batch starts from its own state (``initial_state[b]``), so one call
  scans all nodes of a tree level, each from its parent's final state. Padding at a sequence's end
  must have ``g = 0, beta = 0`` (delta rule) or ``dt = 0`` (Mamba2): it leaves the state unchanged,
  so the final state is the state after the last real token.

Gradients flow through the initial states (autograd), so a parent's state receives the gradients
of all its children.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for narrower dtypes (as the stock fallbacks), float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _pad_to_chunks(x: torch.Tensor, dim: int, chunk: int) -> torch.Tensor:
    pad = (-x.shape[dim]) % chunk
    if not pad:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return F.pad(x, widths)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dimension (the fallbacks' and fla's q/k norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk: int = 64,
    l2_norm_qk: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule ``S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T``,
    ``o_t = S_t^T q_t / sqrt(d_k)`` (q and k L2-normalised first with ``l2_norm_qk``).

    ``query``/``key`` ``[B, T, Hk, Dk]``, ``value`` ``[B, T, Hv, Dv]``, ``g``/``beta`` ``[B, T, Hv]``,
    ``initial_state`` ``[B, Hv, Dk, Dv]`` or None (zeros). Returns the output ``[B, T, Hv, Dv]`` in
    the input dtype and the final state ``[B, Hv, Dk, Dv]`` in the compute dtype.
    """
    out_dtype = query.dtype
    dtype = compute_dtype(out_dtype)
    batch, length, k_heads, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    if v_heads != k_heads:  # each q/k head serves v_heads // k_heads consecutive value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    # [B, H, T, D] in the compute dtype
    query, key, value = (x.transpose(1, 2).to(dtype) for x in (query, key, value))
    g, beta = (x.transpose(1, 2).to(dtype) for x in (g, beta))
    if l2_norm_qk:
        query, key = l2_normalise(query), l2_normalise(key)
    query = query * k_dim**-0.5
    query, key, value = (_pad_to_chunks(x, 2, chunk) for x in (query, key, value))
    g, beta = (_pad_to_chunks(x, 2, chunk) for x in (g, beta))
    n_chunks = query.shape[2] // chunk

    def chunked(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:2], n_chunks, chunk, *x.shape[3:])

    query, key, value, g, beta = (chunked(x) for x in (query, key, value, g, beta))
    decay = g.cumsum(-1)  # log of the decay from the chunk start to each position
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).triu(1)
    # pairwise[i, j] = decay from position j to position i of a chunk, 0 above the diagonal
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta = key * beta[..., None]
    # Within a chunk the delta rule's updates form a unit lower-triangular system (the WY / UT form):
    # solving it once per chunk turns the token loop into matrix products.
    system = (k_beta @ key.transpose(-1, -2)) * pairwise  # its diagonal is ignored (unitriangular)
    corrected_values = torch.linalg.solve_triangular(system, value * beta[..., None], upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    within = (query @ key.transpose(-1, -2)) * pairwise
    query_decayed = query * decay.exp()[..., None]
    key_to_end = key * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]

    state = (
        torch.zeros(batch, v_heads, k_dim, v_dim, dtype=dtype, device=query.device)
        if initial_state is None
        else initial_state.to(dtype)
    )
    outputs = []
    for index in range(n_chunks):
        new = corrected_values[:, :, index] - state_keys[:, :, index] @ state
        outputs.append(query_decayed[:, :, index] @ state + within[:, :, index] @ new)
        state = state * chunk_decay[:, :, index] + key_to_end[:, :, index].transpose(-1, -2) @ new
    output = torch.cat(outputs, dim=2)[:, :, :length]
    return output.transpose(1, 2).to(out_dtype), state


def chunk_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's SSD scan ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``.

    ``x`` ``[Bt, T, H, P]``; ``dt`` ``[Bt, T, H]`` already discretised (bias, softplus, limits);
    ``A``, ``D`` ``[H]``; ``B``/``C`` ``[Bt, T, G, N]``; ``initial_state`` ``[Bt, H, P, N]`` or None.
    Returns ``y`` ``[Bt, T, H, P]`` and the final state ``[Bt, H, P, N]``, both in the compute dtype.
    """
    dtype = compute_dtype(x.dtype)
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2:]
    x, dt, A, D = x.to(dtype), dt.to(dtype), A.to(dtype), D.to(dtype)
    B = B.to(dtype).repeat_interleave(heads // groups, dim=2)
    C = C.to(dtype).repeat_interleave(heads // groups, dim=2)
    skip = x * D[:, None]
    inputs = x * dt[..., None]
    log_decay = dt * A  # [Bt, T, H]
    inputs, log_decay, B, C = (_pad_to_chunks(t, 1, chunk) for t in (inputs, log_decay, B, C))
    n_chunks = inputs.shape[1] // chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, n_chunks, chunk, *t.shape[2:])

    inputs, log_decay, B, C = (chunked(t) for t in (inputs, log_decay, B, C))
    decay = log_decay.cumsum(2)  # [Bt, c, l, H]: log decay from the chunk start to position l
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    # pairwise[b, c, l, s, h] = decay from position s to l (s <= l), 0 for s > l
    pairwise = (decay[:, :, :, None] - decay[:, :, None, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * pairwise
    within = torch.einsum("bclsh,bcshp->bclhp", scores, inputs)
    to_end = (decay[:, :, -1:] - decay).exp()  # [Bt, c, l, H]
    chunk_states = torch.einsum("bclhn,bclh,bclhp->bchpn", B, to_end, inputs)
    state = (
        torch.zeros(batch, heads, head_dim, state_size, dtype=dtype, device=x.device)
        if initial_state is None
        else initial_state.to(dtype)
    )
    outputs = []
    for index in range(n_chunks):
        carried = torch.einsum("blhn,bhpn,blh->blhp", C[:, index], state, decay[:, index].exp())
        outputs.append(within[:, index] + carried)
        state = state * decay[:, index, -1].exp()[..., None, None] + chunk_states[:, index]
    y = torch.cat(outputs, dim=1)[:, :length] + skip
    return y, state
