"""Trees -> parts (split with co-located prefixes) -> packed rows."""

from ds_tree.packing.bins import first_fit_decreasing
from ds_tree.packing.parts import TreePart, check_fits, make_part, split_tree, whole_tree
from ds_tree.packing.rows import PackedRow, assemble_row, pack_rows

__all__ = [
    "PackedRow",
    "TreePart",
    "assemble_row",
    "check_fits",
    "first_fit_decreasing",
    "make_part",
    "pack_rows",
    "split_tree",
    "whole_tree",
]
