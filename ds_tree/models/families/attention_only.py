"""Families that need nothing beyond transformers' attention interface, in the test matrix
(tests/test_model_matrix.py): Llama, Qwen2 (sliding layers included), Qwen3, Mistral and Phi-3.

Their specs are :data:`~ds_tree.models.families.spec.PLAIN`'s under their names: a model type that is not
registered runs the same way; registering them says they are tested.
"""

from __future__ import annotations

from ds_tree.models.families.spec import FamilySpec

LLAMA = FamilySpec("llama")
QWEN2 = FamilySpec("qwen2")
QWEN3 = FamilySpec("qwen3")
MISTRAL = FamilySpec("mistral")
PHI3 = FamilySpec("phi3")
