"""Gated DeltaNet hybrids: Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``) and Qwen3-Next (``qwen3_next``).

Their ``linear_attention`` layers run per tree node (:mod:`ds_tree.models.hybrid`); their RMSNorm scales by
``1 + weight`` (Gemma's) and their gated norm normalises, scales, then multiplies by ``silu(gate)``: both
without the float32 casts in a float64 model. The MoE variants route with a softmax-top-k router.
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from ds_tree.models.families.spec import FamilySpec, RecurrentSpec
from ds_tree.models.float64 import gemma_rms_norm_float64
from ds_tree.models.hybrid import gated_delta_net_forward, gated_delta_sizes, qwen3_next_gated_delta_net_forward


def gated_norm_float64(self, hidden_states, gate):
    """Qwen3.5's gated RMSNorm (normalise, scale, then ``* silu(gate)``) without its float32 casts."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
    return hidden_states * ACT2FN[self.activation](gate)


def _family(model_type: str, mixer: str, forward, norm: str, gated_norm: str, routers: tuple[str, ...] = ()):
    recurrent = RecurrentSpec(
        mixer="Gated DeltaNet",
        tree_forwards={mixer: forward},
        sizes=gated_delta_sizes,
        head_fields=("linear_num_value_heads", "linear_num_key_heads"),
        cache_layers=(DynamicLayer.__name__, LinearAttentionLayer.__name__),
    )
    norms = {norm: gemma_rms_norm_float64, gated_norm: gated_norm_float64}
    return FamilySpec(model_type, recurrent, norms, routers=routers)


QWEN3_5 = _family(
    "qwen3_5_text", "Qwen3_5GatedDeltaNet", gated_delta_net_forward, "Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"
)
QWEN3_5_MOE = _family(
    "qwen3_5_moe_text",
    "Qwen3_5MoeGatedDeltaNet",
    gated_delta_net_forward,
    "Qwen3_5MoeRMSNorm",
    "Qwen3_5MoeRMSNormGated",
    routers=("Qwen3_5MoeTopKRouter",),
)
QWEN3_NEXT = _family(
    "qwen3_next",
    "Qwen3NextGatedDeltaNet",
    qwen3_next_gated_delta_net_forward,
    "Qwen3NextRMSNorm",
    "Qwen3NextRMSNormGated",
    routers=("Qwen3NextTopKRouter",),
)
