"""Tree attention: the ``kv_end`` mask contract and its engines."""

from ds_tree.attention.blocksparse import blocksparse_tree_attention
from ds_tree.attention.reference import tree_attention_reference, visibility_mask
from ds_tree.attention.registry import ENGINES, implementation_name, register_tree_attention, tree_attention

__all__ = [
    "ENGINES",
    "blocksparse_tree_attention",
    "implementation_name",
    "register_tree_attention",
    "tree_attention",
    "tree_attention_reference",
    "visibility_mask",
]
