"""The Triton tree-attention kernel (engine ``triton``): FlashAttention-2 style kernels for the ``kv_end``
tree mask (``kernels.py``), their autograd entry point (``function.py``: ``triton_tree_attention``), the tile
schedules and their statistics (``tile_lists.py``, ``block_stats.py``), GPU autotuning (``autotune.py``) and
compilation for a GPU target without one (``ahead_of_time.py``). docs/KERNEL.md describes them.

The package is kept apart from :mod:`ds_tree.attention` (the mask contract, the other engines and their
registry), which reaches it by name only (``ds_tree.attention.engines``): importing this package's
planners (tile lists, block statistics) does not import Triton.
"""
