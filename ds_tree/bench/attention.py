"""Time the CPU tree-attention engine alone on the packed rows of one training step, tree vs flat.

The first step's groups are packed in both modes (as a training step would pack them); every row
gets random q/k/v (float32) and one forward + backward of :func:`blocksparse_tree_attention` is
timed per row: one attention layer's work for the whole step. Both modes alternate within each
repeat; the report gives the minimum and the median (first repeat left out as warm-up) in
milliseconds, and per mode the visible (query, key) pairs and the scores the plan computes.
Another engine with a CPU kernel can be timed instead (the flex engine: forward only, see :func:`time_attention`).
"""

from __future__ import annotations

import statistics
import time

import torch

from ds_tree.attention.blocksparse import DEFAULT_BLOCK, HUB_MIN_KEYS, HUB_MIN_QUERIES, block_plan
from ds_tree.attention.engines import cpu_engines
from ds_tree.attention.registry import attention_engine
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

    ``engine``: one of :func:`~ds_tree.attention.engines.cpu_engines`. One without a CPU backward (``flex``:
    FlexAttention, eager) is timed forward only, under no_grad, and ``timed`` says ``forward only``;
    ``computed_scores`` is None for an engine that does not tile by the block plan (eager FlexAttention
    computes every score of the row).
    ``block`` and the hub options go to the engine that tiles by the plan (``torch``).
    """
    if engine not in cpu_engines():
        raise ValueError(f"engine must be one of {', '.join(cpu_engines())}, got {engine!r}")
    spec = attention_engine(engine)
    tuning = dict(block=block, hub_min_keys=hub_min_keys, hub_min_queries=hub_min_queries) if spec.block_plan else {}
    backward = spec.trains_on("cpu")
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
                q, k, v = (x.clone().requires_grad_(backward) for x in qkv)
                started = time.perf_counter()
                with torch.set_grad_enabled(backward):
                    output = spec.function(q, k, v, kv_end, **tuning)
                if backward:
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
            "computed_scores": sum(plan.computed_scores() for plan in plans) if spec.block_plan else None,
            "timed": "forward+backward" if backward else "forward only",
        }
    return report
