"""Time the CPU tree-attention engine alone on the packed rows of one training step, tree vs flat.

The first step's groups are packed in both modes (as a training step would pack them); every row
gets random q/k/v (float32) and one forward + backward of :func:`blocksparse_tree_attention` is
timed per row: one attention layer's work for the whole step. Both modes alternate within each
repeat; the report gives the minimum and the median (first repeat left out as warm-up) in
milliseconds, and per mode the visible (query, key) pairs and the scores the plan computes.
The flex engine can be timed instead, forward only (see :func:`time_attention`).
"""

from __future__ import annotations

import statistics
import time

import torch

from ds_tree.attention.blocksparse import (
    DEFAULT_BLOCK,
    HUB_MIN_KEYS,
    HUB_MIN_QUERIES,
    block_plan,
    blocksparse_tree_attention,
)
from ds_tree.data.sampler import StepSampler
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.trajectory import Trajectory, group_trajectories


def time_attention(
    trajectories: list[Trajectory],
    *,
    groups_per_step: int | None = None,
    budget: int = 4096,
    block: int = DEFAULT_BLOCK,
    hub_min_keys: int = HUB_MIN_KEYS,
    hub_min_queries: int = HUB_MIN_QUERIES,
    heads: int = 4,
    head_dim: int = 64,
    repeats: int = 8,
    engine: str = "torch",
) -> dict:
    """Per mode: rows, tokens, ``min_ms``, ``median_ms``, ``visible_pairs``, ``computed_scores``.

    ``engine`` ``flex`` times :mod:`ds_tree.attention.flex` instead, forward only (under no_grad:
    FlexAttention has no backward on the CPU) and eager; ``computed_scores`` is then None (eager
    FlexAttention computes every score of the row) and ``timed`` says ``forward only``.
    """
    if engine not in ("torch", "flex"):
        raise ValueError(f"engine must be torch or flex, got {engine!r}")
    if engine == "flex":
        from ds_tree.attention.flex import flex_tree_attention
    if repeats < 2:
        raise ValueError("repeats must be at least 2 (the first is a warm-up for the median)")
    groups = group_trajectories(trajectories)
    per_step = groups_per_step or len(groups)
    batch = StepSampler(len(groups), per_step, 0).trajectories_for_step(groups, 0)

    generator = torch.Generator().manual_seed(0)
    inputs = {}
    for mode in ("flat", "tree"):
        inputs[mode] = []
        for row in pack_trajectories(batch, mode, budget, 1):
            kv_end = torch.as_tensor(row.kv_end)[None]
            shape = (1, heads, row.n_tokens, head_dim)
            qkv = [torch.randn(shape, generator=generator) for _ in range(3)]
            grad = torch.randn(1, row.n_tokens, heads, head_dim, generator=generator)
            inputs[mode].append((kv_end, qkv, grad))

    times = {mode: [] for mode in inputs}
    for _ in range(repeats):
        for mode, rows in inputs.items():
            elapsed = 0.0
            for kv_end, qkv, grad in rows:
                if engine == "flex":
                    started = time.perf_counter()
                    with torch.no_grad():
                        flex_tree_attention(*qkv, kv_end)
                    elapsed += time.perf_counter() - started
                    continue
                q, k, v = (x.clone().requires_grad_() for x in qkv)
                started = time.perf_counter()
                output = blocksparse_tree_attention(
                    q, k, v, kv_end, block=block, hub_min_keys=hub_min_keys, hub_min_queries=hub_min_queries
                )
                output.backward(grad)
                elapsed += time.perf_counter() - started
            times[mode].append(elapsed * 1e3)

    report = {}
    for mode in inputs:
        plans = [block_plan(kv_end[0].numpy(), block, hub_min_keys, hub_min_queries) for kv_end, _, _ in inputs[mode]]
        report[mode] = {
            "rows": len(inputs[mode]),
            "tokens": sum(kv_end.shape[1] for kv_end, _, _ in inputs[mode]),
            "min_ms": min(times[mode]),
            "median_ms": statistics.median(times[mode][1:]),
            "visible_pairs": sum(plan.visible_pairs for plan in plans),
            "computed_scores": sum(plan.computed_scores() for plan in plans) if engine == "torch" else None,
            "timed": "forward+backward" if engine == "torch" else "forward only",
        }
    return report
