"""Vision-language models on trees: Qwen2.5-VL (``qwen2_5_vl``) and Qwen3-VL (``qwen3_vl``).

The language model gets the tree attention, the vision tower keeps its own and encodes each distinct
image of a row once (:mod:`ds_tree.models.vision`). Their image processor settings (the published ones, with
small pixel limits: ``ds-tree make-tokenizer --vision FAMILY``) are their specs' ``vision``.
"""

from __future__ import annotations

from ds_tree.models.families.spec import FamilySpec
from ds_tree.vocab.vision_processor import VisionFamily

QWEN2_5_VL = FamilySpec("qwen2_5_vl", vision=VisionFamily("qwen2_5_vl", patch_size=14))
QWEN3_VL = FamilySpec(
    "qwen3_vl", vision=VisionFamily("qwen3_vl", patch_size=16, min_pixels=32 * 32, max_pixels=64 * 32 * 32)
)
