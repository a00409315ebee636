"""One ``tree_attention`` entry point over the registered engines, and its transformers registration.

The engines are :data:`ds_tree.registries.ATTENTION_ENGINES`' entries, each an
:class:`~ds_tree.attention.engines.AttentionEngine` (its function and capabilities): ``reference`` (dense
mask, any dtype: the oracle), ``torch`` (block-sparse, the CPU default), ``triton`` (the GPU kernel,
:mod:`ds_tree.kernel`; on a machine without a GPU only under ``TRITON_INTERPRET=1``), ``flex`` (PyTorch's
FlexAttention on the same mask; forward only on the CPU, ``flex.py``) and ``varlen`` (the flat baseline on
flash kernels: flat rows only, CUDA only, ``varlen.py``). ``auto`` (:func:`resolve_engine`) is the engine
whose ``auto_on`` names the device type: ``flex`` on CUDA, ``torch`` on the CPU.
Each is registered in transformers' ``AttentionInterface`` as ``tree_<engine>``; a model built
with that ``attn_implementation`` receives ``kv_end`` (and ``position_ids``) as forward kwargs and
runs unchanged otherwise. A layer that passes ``sliding_window`` (Mistral, Qwen2/3 sliding
layers, Gemma2/3 local layers) gets the window rule on the tree depths, ``position_ids``; one that
passes ``softcap`` (Gemma2) gets capped scores, on every engine (varlen: with flash-attn only).
"""

from __future__ import annotations

import torch

from ds_tree.attention.engines import AttentionEngine, auto_engine, registered
from ds_tree.registries import ATTENTION_ENGINES

AUTO = "auto"


def attention_engine(name: str) -> AttentionEngine:
    """The registered engine ``name`` (its function and capabilities); ValueError for an unknown name."""
    if name not in ATTENTION_ENGINES:
        choices = ", ".join(ATTENTION_ENGINES.choices(AUTO).names())
        raise ValueError(f"unknown attention engine {name!r}; choose one of {choices}")
    return ATTENTION_ENGINES.get(name)


def _device_type(device: torch.device | str | None) -> str:
    """``device``'s type; None: the device this process trains on, CUDA when one is visible
    (``torch.cuda.is_available()``, the choice DeepSpeed's accelerator makes), else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def resolve_engine(name: str, device: torch.device | str | None = None) -> str:
    """The engine that ``name`` runs on ``device``: ``auto`` is the engine whose ``auto_on`` names the
    device's type (``flex`` on CUDA, ``torch`` on the CPU and any other type); an engine's own name is kept
    as given (whether it can run there is checked where it is used, from its capabilities:
    ``models.loading.check_model_settings``, the commands). ``device`` None: the device this process trains
    on (:func:`_device_type`). ValueError for an unknown name."""
    if name != AUTO:
        attention_engine(name)
        return name
    return auto_engine(_device_type(device))


def tree_engines() -> tuple[str, ...]:
    """The engines that train on tree rows (the oracle aside): what a message offers instead of one that cannot."""
    return tuple(name for name, engine in registered() if engine.tree_rows and not engine.oracle)


def flat_engine(device: torch.device | str) -> str | None:
    """The flat-rows-only engine that runs on ``device`` (the flat baseline a user runs there: flash kernels
    on a GPU), None where none does."""
    kind = _device_type(device)
    return next((name for name, engine in registered() if engine.flat_rows_only and engine.runs_on(kind)), None)


def tree_attention(
    query, key, value, kv_end, scale=None, engine: str = "torch", *, positions=None, window=None, softcap=None
) -> torch.Tensor:
    """``[B, Hq, N, D]``, ``[B, Hkv, N, D]`` x2, ``kv_end [B, N]`` -> ``[B, N, Hq, D]``.

    ``window`` (None: unlimited) limits query ``q`` to keys with ``positions[q] - positions[k] <
    window`` (``positions [B, N]``: the depths); ``softcap`` caps the scaled scores (reference module).
    """
    function = attention_engine(engine).function
    return function(query, key, value, kv_end, scale, positions=positions, window=window, softcap=softcap)


def has_backward(engine: str, device: torch.device | str = "cpu") -> bool:
    """Whether ``engine`` can train (has a backward) on ``device`` (its ``backward`` capability)."""
    return attention_engine(engine).trains_on(torch.device(device).type)


def implementation_name(engine: str) -> str:
    """The ``attn_implementation`` string under which ``engine`` is registered."""
    attention_engine(engine)
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

    for engine in ATTENTION_ENGINES.names():
        AttentionInterface.register(implementation_name(engine), _hf_attention(engine))
