"""Compile the tree kernels for a GPU architecture on a machine without one, and summarise what came out.

``triton.compile`` with an explicit ``GPUTarget`` runs Triton's whole pipeline down to a cubin (with the
``ptxas`` shipped in the Triton wheel) without a GPU or a CUDA driver. The summary says whether the
kernel fits (shared memory) and whether its key/query loop was software-pipelined: Triton turns the
loads of a pipelined loop into asynchronous copies (``async_copy_global_to_local`` or TMA), and a
branch (``scf.if``) in a loop body keeps it from doing so. This is how the ``list`` tile schedule is
checked on the CPU (tests/test_triton_ahead_of_time.py); the timings need the GPU (docs/KERNEL.md).

Needs ``TRITON_INTERPRET`` unset when Triton is first imported (the interpreter replaces the kernels).
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ds_tree.kernel import kernels

KERNELS = {"forward": kernels._forward_kernel, "query": kernels._query_kernel, "key_value": kernels._key_value_kernel}
"""The kernels with a tile loop (the delta preprocess has none)."""
INT32_POINTERS = {
    "KV_END",
    "BLOCK_MAX_END",
    "BLOCK_MIN_END",
    "FULL_TILES",
    "FULL_COUNTS",
    "PARTIAL_TILES",
    "PARTIAL_COUNTS",
    "POSITIONS",
    "QUERY_MAX_POS",
    "QUERY_MIN_POS",
    "KEY_MAX_POS",
    "KEY_MIN_POS",
}
FLOAT32_POINTERS = {"LSE", "DELTA"}
FLOAT_SCALARS = {"qk_scale", "scale", "softcap"}
TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _signature(function, dtype: str) -> dict:
    """Triton's type string per runtime argument: upper-case names are pointers (q/k/v/out/gradients in
    ``dtype``), lower-case ones int32 scalars but for the float ones."""
    found = {}
    for name, parameter in zip(function.arg_names, function.params, strict=True):
        if parameter.is_constexpr:
            continue
        if name.isupper():
            found[name] = "*i32" if name in INT32_POINTERS else "*fp32" if name in FLOAT32_POINTERS else f"*{dtype}"
        else:
            found[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return found


def compile_kernel(
    kernel: str,
    tile_schedule: str,
    *,
    dtype: str = "bfloat16",
    head_dim: int = 128,
    config: dict | None = None,
    window: bool = False,
    softcap: bool = False,
    arch: int = 90,
) -> dict:
    """Compile ``kernel`` (a key of :data:`KERNELS`) for ``sm_<arch>``; ``config`` defaults to the GPU
    defaults (``kernels.block_sizes``). Returns ``shared_bytes``, ``async_copies`` (pipelined loads),
    ``branches`` (``scf.if`` in the kernel) and ``tensor_core_dots``."""
    if kernels.INTERPRET:
        raise RuntimeError("compile_kernel needs TRITON_INTERPRET unset before triton is imported")
    config = config or kernels.block_sizes(head_dim)
    block_m, block_n = config["forward" if kernel == "forward" else "backward"]
    constants = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "HEAD_DIM": head_dim,
        "INTERPRET_BF16": False,
        "DOT_PRECISION": "ieee" if dtype == "float32" else "tf32",
        "HAS_WINDOW": window,
        "HAS_SOFTCAP": softcap,
        "TILE_LIST": tile_schedule == "list",
    }
    function = KERNELS[kernel]
    signature = _signature(function, TYPES[dtype]) | dict.fromkeys(constants, "constexpr")
    compiled = triton.compile(
        ASTSource(function, signature, constants),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]},
    )
    ir = compiled.asm["ttgir"]
    return {
        "kernel": kernel,
        "tile_schedule": tile_schedule,
        "shared_bytes": compiled.metadata.shared,
        "async_copies": len(re.findall(r"async_copy_global_to_local|async_tma_copy", ir)),
        "branches": ir.count("scf.if"),
        "tensor_core_dots": ir.count("warp_group_dot") + ir.count("tt.dot "),
    }
