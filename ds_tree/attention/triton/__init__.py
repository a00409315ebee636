"""Triton tree attention: FlashAttention-2 style kernels for the ``kv_end`` tree mask."""

from ds_tree.attention.triton.function import triton_tree_attention

__all__ = ["triton_tree_attention"]
