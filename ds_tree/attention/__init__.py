"""Tree attention: the ``kv_end`` mask contract (``reference.py``), its engines and their registry
(``engines.py``, ``registry.py``: ``tree_attention``, the transformers registration).

Importing the package imports nothing: the engines' capabilities are read without torch
(:mod:`ds_tree.attention.engines`).
"""
