"""Model families: one :class:`~ds_tree.models.families.spec.FamilySpec` per family, one file per family or
closely related group, registered in :data:`ds_tree.registries.MODEL_FAMILIES` under the config's
``model_type`` (docs/MODELS.md, "Adding a model family").

=====================  ====================================================================
file                   families
=====================  ====================================================================
attention_only.py      llama, qwen2, qwen3, mistral, phi3: nothing beyond the attention interface
gemma.py               gemma, gemma2, gemma3_text (float64 norms); gemma3, gemma3n, paligemma (refused)
mixture_of_experts.py  mixtral, qwen2_moe, qwen3_moe: softmax-top-k routers
gated_delta_net.py     qwen3_5_text, qwen3_5_moe_text, qwen3_next: Gated DeltaNet hybrids
mamba2.py              bamba, nemotron_h, falcon_h1: Mamba2 hybrids
qwen_vl.py             qwen2_5_vl, qwen3_vl: vision-language models
=====================  ====================================================================

The family files are imported by the registry on a lookup, never by this package.
"""

from ds_tree.models.families.spec import PLAIN, FamilySpec, RecurrentSpec, families_with, family_of, family_of_model

__all__ = ["PLAIN", "FamilySpec", "RecurrentSpec", "families_with", "family_of", "family_of_model"]
