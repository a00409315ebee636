"""Spreading tree parts over ranks so every rank finishes a step at about the same time.

Cost model: ``cost = cost_per_token * tokens + cost_per_pair * visible attention pairs`` (the
linear layers scale with tokens, attention with the pairs the tree mask allows). Parts are
assigned longest-processing-time first to the least-loaded rank, then each rank packs its parts
into rows. Parts of one tree may land on different ranks: each carries its ancestor path, so no
attention crosses ranks (the split mode of docs/DESIGN.md section 5; not Ulysses sequence parallelism).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ds_tree.packing.parts import TreePart
from ds_tree.packing.rows import PackedRow, assemble_row, pack_rows


def part_cost(part: TreePart, cost_per_token: float, cost_per_pair: float) -> float:
    return cost_per_token * part.n_tokens + cost_per_pair * part.visible_pairs


def lpt_shares(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """``world_size`` ascending lists of indices of ``costs`` with near-equal totals (greedy LPT).

    Largest cost first (ties in index order), each to the least-loaded rank, ties to the rank with fewer
    items, then to the lowest rank. A heap of ``(load, items, rank)`` pops exactly that rank, so a step of
    ``P`` parts costs ``P log W``, not ``P x W``. Depends on the costs alone: every rank that has them (the
    whole step's, or the summaries of :mod:`ds_tree.packing.distributed`) computes the same shares.
    """
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    heap = [(0.0, 0, rank) for rank in range(world_size)]  # sorted, so already a heap
    assignment: list[list[int]] = [[] for _ in range(world_size)]
    for index in order:
        load, count, rank = heap[0]
        assignment[rank].append(index)
        heapq.heapreplace(heap, (load + costs[index], count + 1, rank))
    return [sorted(members) for members in assignment]


def balance_parts(parts: list[TreePart], world_size: int, cost_per_token: float, cost_per_pair: float):
    """``world_size`` lists of parts with near-equal total cost (:func:`lpt_shares`)."""
    costs = [part_cost(part, cost_per_token, cost_per_pair) for part in parts]
    return [[parts[i] for i in members] for members in lpt_shares(costs, world_size)]


def rows_per_rank(
    parts: list[TreePart],
    world_size: int,
    budget: int,
    block: int = 1,
    cost_per_token: float = 1.0,
    cost_per_pair: float = 0.0,
    pad_id: int = 0,
) -> list[list[PackedRow]]:
    """Each rank's rows for one step, padded with empty rows to the same count on every rank.

    ZeRO-3 gathers parameters collectively in every forward, so all ranks must run the same
    number of micro-batches; an empty row (one padding token, weight 0) costs next to nothing.
    """
    shares = balance_parts(parts, world_size, cost_per_token, cost_per_pair)
    rows = [pack_rows(share, budget, block, pad_id) if share else [] for share in shares]
    count = max(1, max(len(r) for r in rows))
    return [r + [assemble_row([], block, pad_id) for _ in range(count - len(r))] for r in rows]
