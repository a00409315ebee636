"""Mamba2 hybrids: Bamba (``bamba``), Nemotron-H (``nemotron_h``) and Falcon-H1 (``falcon_h1``).

Their Mamba2 layers run per tree node (:mod:`ds_tree.models.hybrid`; Falcon-H1 runs a Mamba2 mixer and
attention side by side in every layer, one combined cache layer; Nemotron-H has MLP-only layers, whose
cache layer holds nothing). In a float64 model their grouped gated norms compute without the float32
casts, and Nemotron-H's forward without its float32 cast of the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from ds_tree.models.families.spec import FamilySpec, RecurrentSpec
from ds_tree.models.hybrid import mamba2_forward, mamba2_sizes


def gated_norm_gate_first_float64(self, hidden_states, gate=None):
    """Bamba's grouped gated RMSNorm (``* silu(gate)`` first, then per group) without its float32 casts."""
    if gate is not None:
        hidden_states = hidden_states * F.silu(gate)
    *prefix, last = hidden_states.shape
    grouped = hidden_states.view(*prefix, last // self.group_size, self.group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * grouped.view(*prefix, last)


def falcon_h1_gated_norm_float64(self, hidden_states, gate=None):
    """Falcon-H1's grouped gated RMSNorm (gate before or after, by ``norm_before_gate``) without its float32 casts."""
    if not self.norm_before_gate and gate is not None:
        hidden_states = hidden_states * F.silu(gate)
    *prefix, last = hidden_states.shape
    grouped = hidden_states.view(*prefix, self.n_groups, last // self.n_groups)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    hidden_states = (self.weight.view(self.n_groups, -1) * grouped).view(*prefix, last)
    if self.norm_before_gate and gate is not None:
        hidden_states = hidden_states * F.silu(gate)
    return hidden_states


def nemotron_h_forward_float64(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    cache=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    """``NemotronHForCausalLM.forward`` without its ``.float()`` on the logits (which rounds a float64
    model's logits to float32); no ``labels`` (the trainer computes its own losses)."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    if labels is not None:
        raise ValueError("the float64 NemotronH forward computes no loss: pass no labels")
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    logits = self.lm_head(slice_logits_to_keep(outputs[0], logits_to_keep))
    return MoeCausalLMOutputWithPast(logits=logits, cache=outputs.cache, router_logits=outputs.router_logits)


def _recurrent(mixer_class: str, head_fields: tuple[str, str], cache_layers: tuple[type, ...]) -> RecurrentSpec:
    return RecurrentSpec(
        mixer="Mamba2",
        tree_forwards={mixer_class: mamba2_forward},
        sizes=mamba2_sizes,
        head_fields=head_fields,
        cache_layers=tuple(layer.__name__ for layer in cache_layers),
    )


BAMBA = FamilySpec(
    "bamba",
    _recurrent("BambaMixer", ("mamba_n_heads", "mamba_n_groups"), (DynamicLayer, LinearAttentionLayer)),
    float64_norms={"BambaRMSNormGated": gated_norm_gate_first_float64},
)
NEMOTRON_H = FamilySpec(
    "nemotron_h",
    _recurrent(
        "NemotronHMamba2Mixer", ("mamba_num_heads", "n_groups"), (DynamicLayer, LinearAttentionLayer, DummyLayer)
    ),
    float64_norms={"NemotronHRMSNormGated": gated_norm_gate_first_float64},
    float64_forwards={"NemotronHForCausalLM": nemotron_h_forward_float64},
)
FALCON_H1 = FamilySpec(
    "falcon_h1",
    _recurrent("FalconH1Mixer", ("mamba_n_heads", "mamba_n_groups"), (LinearAttentionAndFullAttentionLayer,)),
    float64_norms={"FalconH1RMSNormGated": falcon_h1_gated_norm_float64},
)
