"""The Triton kernels' ``list`` schedule visits what the dense mask says, tile by tile.

``tile_lists`` classifies each ``block_m x block_n`` tile of the scores from per-block bounds; here
every tile is classified again by brute force from the dense boolean mask (``visibility_mask``) and
the two must agree: a full tile is exactly one whose pairs are all visible (both blocks whole), a
listed tile holds a visible pair exactly when ``block_n`` divides ``block_m`` and there is no window
(otherwise the lists only have to be sound: no visible pair left out), the lists ascend, each
visible pair's tile is listed once, and the dK/dV kernel's per-key-block lists are the transpose.
Pure torch: no Triton needed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree.attention.reference import visibility_mask
from ds_tree.kernel.block_stats import block_stats
from ds_tree.kernel.tile_lists import SCHEDULES, backward_tile_lists, classify_tiles, compact, query_tile_lists
from ds_tree.registries import ATTENTION_ENGINES
from tests.helpers.strategies import forests, longest
from tests.test_attention import _rows_kv_end

# (block_m, block_n): the interpreter's 16x16, the GPU's 128x64 and 64x64 scaled down, and shapes
# where block_n does not divide block_m (the lists are then only sound, not exact).
BLOCKS = [(16, 16), (4, 2), (2, 2), (8, 4), (2, 4), (3, 5)]


def brute_force(kv_end, positions, window, block_m, block_n) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any visible, all visible with both blocks whole)`` per tile, ``[B, query blocks, key blocks]``."""
    mask = visibility_mask(kv_end, positions, window)
    batch, n = kv_end.shape
    rows, columns = -(-n // block_m), -(-n // block_n)
    any_visible = torch.zeros(batch, rows, columns, dtype=torch.bool)
    all_visible = torch.zeros_like(any_visible)
    for i in range(rows):
        for j in range(columns):
            tile = mask[:, i * block_m : (i + 1) * block_m, j * block_n : (j + 1) * block_n]
            any_visible[:, i, j] = tile.flatten(1).any(-1)
            if tile.shape[1:] == (block_m, block_n):
                all_visible[:, i, j] = tile.flatten(1).all(-1)
    return any_visible, all_visible


def listed_sets(lists) -> tuple[torch.Tensor, torch.Tensor]:
    """The full and partial lists back as boolean ``[B, rows, columns]``, checking their form on the way."""
    found = []
    for indices, counts in ((lists.full, lists.full_counts), (lists.partial, lists.partial_counts)):
        assert indices.dtype == counts.dtype == torch.int32 and indices.is_contiguous()
        dense = torch.zeros(indices.shape, dtype=torch.bool)
        for b in range(indices.shape[0]):
            for row in range(indices.shape[1]):
                count = int(counts[b, row])
                entries = indices[b, row, :count].tolist()
                assert entries == sorted(set(entries)), "a list ascends without repeats"
                assert (indices[b, row, count:] == -1).all(), "past its count a list holds -1"
                dense[b, row, entries] = True
        found.append(dense)
    return found[0], found[1]


def check(kv_end, positions, window, block_m, block_n) -> None:
    any_visible, all_visible = brute_force(kv_end, positions, window, block_m, block_n)
    full, partial = listed_sets(query_tile_lists(kv_end, block_m, block_n, positions, window))
    assert not (full & partial).any(), "a tile is full or partial, not both"
    assert torch.equal(full, all_visible), "full tiles are exactly the wholly visible ones"
    listed = full | partial
    assert not (any_visible & ~listed).any(), "a tile holding a visible pair is listed"
    if window is None and block_m % block_n == 0:
        assert torch.equal(listed, any_visible), "without a window, listed tiles hold a visible pair"
    # the backward: one classification, per query block for dQ and per key block for dK/dV
    query_lists, key_lists = backward_tile_lists(kv_end, block_m, block_n, positions, window)
    assert [torch.equal(a, b) for a, b in zip(listed_sets(query_lists), (full, partial), strict=True)] == [True] * 2
    key_full, key_partial = listed_sets(key_lists)
    assert torch.equal(key_full, full.transpose(1, 2)) and torch.equal(key_partial, partial.transpose(1, 2))


@settings(max_examples=40, deadline=None)
@given(forests(), st.data(), st.sampled_from(BLOCKS))
def test_lists_match_the_dense_mask_tile_by_tile(trajectories, data, blocks):
    """Hypothesis forests (several trees and split parts per row, padding, ragged last blocks), with
    and without a window on the depths."""
    budget = data.draw(st.integers(longest(trajectories), max(longest(trajectories), 120)), "budget")
    pad_block = data.draw(st.sampled_from([1, 8, 16]), "pad_block")
    kv_end, positions = _rows_kv_end(trajectories, budget, pad_block, data.draw(st.integers(1, 2), "batch"))
    depth = int(positions.max()) + 1
    window = data.draw(st.one_of(st.none(), st.integers(1, depth + 1)), "window")
    check(kv_end, positions, window, *blocks)


@pytest.mark.parametrize("block_m,block_n", [blocks for blocks in BLOCKS if max(blocks) < 16])
def test_every_class_appears_on_a_forest_with_padding(block_m, block_n):
    """A hand-made row with full, partial and empty tiles and a ragged last block: the brute force
    agrees, and the row really meets all three classes (so the test above can see each go wrong)."""
    # a 12-token root, two 6-token children (the second with a 3-token child), a 7-token root, 2 pads
    kv_end = torch.tensor([[27] * 12 + [18] * 6 + [27] * 6 + [27] * 3 + [34] * 7 + [35, 36]])
    positions = visibility_mask(kv_end).sum(-1) - 1
    for window in (None, 5):
        check(kv_end, positions, window, block_m, block_n)
    listed, full = classify_tiles(kv_end, block_m, block_n)
    assert full.any() and (listed & ~full).any() and (~listed).any()


def test_lists_count_what_block_stats_counts():
    """block_stats (bench-kernel's figures) and the lists classify with the same rules."""
    kv_end = torch.tensor([[9] * 4 + [6, 6] + [9] * 3 + [12] * 3 + [13]])
    lists = query_tile_lists(kv_end, 4, 2)
    stats = block_stats(kv_end, 4, 2)
    assert int(lists.full_counts.sum()) == stats["fully_visible_tiles"] > 0
    assert int(lists.full_counts.sum() + lists.partial_counts.sum()) == stats["visited_tiles"]


def test_compact_keeps_the_order_and_fills_the_rest():
    mask = torch.tensor([[[False, True, False, True, True], [False] * 5, [True] * 5]])
    indices, counts = compact(mask)
    assert counts.tolist() == [[3, 0, 5]]
    assert indices.tolist() == [[[1, 3, 4, -1, -1], [-1] * 5, [0, 1, 2, 3, 4]]]


def test_the_triton_engine_offers_every_tile_schedule():
    """gpu-check checks each schedule the engine's capabilities list: all of the kernel's, its default first."""
    assert ATTENTION_ENGINES.get("triton").tile_schedules == SCHEDULES
