"""Forward of packed rows and per-target log-probabilities.

The decoder runs once over the packed row (tree attention, tree positions). Hidden states are
then gathered at ``pred_pos`` of the requested target tokens *before* the LM head, so the head
and the softmax run on exactly one row per target: a fork position that predicts several
children appears once per child, and untrained tokens cost nothing.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from ds_tree.packing.rows import PackedRow


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    return getattr(model, model.base_model_prefix)


def target_logprobs(
    model: PreTrainedModel,
    row: PackedRow,
    targets: np.ndarray,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``log p(input_ids[t] | context of t)`` for every row index ``t`` in ``targets``.

    Every target must have ``pred_pos[t] >= 0``. Computed in float32 or wider, whatever the model
    dtype (a bf16 log-softmax over a large vocabulary loses about 3 digits).
    """
    tensors = row.tensors(device)
    hidden = decoder_of(model)(**tensors, use_cache=False).last_hidden_state[0]
    predictors = torch.as_tensor(row.pred_pos[targets], device=hidden.device)
    logits = model.get_output_embeddings()(hidden.index_select(0, predictors))
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    labels = torch.as_tensor(row.input_ids[targets], device=hidden.device)
    return -torch.nn.functional.cross_entropy(logits, labels, reduction="none")


def predicted_tokens(row: PackedRow) -> np.ndarray:
    """Row indices of every token that has a prediction (all but roots' first tokens and padding)."""
    return np.flatnonzero(row.pred_pos >= 0)
