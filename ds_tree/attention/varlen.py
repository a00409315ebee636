"""The flat baseline on flash kernels: engine ``varlen``, for flat rows only, on CUDA only.

A flat row (``packing.mode: flat``, the baseline of docs/DESIGN.md section 5) is a concatenation of
independent sequences: segments ``[s, e)`` whose every token has ``kv_end[k] == e``; a padding token
is a 1-token segment (``kv_end[k] = k + 1``). There the tree rule ``k <= q < kv_end[k]`` is plain
causal attention inside each segment, which is what variable-length flash kernels compute from the
segments' cumulative lengths (``cu_seqlens``). :func:`flat_segments` reads them off ``kv_end`` with
vectorised torch ops (a ``[B, N]`` batch is one packed sequence list, row after row) and refuses a
row that is not flat: a tree row would silently lose its branches' view of their shared prefix, so
the engine never runs one (use ``torch``, ``flex`` or ``triton`` for tree rows).

Kernel: flash-attn's ``flash_attn_varlen_func`` when the ``flash_attn`` package imports (the optional
``gpu`` extra: GQA, windows and soft-capping native), else torch's
``torch.nn.attention.varlen.varlen_attn``, whose keywords differ between releases and are read off its
signature (never off version strings):

- torch 2.13: ``window_size=(left, right)`` with ``(-1, 0)`` causal (no ``is_causal``), ``enable_gqa``;
- torch 2.11 (the project's GPU machine): ``varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q,
  max_k, *, return_aux=None, scale=None, window_size=(-1, -1))``: the same ``window_size``, no
  ``enable_gqa`` (added after 2.11, pytorch/pytorch#179468) and no check of the head counts either;
  aten's flash kernel takes fewer key/value heads as they are (GQA without repeating them);
- torch 2.10 (``is_causal``, no ``window_size``) is refused.

Neither torch release takes a soft cap: Gemma2's ``softcap`` needs flash-attn, else it is refused.
A sliding ``window`` (keys with ``positions[q] - positions[k] < window``, the depths) is the flash
window ``(window - 1, 0)`` on token offsets, exact on a flat row because its depths count up by one
inside each sequence (checked when a window is given). Flash kernels run float16 and bfloat16 only
and have no CPU implementation (torch's raises ``NotImplementedError`` for
``aten::_flash_attention_forward`` on the CPU): both are refused here with a message first. The
backward is the kernels' own (``has_backward("varlen", "cuda")``).
"""

from __future__ import annotations

import functools
import inspect

import torch

from ds_tree.attention.reference import check_window, gqa_group

DTYPES = (torch.float16, torch.bfloat16)
"""Input dtypes of the flash kernels."""

_LAST: list[tuple] = []
"""One entry: (kv_end, its _version, segments). Every layer of a forward passes the same ``kv_end``
tensor: its segments (two host syncs) are derived once. The entry holds the tensor, so ``is``
cannot match a new tensor at a reused address."""


class NotFlatError(ValueError):
    """``kv_end`` describes a tree (or an invalid row), not independent sequences."""


class VarlenUnavailable(RuntimeError):
    """The varlen engine cannot run here: no CUDA device, or a dtype or option its kernel lacks."""


def flat_segments(kv_end: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of the flat rows ``kv_end`` ``[B, N]``: int32 cumulative segment
    lengths on ``kv_end``'s device, rows concatenated (row ``b``'s tokens start at ``b * N``), and the
    longest segment. :class:`NotFlatError` unless every row is flat: each token's ``kv_end`` is past it
    and at most ``N``, and a token that does not end its segment (``kv_end[k] != k + 1``) shares its
    ``kv_end`` with the next token."""
    if kv_end.dim() != 2:
        raise ValueError(f"kv_end must be [batch, tokens], got shape {tuple(kv_end.shape)}")
    batch, n = kv_end.shape
    index = torch.arange(n, device=kv_end.device)
    ends_here = kv_end == index + 1  # the last token of its segment
    continues = (kv_end[:, 1:] == kv_end[:, :-1]) | ends_here[:, :-1]
    flat = (kv_end > index).all() & (kv_end[:, -1] == n).all() & continues.all()
    if not bool(flat):
        raise NotFlatError(_not_flat_message(kv_end, continues, index))
    ends = torch.nonzero(ends_here.reshape(-1)).squeeze(1) + 1
    cu_seqlens = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    return cu_seqlens, int((ends - torch.cat([ends.new_zeros(1), ends[:-1]])).max())


def _not_flat_message(kv_end: torch.Tensor, continues: torch.Tensor, index: torch.Tensor) -> str:
    bad = (kv_end <= index) | (kv_end > kv_end.shape[1])
    bad[:, :-1] |= ~continues
    row, token = (int(x) for x in torch.nonzero(bad)[0])
    return (
        "the varlen engine runs flat rows only (independent sequences: every token's kv_end is the end of "
        f"its own sequence); row {row} is not flat at token {token} (kv_end {int(kv_end[row, token])}): a "
        "tree row. Use the torch, flex or triton engine for tree rows (packing.mode: tree or dfs), or "
        "packing.mode: flat with varlen"
    )


def _segments(kv_end: torch.Tensor) -> tuple[torch.Tensor, int]:
    if _LAST and _LAST[0][0] is kv_end and _LAST[0][1] == kv_end._version:
        return _LAST[0][2]
    segments = flat_segments(kv_end)
    _LAST[:] = [(kv_end, kv_end._version, segments)]
    return segments


def check_offsets(kv_end: torch.Tensor, positions: torch.Tensor) -> None:
    """A window on flat rows: the depths count up by one inside each sequence, so a flash window on
    token offsets is the window on depths; NotFlatError otherwise."""
    index = torch.arange(kv_end.shape[1], device=kv_end.device)
    inside = kv_end[:, :-1] != index[:-1] + 1  # token k and k + 1 are in one sequence
    steps = positions[:, 1:] - positions[:, :-1]
    if not bool((steps == 1)[inside].all()):
        raise NotFlatError(
            "the varlen engine's sliding window counts token offsets: position_ids must count up by one inside "
            "each sequence of a flat row"
        )


@functools.cache
def kernel_name() -> str:
    """``flash_attn`` when flash-attn imports, else ``torch`` (``torch.nn.attention.varlen``)."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return "torch"
    return "flash_attn"


def varlen_attention(
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
    """Causal attention inside each sequence of flat rows: query ``[B, Hq, N, D]``, key/value
    ``[B, Hkv, N, D]``, ``kv_end`` ``[B, N]`` -> ``[B, N, Hq, D]`` (the tree contract on flat rows).
    :class:`NotFlatError` for a tree row, :class:`VarlenUnavailable` off CUDA or in float32/64."""
    batch, heads_q, n, head_dim = query.shape
    group = gqa_group(query, key)
    cu_seqlens, max_seqlen = _segments(kv_end)
    if window is not None:
        check_window(positions, window, kv_end.shape)
        check_offsets(kv_end, positions)
    if query.device.type != "cuda":
        raise VarlenUnavailable(
            f"the varlen engine needs a CUDA GPU: flash kernels have no {query.device.type} implementation "
            "(torch's varlen_attn raises NotImplementedError there); use the torch engine on the CPU"
        )
    if query.dtype not in DTYPES:
        raise VarlenUnavailable(
            f"the varlen engine's flash kernels take float16 or bfloat16, got {query.dtype}: use model.dtype: "
            "bfloat16, or the flex, triton or torch engine in float32"
        )
    packed = [x.transpose(1, 2).reshape(batch * n, x.shape[1], head_dim) for x in (query, key, value)]
    if kernel_name() == "flash_attn":
        out = _flash_attn(*packed, cu_seqlens, max_seqlen, scale, window, softcap)
    else:
        out = _torch_varlen(*packed, cu_seqlens, max_seqlen, scale, window, softcap, group)
    return out.view(batch, n, heads_q, head_dim)


def _flash_attn(query, key, value, cu_seqlens, max_seqlen, scale, window, softcap):
    from flash_attn import flash_attn_varlen_func

    options = {"softcap": softcap} if softcap is not None else {}
    return flash_attn_varlen_func(
        query,
        key,
        value,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),
        **options,
    )


def _torch_varlen(query, key, value, cu_seqlens, max_seqlen, scale, window, softcap, group):
    """torch's kernel, its keywords read off its signature (2.11: no enable_gqa; 2.13: enable_gqa)."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    if softcap is not None:
        raise VarlenUnavailable(
            "torch's varlen_attn has no soft-capping (a Gemma2 attn_logit_softcapping layer): install flash-attn "
            "(the gpu extra) for the varlen engine, or use flex or triton"
        )
    if "window_size" not in parameters:  # torch 2.10 took is_causal instead
        raise VarlenUnavailable("the varlen engine needs torch >= 2.11's varlen_attn (window_size=(-1, 0) is causal)")
    options = {"scale": scale, "window_size": (-1, 0) if window is None else (window - 1, 0)}  # a tuple: compared
    if group > 1 and "enable_gqa" in parameters:  # torch 2.13 checks the heads unless asked for GQA
        options["enable_gqa"] = True
    # torch 2.11's varlen_attn has neither enable_gqa (added after it, pytorch/pytorch#179468) nor a check of
    # the head counts: aten's flash kernel takes fewer key/value heads natively, forward and backward
    # (checked on an H200 against the k/v heads repeated, and by tests/test_varlen_attention.py)
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)
