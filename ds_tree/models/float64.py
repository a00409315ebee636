"""What a float64 model needs where transformers computes in float32: its norms and its logits.

transformers' RMSNorm casts its input to float32 (to protect bf16 training). In a float64 model that
silently rounds every hidden state to float32 precision in the backward, so a prefix gradient summed
over branches differs from the flat per-branch sum by ~3e-8 relative: the float64 oracle would only be
a float32 one. The replacements are the same formulas without the cast: a family's own norms
(:attr:`~ds_tree.models.families.spec.FamilySpec.float64_norms`: Gemma's ``1 + weight`` variant, the
hybrids' gated norms), and :func:`rms_norm_float64` for every other ``...RMSNorm`` with a
``variance_epsilon``. A family whose model forward casts the logits to float32 (Nemotron-H) names a
forward without the cast (``float64_forwards``).
"""

from __future__ import annotations

import torch

from ds_tree.models.families import family_of_model


def rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def gemma_rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm (scales by ``1 + weight``, its epsilon named ``eps``; Qwen3.5's and Qwen3-Next's too)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return hidden_states * torch.rsqrt(variance + self.eps) * (1.0 + self.weight)


def keep_norms_in_float64(model: torch.nn.Module) -> int:
    """Make the norm layers compute in float64 when the model is float64 (module docstring); returns how many."""
    norms = family_of_model(model).float64_norms
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if name in norms:
            module.forward = norms[name].__get__(module)
            patched += 1
        elif name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = rms_norm_float64.__get__(module)
            patched += 1
    return patched


def keep_logits_in_float64(model: torch.nn.Module) -> bool:
    """Replace a forward that casts a float64 model's logits to float32 by the family's own without the cast
    (module docstring); whether it did."""
    forward = family_of_model(model).float64_forwards.get(type(model).__name__)
    if forward is not None:
        model.forward = forward.__get__(model)
    return forward is not None
