"""Mixture-of-experts families with a softmax-top-k router: Mixtral (``mixtral``), Qwen2-MoE (``qwen2_moe``)
and Qwen3-MoE (``qwen3_moe``). Their routers have a float64 forward and the load-balancing loss
(:mod:`ds_tree.models.moe`); the hybrids' MoE variants declare theirs in their own files.
"""

from __future__ import annotations

from ds_tree.models.families.spec import FamilySpec

MIXTRAL = FamilySpec("mixtral", routers=("MixtralTopKRouter",))
QWEN2_MOE = FamilySpec("qwen2_moe", routers=("Qwen2MoeTopKRouter",))
QWEN3_MOE = FamilySpec("qwen3_moe", routers=("Qwen3MoeTopKRouter",))
