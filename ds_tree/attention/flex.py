"""Tree attention through PyTorch's FlexAttention: the library's own kernel on the ``kv_end`` mask.

The tree mask is a ``mask_mod``: query ``q`` sees key ``k`` iff ``k <= q < kv_end[b, k]``
(docs/DESIGN.md section 2), and with a sliding window also ``positions[b, q] - positions[b, k] <
window`` (the tokens' depths, reference module). Gemma2's soft-capping is a ``score_mod``, ``cap *
tanh(s / cap)`` of the already scaled score ``s``, exactly what the reference does before the mask.
GQA is FlexAttention's ``enable_gqa`` (query head ``h`` reads kv head ``h // (Hq // Hkv)``), so k/v
are never repeated. The ``BlockMask`` depends only on ``kv_end`` (and the positions with a window),
which every layer of a forward shares: it is built once and cached by their bytes, like the
block-sparse engine's plan.

Where it runs:

- **CPU** (tested): eager FlexAttention, forward only. torch 2.13 refuses inputs that require grad
  on the CPU (``NotImplementedError: FlexAttention does not support backward on CPU``, raised in
  the forward, eager and compiled alike), so this engine raises :class:`FlexBackwardUnavailable`
  naming the alternatives instead; training with ``model.attention: flex`` on a CPU is refused at
  config time (``models.loading.check_model_settings``). Eager runs any float dtype, float64 too,
  and materialises the scores of the row (small inputs only); ``torch.compile`` on the CPU refuses
  float64 and takes ~2 minutes to compile one shape, so the CPU path is eager by default.
- **CUDA** (written, NOT yet run on a GPU): ``flex_attention`` compiled once (``torch.compile``,
  ``dynamic=False``) and each row padded to a length bucket (:func:`length_bucket`: a power of two,
  at least :data:`MIN_BUCKET`), so a training run compiles one kernel per bucket instead of one per
  row length. Padding tokens see only themselves (``kv_end = k + 1``, depth 0), the rule the packer
  uses for its own padding: real queries never see them and they are cut from the output. The
  ``BlockMask`` is built by ``create_block_mask(..., _compile=True)`` with ``BLOCK_SIZE`` 128.
  docs/KERNEL.md lists what to run on a GPU to check it forward and backward.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from ds_tree.attention.reference import check_window, gqa_group

MIN_BUCKET = 128
"""Shortest padded length on the compiled path (FlexAttention's default block size)."""
BLOCK_SIZE = 128
RECOMPILE_LIMIT = 64
_MASKS: OrderedDict[tuple, object] = OrderedDict()
_MASK_CACHE_SIZE = 16
_COMPILED: dict[str, object] = {}


class FlexBackwardUnavailable(NotImplementedError):
    """FlexAttention has no backward on this device (torch 2.13: the CPU)."""


def length_bucket(n: int) -> int:
    """The padded length of an ``n``-token row on the compiled path: the next power of two, at
    least :data:`MIN_BUCKET` (at most 2x the row; one compile per bucket)."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


def use_compiled(device: torch.device) -> bool:
    """Compile (and bucket) on CUDA; eager elsewhere (the CPU: see the module docstring)."""
    return device.type == "cuda"


def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if "flex" not in _COMPILED:
        # one graph per bucket (9 from 128 to 32K) and per variant (window, cap, batch): past dynamo's
        # default limit of 8 recompiles it would fall back to the eager kernel, which materialises N^2
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        torch._dynamo.config.recompile_limit = limit
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


# The window and the cap enter the mods as captured 0-dim tensors, not Python numbers: FlexAttention
# runs its mods through dynamo even in eager mode, and dynamo guards on a captured number's value
# (a new window or cap: a recompile, ~3 s on this CPU) but takes a captured tensor as an input.


def tree_mask_mod(kv_end: torch.Tensor, positions: torch.Tensor | None = None, window: int | None = None):
    """The tree visibility rule as a FlexAttention ``mask_mod(b, h, q, k)``: ``k <= q <
    kv_end[b, k]``, and ``positions[b, q] - positions[b, k] < window`` with a window."""

    def tree(b, h, q, k):
        return (k <= q) & (q < kv_end[b, k])

    if window is None:
        return tree
    limit = torch.tensor(window, dtype=positions.dtype, device=positions.device)

    def windowed(b, h, q, k):
        return tree(b, h, q, k) & (positions[b, q] - positions[b, k] < limit)

    return windowed


def softcap_score_mod(softcap: float, dtype: torch.dtype, device: torch.device):
    """``cap * tanh(score / cap)`` on the scaled score, as a FlexAttention ``score_mod``."""
    cap = torch.tensor(softcap, dtype=torch.promote_types(dtype, torch.float32), device=device)

    def capped(score, b, h, q, k):
        return torch.tanh(score / cap) * cap

    return capped


def tree_block_mask(kv_end: torch.Tensor, positions: torch.Tensor | None, window: int | None, compiled: bool):
    """The ``BlockMask`` of ``kv_end`` ``[B, N]`` (and the window), cached by the bytes of its inputs."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (
        tuple(kv_end.shape),
        str(kv_end.device),
        kv_end.cpu().numpy().tobytes(),
        None if window is None else (window, positions.cpu().numpy().tobytes()),
        compiled,
    )
    mask = _MASKS.get(key)
    if mask is None:
        batch, n = kv_end.shape
        mask = create_block_mask(
            tree_mask_mod(kv_end, positions, window),
            batch,
            None,
            n,
            n,
            device=kv_end.device,
            BLOCK_SIZE=BLOCK_SIZE,
            _compile=compiled,
        )
        _MASKS[key] = mask
        if len(_MASKS) > _MASK_CACHE_SIZE:
            _MASKS.popitem(last=False)
    else:
        _MASKS.move_to_end(key)
    return mask


def _pad_to(x: torch.Tensor, n: int, dim: int, fill) -> torch.Tensor:
    extra = n - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, fill(shape, x)], dim=dim)


def pad_to_bucket(query, key, value, kv_end, positions, n: int):
    """Pad a row to ``n`` tokens with tokens that see only themselves (``kv_end = k + 1``, depth 0)."""
    zeros = lambda shape, x: x.new_zeros(shape)  # noqa: E731
    query, key, value = (_pad_to(x, n, 2, zeros) for x in (query, key, value))
    ends = lambda shape, x: torch.arange(x.shape[1] + 1, n + 1, device=x.device, dtype=x.dtype).expand(shape)  # noqa: E731
    kv_end = _pad_to(kv_end, n, 1, ends)
    if positions is not None:
        positions = _pad_to(positions, n, 1, zeros)
    return query, key, value, kv_end, positions


def flex_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_end: torch.Tensor,
    scale: float | None = None,
    *,
    positions: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    compiled: bool | None = None,
    bucketed: bool | None = None,
) -> torch.Tensor:
    """``[B, Hq, N, D]``, ``[B, Hkv, N, D]`` x2, ``kv_end [B, N]`` -> ``[B, N, Hq, D]`` (registry contract).

    ``compiled`` / ``bucketed`` (None: on CUDA only) force the compiled kernel and the padding to
    :func:`length_bucket` either way (tests run the bucket padding eagerly on the CPU).
    """
    _, _, n, _ = query.shape
    group = gqa_group(query, key)
    if window is not None:
        check_window(positions, window, kv_end.shape)
    if query.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
        raise FlexBackwardUnavailable(
            "attention engine flex: torch's FlexAttention has no backward on the CPU (torch "
            f"{torch.__version__}); run it under torch.no_grad() (forward checks), or train on the CPU "
            "with attention: torch (or reference)"
        )
    device = query.device
    compiled = use_compiled(device) if compiled is None else compiled
    bucketed = use_compiled(device) if bucketed is None else bucketed
    kv_end = kv_end.to(device)
    positions = None if window is None else positions.to(device)
    if bucketed:
        query, key, value, kv_end, positions = pad_to_bucket(query, key, value, kv_end, positions, length_bucket(n))
    block_mask = tree_block_mask(kv_end, positions, window, compiled)
    with warnings.catch_warnings():
        # eager on purpose off CUDA (module docstring): torch's advice to compile is not for us there
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        output = _flex_attention(compiled)(
            query,
            key,
            value,
            score_mod=None if softcap is None else softcap_score_mod(softcap, query.dtype, device),
            block_mask=block_mask,
            scale=scale,
            enable_gqa=group != 1,
        )
    return output[:, :, :n].transpose(1, 2).contiguous()
