"""The recurrent scans on flash-linear-attention's Triton kernels (``fla-core``), the GPU engine.

Drop-ins for :func:`ds_tree.scans.linear_scans.chunk_gated_delta_rule` and
:func:`~ds_tree.scans.linear_scans.chunk_mamba2`: same arguments, same results within float32
round-off, one initial state per batch row and the final state returned, gradients into both.
:func:`ds_tree.models.hybrid.scan_levels` calls them once per group of a tree level exactly as it
calls the torch scans (nodes right-padded with ``g = beta = 0`` / ``dt = 0``, which leave a state
unchanged in these kernels too), so branch-point states and conv windows need nothing new.

- Gated DeltaNet: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` with its q/k L2 norm in the
  kernel (the same ``x / sqrt(|x|^2 + 1e-6)``) and value heads grouped over key heads (GVA).
- Mamba2: ``fla.ops.simple_gla.chunk_simple_gla`` (``S_t = exp(g_t) S_{t-1} + k_t v_t^T``,
  ``o_t = scale S_t^T q_t``) with ``q = C``, ``k = B`` (groups repeated to heads), ``v = dt x``,
  ``g = dt A``, ``scale = 1``; its state is Mamba2's ``[P, N]`` transposed, and ``D x`` is added here.

Precision: inputs go to the kernels in float32 (the torch scans' compute dtype for float32/bf16
models, so both engines agree to float32 round-off); fla's kernels have no float64, so a float64
model (``verify``) is refused: the torch scans are its oracle.

The selection is ``model.recurrent_kernels`` (:data:`RECURRENT_KERNELS`, :func:`resolve_recurrent_kernels`):
``auto`` is ``torch`` for now: fla is checked under the Triton interpreter only, and becomes ``auto``'s
choice on CUDA (:data:`AUTO_PICKS_FLA`) once gpu-check's hybrid section has passed on a GPU. Nothing
imports ``fla`` until a scan runs on it, so the CPU path never needs the package.
"""

from __future__ import annotations

import importlib.util

import torch

from ds_tree.errors import ConfigError

RECURRENT_KERNELS = ("auto", "torch", "fla")
"""``model.recurrent_kernels`` choices: the engine of the hybrids' GDN and Mamba2 scans."""

AUTO_PICKS_FLA = False
"""Whether ``auto`` picks ``fla`` on CUDA (when importable, the model not float64). False until a GPU run of
``ds-tree gpu-check --sections hybrid`` shows fla equal to the torch scans (float32 round-off) and faster."""

FLA_INSTALL = "pip install --no-deps fla-core==0.6.0 einops  (or: pip install -e '.[fla]')"
"""How to install the kernels (``fla-core`` needs only ``einops`` beside torch and triton)."""


def fla_available() -> bool:
    """Whether ``fla`` (the ``fla-core`` package) can be imported."""
    return importlib.util.find_spec("fla") is not None


def resolve_recurrent_kernels(
    name: str, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> str:
    """``torch`` or ``fla`` for ``name`` on ``device`` (None: CUDA when visible, else the CPU) and model
    ``dtype``: ``auto`` is ``fla`` on CUDA when importable and the model is not float64; ``fla`` without the
    package, or for a float64 model, is a ConfigError (with the install command). ``auto`` picks ``fla`` only
    where :data:`AUTO_PICKS_FLA` says so (not yet: see the module docstring)."""
    if name not in RECURRENT_KERNELS:
        raise ConfigError(f"model.recurrent_kernels: {name!r} is not one of {', '.join(RECURRENT_KERNELS)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "auto":
        usable = AUTO_PICKS_FLA and torch.device(device).type == "cuda" and dtype != torch.float64 and fla_available()
        return "fla" if usable else "torch"
    if name == "fla" and not fla_available():
        raise ConfigError(f"model.recurrent_kernels: fla needs flash-linear-attention's kernels: {FLA_INSTALL}")
    if name == "fla" and dtype == torch.float64:
        raise ConfigError(FLOAT64_REFUSAL)
    return name


FLOAT64_REFUSAL = (
    "model.recurrent_kernels: fla: flash-linear-attention's kernels have no float64; a float64 model "
    "(verify) runs the torch scans (model.recurrent_kernels: torch or auto)"
)


def _float32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    if any(t.dtype == torch.float64 for t in tensors):
        raise ValueError(FLOAT64_REFUSAL)
    return [t.float().contiguous() for t in tensors]


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
    """:func:`ds_tree.scans.linear_scans.chunk_gated_delta_rule` on fla's kernel (its chunk is 64: ``chunk``
    must be 64). Output ``[B, T, Hv, Dv]`` in the input dtype, final state ``[B, Hv, Dk, Dv]`` in float32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gated_delta_rule

    if chunk != 64:
        raise ValueError(f"fla's gated delta rule runs chunks of 64 tokens, got chunk={chunk}")
    out_dtype = query.dtype
    query, key, value, g, beta = _float32(query, key, value, g, beta)
    initial = None if initial_state is None else _float32(initial_state)[0]
    output, final = fla_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        scale=key.shape[-1] ** -0.5,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2_norm_qk,
    )
    return output.to(out_dtype), final


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
    """:func:`ds_tree.scans.linear_scans.chunk_mamba2` on fla's ``chunk_simple_gla`` (module docstring).
    ``y`` ``[Bt, T, H, P]`` and the final state ``[Bt, H, P, N]``, both float32 (fla picks its own chunk
    of 64; ``chunk``, the model's, only shapes the torch scan's round-off)."""
    from fla.ops.simple_gla import chunk_simple_gla

    heads, groups = x.shape[2], B.shape[2]
    x, dt, A, B, C, D = _float32(x, dt, A, B, C, D)
    B, C = (t.repeat_interleave(heads // groups, dim=2) for t in (B, C))
    initial = None if initial_state is None else _float32(initial_state)[0].transpose(-1, -2).contiguous()
    output, final = chunk_simple_gla(
        C.contiguous(),
        B.contiguous(),
        (x * dt[..., None]).contiguous(),
        g=(dt * A).contiguous(),
        scale=1.0,
        initial_state=initial,
        output_final_state=True,
    )
    return output + x * D[:, None], final.transpose(-1, -2)
