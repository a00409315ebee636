"""Benchmark the Triton tree-attention kernel: one packed tree row against its flat equivalent.

The same random forest is laid out twice (DESIGN section 2):
- tree: DFS pre-order, ``kv_end`` = end of the token's subtree; shared prefixes appear once;
- flat: every root-to-leaf path as its own sequence, ``kv_end`` = end of that sequence.

On a GPU it times forward + backward of the tree kernel on the tree layout against
``flash_attn_varlen_func(causal=True)`` on the flat layout when flash-attn is installed (else the
tree kernel on the flat layout) and reports milliseconds, TFLOP/s on each layout's useful FLOPs
(``4 * D * visible pairs`` per query head forward, 2.5x that backward) and ``block_stats`` of both.
Without a GPU it runs the same measurement once under the Triton interpreter, as a smoke test
(``"smoke": true``; the times are meaningless there):

    python tools/bench_kernel.py --trees 2 --depth 3 --branching 2 --node-len 8
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# The interpreter must be chosen before torch or triton is imported, hence no torch.cuda here.
SMOKE = shutil.which("nvidia-smi") is None
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from ds_tree.attention.block_stats import block_stats  # noqa: E402
from ds_tree.attention.triton import kernels, triton_tree_attention  # noqa: E402

BACKWARD_FLOPS_FACTOR = 2.5  # FlashAttention-2 convention: backward = 2.5x the forward matmuls


def random_forest(rng: random.Random, trees: int, depth: int, branching: int, node_len: int) -> list[list]:
    """Trees as nested ``[length, children]`` lists: every root-to-leaf path has ``depth`` nodes,
    each inner node 1..branching children, node lengths uniform in [1, 2 * node_len - 1]."""

    def node(level: int) -> list:
        children = [] if level == depth else [node(level + 1) for _ in range(rng.randint(1, branching))]
        return [rng.randint(1, 2 * node_len - 1), children]

    return [node(1) for _ in range(trees)]


def tree_kv_end(forest: list[list]) -> list[int]:
    """DFS pre-order layout: each token's kv_end is the end of its node's subtree."""
    kv_end: list[int] = []

    def visit(node: list) -> None:
        start = len(kv_end)
        kv_end.extend([0] * node[0])
        for child in node[1]:
            visit(child)
        kv_end[start : start + node[0]] = [len(kv_end)] * node[0]

    for root in forest:
        visit(root)
    return kv_end


def path_lengths(forest: list[list]) -> list[int]:
    """Token count of every root-to-leaf path: the sequences of the flat layout."""

    def walk(node: list, prefix: int) -> list[int]:
        total = prefix + node[0]
        return [total] if not node[1] else [length for child in node[1] for length in walk(child, total)]

    return [length for root in forest for length in walk(root, 0)]


def flat_kv_end(lengths: list[int]) -> list[int]:
    kv_end: list[int] = []
    for length in lengths:
        kv_end += [len(kv_end) + length] * length
    return kv_end


def time_forward_backward(run, repeats: int, device: str) -> float:
    """Mean milliseconds of ``run()`` (forward + backward); on the GPU after a compiling warm-up."""
    if device == "cuda":
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats
    begin = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - begin) * 1e3 / repeats


def tree_kernel_step(kv_end: torch.Tensor, args, dtype: torch.dtype, device: str):
    """A forward + backward closure of the Triton kernel on one packed row."""
    n = kv_end.shape[-1]
    q, k, v = (
        torch.randn(1, heads, n, args.head_dim, dtype=dtype, device=device, requires_grad=True)
        for heads in (args.heads, args.kv_heads, args.kv_heads)
    )
    grad = torch.randn(1, n, args.heads, args.head_dim, dtype=dtype, device=device)
    kv_end = kv_end[None].to(device)
    return lambda: triton_tree_attention(q, k, v, kv_end).backward(grad)


def flash_attn_step(lengths: list[int], args, dtype: torch.dtype):
    """A forward + backward closure of flash-attn's varlen causal kernel on the flat layout."""
    from flash_attn import flash_attn_varlen_func

    total = sum(lengths)
    q, k, v = (
        torch.randn(total, heads, args.head_dim, dtype=dtype, device="cuda", requires_grad=True)
        for heads in (args.heads, args.kv_heads, args.kv_heads)
    )
    grad = torch.randn(total, args.heads, args.head_dim, dtype=dtype, device="cuda")
    cu_seqlens = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    longest = max(lengths)
    return lambda: flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True
    ).backward(grad)


def measure(name: str, step, kv_end: torch.Tensor, args, device: str) -> dict:
    repeats = 1 if SMOKE else args.repeats
    milliseconds = time_forward_backward(step, repeats, device)
    block_m, block_n = kernels.block_sizes(args.head_dim)["forward"]
    stats = block_stats(kv_end, block_m, block_n)
    flops = (1 + BACKWARD_FLOPS_FACTOR) * 4 * args.head_dim * stats["useful_elements"] * args.heads
    return {
        "engine": name,
        "tokens": kv_end.shape[-1],
        "ms": milliseconds,
        "useful_tflops": flops / (milliseconds * 1e-3) / 1e12,
        "block_stats": {"block_m": block_m, "block_n": block_n, **stats},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", type=int, default=8)
    parser.add_argument("--depth", type=int, default=4, help="nodes on every root-to-leaf path")
    parser.add_argument("--branching", type=int, default=3, help="most children of an inner node")
    parser.add_argument("--node-len", type=int, default=128, help="mean tokens per node")
    # The interpreter takes ~20 s per call at 32 heads of dim 128: smoke runs default smaller.
    parser.add_argument("--heads", type=int, default=4 if SMOKE else 32)
    parser.add_argument("--kv-heads", type=int, default=2 if SMOKE else 8)
    parser.add_argument("--head-dim", type=int, default=64 if SMOKE else 128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20, help="timed iterations (1 in a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()

    device = "cpu" if SMOKE else "cuda"
    dtype = getattr(torch, args.dtype)
    forest = random_forest(random.Random(args.seed), args.trees, args.depth, args.branching, args.node_len)
    tree = torch.tensor(tree_kv_end(forest))
    lengths = path_lengths(forest)
    flat = torch.tensor(flat_kv_end(lengths))
    torch.manual_seed(args.seed)

    try:
        import flash_attn  # noqa: F401

        flat_engine, flat_step = "flash_attn_varlen", flash_attn_step(lengths, args, dtype)
    except ImportError:
        flat_engine, flat_step = "triton_tree", tree_kernel_step(flat, args, dtype, device)

    results = {
        "smoke": SMOKE,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)",
        "config": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "tree": measure("triton_tree", tree_kernel_step(tree, args, dtype, device), tree, args, device),
        "flat": measure(flat_engine, flat_step, flat, args, device),
    }
    results["flat_over_tree_time"] = results["flat"]["ms"] / results["tree"]["ms"]
    report = json.dumps(results, indent=2)
    print(report)
    if args.json:
        args.json.write_text(report + "\n")


if __name__ == "__main__":
    main()
