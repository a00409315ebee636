"""Time the Triton tree-attention kernel: one packed tree row against its flat equivalent.

The same forest of trajectories is laid out twice (docs/DESIGN.md section 2), each as one row of the
packer: tree (DFS pre-order, shared prefixes once) and flat (every root-to-leaf path its own
sequence). Forward + backward of the tree kernel on the tree row is timed against
``flash_attn_varlen_func(causal=True)`` on the flat row when flash-attn is installed (else the tree
kernel on the flat row), with ``triton.testing.do_bench`` (median and 20th/80th percentiles in
milliseconds), and reported with TFLOP/s on each layout's useful FLOPs (``4 * D * visible pairs``
per query head forward, 2.5x that backward) and ``block_stats`` of both rows. Under the Triton
interpreter (no GPU) one call is timed with a wall clock instead: a smoke run, times meaningless.
With ``flex``, the flex engine (PyTorch's FlexAttention on the same ``kv_end`` mask) is timed on
both rows as well: forward + backward, compiled, on a GPU; on the CPU its forward alone, eager
(each entry's ``timed`` says which, and its TFLOP/s count only the passes timed).
"""

from __future__ import annotations

import time

import torch

from ds_tree.kernel import kernels
from ds_tree.kernel.block_stats import block_stats
from ds_tree.kernel.function import triton_tree_attention
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.trajectory import Trajectory

BACKWARD_FLOPS_FACTOR = 2.5  # FlashAttention-2 convention: backward = 2.5x the forward matmuls
QUANTILES = (0.5, 0.2, 0.8)


def _row_inputs(kv_end: torch.Tensor, heads: int, kv_heads: int, head_dim: int, dtype, device, requires_grad: bool):
    """One row's random query, key and value leaves ``[1, H, N, D]``, a random output gradient
    ``[1, N, Hq, D]``, and ``kv_end`` as ``[1, N]``, on ``device``."""
    n = kv_end.shape[-1]
    leaves = [
        torch.randn(1, count, n, head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
        for count in (heads, kv_heads, kv_heads)
    ]
    grad = torch.randn(1, n, heads, head_dim, dtype=dtype, device=device)
    return leaves, grad, kv_end[None].to(device)


def tree_kernel_step(kv_end: torch.Tensor, heads: int, kv_heads: int, head_dim: int, dtype, device):
    """Forward + backward of the Triton kernel on one row, and the leaves whose grads it fills."""
    leaves, grad, kv_end = _row_inputs(kv_end, heads, kv_heads, head_dim, dtype, device, requires_grad=True)
    return (lambda: triton_tree_attention(*leaves, kv_end).backward(grad)), leaves


def flex_step(kv_end: torch.Tensor, heads: int, kv_heads: int, head_dim: int, dtype, device, backward: bool):
    """The flex engine (:mod:`ds_tree.attention.flex`) on one row: forward + backward, or the
    forward alone (under no_grad) where FlexAttention has no backward (the CPU)."""
    from ds_tree.attention.flex import flex_tree_attention

    leaves, grad, kv_end = _row_inputs(kv_end, heads, kv_heads, head_dim, dtype, device, requires_grad=backward)
    if backward:
        return (lambda: flex_tree_attention(*leaves, kv_end).backward(grad)), leaves

    def forward():
        with torch.no_grad():
            flex_tree_attention(*leaves, kv_end)

    return forward, leaves


def flash_attn_step(lengths: list[int], heads: int, kv_heads: int, head_dim: int, dtype):
    """Forward + backward of flash-attn's varlen causal kernel on the flat layout, and its leaves."""
    from flash_attn import flash_attn_varlen_func

    total = sum(lengths)
    leaves = [
        torch.randn(total, count, head_dim, dtype=dtype, device="cuda", requires_grad=True)
        for count in (heads, kv_heads, kv_heads)
    ]
    grad = torch.randn(total, heads, head_dim, dtype=dtype, device="cuda")
    cu_seqlens = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    longest = max(lengths)
    return (
        lambda: flash_attn_varlen_func(*leaves, cu_seqlens, cu_seqlens, longest, longest, causal=True).backward(grad)
    ), leaves


def milliseconds(step, leaves, smoke: bool, warmup_ms: int, rep_ms: int) -> dict:
    """``ms`` (median), ``ms_p20`` and ``ms_p80`` of one forward + backward."""
    if smoke:
        started = time.perf_counter()
        step()
        elapsed = (time.perf_counter() - started) * 1e3
        return {"ms": elapsed, "ms_p20": elapsed, "ms_p80": elapsed}
    from triton.testing import do_bench

    median, low, high = do_bench(step, warmup=warmup_ms, rep=rep_ms, grad_to_none=leaves, quantiles=list(QUANTILES))
    return {"ms": median, "ms_p20": low, "ms_p80": high}


def measure(name: str, timed: dict, kv_end: torch.Tensor, heads: int, head_dim: int, backward: bool = True) -> dict:
    block_m, block_n = kernels.block_sizes(head_dim)["forward"]
    stats = block_stats(kv_end, block_m, block_n)
    flops = (1 + (BACKWARD_FLOPS_FACTOR if backward else 0)) * 4 * head_dim * stats["useful_elements"] * heads
    return {
        "engine": name,
        "timed": "forward+backward" if backward else "forward only",
        "tokens": kv_end.shape[-1],
        **timed,
        "useful_tflops": flops / (timed["ms"] * 1e-3) / 1e12,
        "block_stats": {"block_m": block_m, "block_n": block_n, **stats},
    }


def benchmark_kernel(
    trajectories: list[Trajectory],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    smoke: bool,
    warmup_ms: int = 25,
    rep_ms: int = 100,
    flex: bool = False,
) -> dict:
    """``tree`` and ``flat`` measurements and ``flat_over_tree_time`` for one forest; with ``flex``
    also ``flex_tree`` and ``flex_flat``, the flex engine on both rows (forward only on the CPU,
    eager: FlexAttention has no backward there)."""
    device = "cpu" if smoke else "cuda"
    budget = sum(len(t) for t in trajectories)  # one row per layout
    (tree_row,) = pack_trajectories(trajectories, "tree", budget)
    (flat_row,) = pack_trajectories(trajectories, "flat", budget)
    tree, flat = torch.as_tensor(tree_row.kv_end), torch.as_tensor(flat_row.kv_end)
    try:
        import flash_attn  # noqa: F401

        lengths = [part.n_tokens for part in flat_row.parts]
        flat_engine, flat_step = "flash_attn_varlen", flash_attn_step(lengths, heads, kv_heads, head_dim, dtype)
    except ImportError:
        flat_engine, flat_step = "triton_tree", tree_kernel_step(flat, heads, kv_heads, head_dim, dtype, device)
    tree_step = tree_kernel_step(tree, heads, kv_heads, head_dim, dtype, device)
    results = {
        "tree": measure("triton_tree", milliseconds(*tree_step, smoke, warmup_ms, rep_ms), tree, heads, head_dim),
        "flat": measure(flat_engine, milliseconds(*flat_step, smoke, warmup_ms, rep_ms), flat, heads, head_dim),
    }
    results["flat_over_tree_time"] = results["flat"]["ms"] / results["tree"]["ms"]
    if flex:
        backward = device != "cpu"
        for layout, kv_end in (("tree", tree), ("flat", flat)):
            step = flex_step(kv_end, heads, kv_heads, head_dim, dtype, device, backward)
            timed = milliseconds(*step, smoke, warmup_ms, rep_ms)
            results[f"flex_{layout}"] = measure("flex", timed, kv_end, heads, head_dim, backward)
    return results
