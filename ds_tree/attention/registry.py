"""One ``tree_attention`` entry point over several engines, and its transformers registration.

Engines: ``reference`` (dense mask, any dtype: the oracle), ``torch`` (block-sparse, the CPU
default), ``triton`` (the GPU kernel; on a machine without a GPU only under
``TRITON_INTERPRET=1``), ``flex`` (PyTorch's FlexAttention on the same mask; forward only on
the CPU, ``flex.py``) and ``varlen`` (the flat baseline on flash kernels: flat rows only, CUDA
only, ``varlen.py``). ``auto`` (:func:`resolve_engine`) is ``flex`` on CUDA, ``torch`` on the CPU.
Each is registered in transformers' ``AttentionInterface`` as ``tree_<engine>``; a model built
with that ``attn_implementation`` receives ``kv_end`` (and ``position_ids``) as forward kwargs and
runs unchanged otherwise. A layer that passes ``sliding_window`` (Mistral, Qwen2/3 sliding
layers, Gemma2/3 local layers) gets the window rule on the tree depths, ``position_ids``; one that
passes ``softcap`` (Gemma2) gets capped scores, on every engine (varlen: with flash-attn only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_tree.attention.blocksparse import blocksparse_tree_attention
from ds_tree.attention.reference import tree_attention_reference


def _triton(query, key, value, kv_end, scale=None, *, positions=None, window=None, softcap=None):
    from ds_tree.attention.triton import triton_tree_attention  # imports triton: only on demand

    return triton_tree_attention(query, key, value, kv_end, scale, positions=positions, window=window, softcap=softcap)


def _flex(query, key, value, kv_end, scale=None, *, positions=None, window=None, softcap=None):
    from ds_tree.attention.flex import flex_tree_attention  # imports FlexAttention: only on demand

    return flex_tree_attention(query, key, value, kv_end, scale, positions=positions, window=window, softcap=softcap)


def _varlen(query, key, value, kv_end, scale=None, *, positions=None, window=None, softcap=None):
    from ds_tree.attention.varlen import varlen_attention  # imports flash-attn when installed: only on demand

    return varlen_attention(query, key, value, kv_end, scale, positions=positions, window=window, softcap=softcap)


ENGINES: dict[str, Callable[..., torch.Tensor]] = {
    "reference": tree_attention_reference,
    "torch": blocksparse_tree_attention,
    "triton": _triton,
    "flex": _flex,
    "varlen": _varlen,
}

AUTO = "auto"
ENGINE_CHOICES = (AUTO, *ENGINES)
"""What ``model.attention`` and the commands' ``--attention`` accept: an engine, or ``auto``."""


def resolve_engine(name: str, device: torch.device | str | None = None) -> str:
    """The engine that ``name`` runs on ``device``: ``auto`` is ``flex`` on a CUDA device and ``torch``
    anywhere else; an engine's own name is kept as given (whether it can run there is checked where it
    is used: ``models.loading.check_model_settings``, the commands). ``device`` None: the device this
    process trains on, CUDA when one is visible (``torch.cuda.is_available()``, the choice DeepSpeed's
    accelerator makes), else the CPU. ValueError for an unknown name."""
    if name == AUTO:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return "flex" if torch.device(device).type == "cuda" else "torch"
    if name not in ENGINES:
        raise ValueError(f"unknown attention engine {name!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    return name


def tree_attention(
    query, key, value, kv_end, scale=None, engine: str = "torch", *, positions=None, window=None, softcap=None
) -> torch.Tensor:
    """``[B, Hq, N, D]``, ``[B, Hkv, N, D]`` x2, ``kv_end [B, N]`` -> ``[B, N, Hq, D]``.

    ``window`` (None: unlimited) limits query ``q`` to keys with ``positions[q] - positions[k] <
    window`` (``positions [B, N]``: the depths); ``softcap`` caps the scaled scores (reference module).
    """
    try:
        function = ENGINES[engine]
    except KeyError:
        raise ValueError(f"unknown attention engine {engine!r}; choose one of {sorted(ENGINES)}") from None
    return function(query, key, value, kv_end, scale, positions=positions, window=window, softcap=softcap)


FORWARD_ONLY = {"flex": "cpu"}
"""Engines without a backward on a device type: torch 2.13's FlexAttention on the CPU."""
CUDA_ONLY = {"varlen"}
"""Engines with no kernel at all off CUDA: the flash kernels (flash-attn's, torch's varlen_attn)."""


def has_backward(engine: str, device: torch.device | str = "cpu") -> bool:
    """Whether ``engine`` can train (has a backward) on ``device``: not flex on the CPU, varlen on CUDA only."""
    kind = torch.device(device).type
    return FORWARD_ONLY.get(engine) != kind and (engine not in CUDA_ONLY or kind == "cuda")


def implementation_name(engine: str) -> str:
    """The ``attn_implementation`` string under which ``engine`` is registered."""
    if engine not in ENGINES:
        raise ValueError(f"unknown attention engine {engine!r}; choose one of {sorted(ENGINES)}")
    return f"tree_{engine}"


def _hf_attention(engine: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        kv_end = kwargs.get("kv_end")
        if kv_end is None:
            raise ValueError(
                f"attention {implementation_name(engine)!r} needs `kv_end` among the model's forward kwargs "
                "(pass the packed row's kv_end, shape [batch, tokens])"
            )
        if dropout:
            raise ValueError("tree attention does not implement attention dropout; set attention_dropout=0")
        window, positions = kwargs.get("sliding_window"), kwargs.get("position_ids")
        if window is not None:
            if positions is None:
                raise ValueError(
                    f"{module.__class__.__name__} uses a sliding window ({window}): tree attention needs the tokens' "
                    "depths, pass the packed row's position_ids to the model's forward"
                )
            positions = positions.to(query.device).expand(query.shape[0], -1)
        return tree_attention(
            query,
            key,
            value,
            kv_end.to(query.device),
            scaling,
            engine,
            positions=positions,
            window=window,
            softcap=kwargs.get("softcap"),
        ), None

    return attention


def register_tree_attention() -> None:
    """Register every engine with transformers (idempotent)."""
    from transformers import AttentionInterface

    for engine in ENGINES:
        AttentionInterface.register(implementation_name(engine), _hf_attention(engine))
