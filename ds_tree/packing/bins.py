"""First-fit-decreasing bin packing: the one packer behind tree parts (child subtrees beside their
ancestor chain) and rows (parts under the token budget)."""

from __future__ import annotations


def first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins (sorted lists of item indices) for items of ``sizes``; each bin's total is <= capacity.

    Items go largest first (ties in index order) into the first bin with room; bins come out in
    the order they were opened. An item larger than ``capacity`` gets a bin of its own: callers
    check sizes first.
    """
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    used: list[int] = []
    for item in order:
        for position, total in enumerate(used):
            if total + sizes[item] <= capacity:
                bins[position].append(item)
                used[position] += sizes[item]
                break
        else:
            bins.append([item])
            used.append(sizes[item])
    return [sorted(members) for members in bins]
