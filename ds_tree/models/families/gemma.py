"""Gemma: ``gemma``, ``gemma2`` and ``gemma3_text`` run on trees; their RMSNorm scales by ``1 + weight``
and names its epsilon ``eps``, and computes without its float32 cast in a float64 model. (Gemma 2's
attention and final-logit soft-capping and Gemma 2/3's sliding layers need nothing here: the tree
attention and the LM head take them from the model.)

Refused at load: the vision-language wrappers whose image tokens attend to each other bidirectionally
inside the language model (``gemma3``, ``gemma3n``, ``paligemma``); the tree mask is causal.
"""

from __future__ import annotations

from ds_tree.models.families.spec import FamilySpec
from ds_tree.models.float64 import gemma_rms_norm_float64

GEMMA = FamilySpec("gemma", float64_norms={"GemmaRMSNorm": gemma_rms_norm_float64})
GEMMA2 = FamilySpec("gemma2", float64_norms={"Gemma2RMSNorm": gemma_rms_norm_float64})
GEMMA3_TEXT = FamilySpec("gemma3_text", float64_norms={"Gemma3RMSNorm": gemma_rms_norm_float64})

GEMMA3 = FamilySpec("gemma3", bidirectional_images=True)
GEMMA3N = FamilySpec("gemma3n", bidirectional_images=True)
PALIGEMMA = FamilySpec("paligemma", bidirectional_images=True)
