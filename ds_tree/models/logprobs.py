"""Forward of packed rows and per-target log-probabilities.

The decoder runs once over the packed row (tree attention, tree positions). Hidden states are
then gathered at ``pred_pos`` of the requested target tokens *before* the LM head (the model's
own ``logits_to_keep`` with indices), so the head and the softmax run on exactly one row per
target: a fork position that predicts several children appears once per child, and untrained
tokens cost nothing.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from ds_tree.packing.rows import PackedRow


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
    predictors = row.pred_pos[targets]
    if np.any(predictors < 0):
        raise ValueError("a target token has no prediction (a root's first token or padding)")
    return logprobs_at(model, row, predictors, row.input_ids[targets], device)


def logprobs_at(
    model: PreTrainedModel,
    row: PackedRow,
    predictors: np.ndarray,
    labels: np.ndarray,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``log p(labels[j])`` from the hidden state at row position ``predictors[j]``.

    ``model`` may be the DeepSpeed engine itself: its forward does the ZeRO bookkeeping
    (ZeRO-3 counts micro-steps there to accumulate rather than overwrite gradients).
    ``logits_to_keep`` given as indices makes the model apply its LM head to those rows only.
    """
    return logprobs_and_entropy_at(model, row, predictors, labels, device, entropy=False)[0]


def logprobs_and_entropy_at(
    model: PreTrainedModel,
    row: PackedRow,
    predictors: np.ndarray,
    labels: np.ndarray,
    device: torch.device | str = "cpu",
    *,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_at` and, with ``entropy``, the entropy of each predicted distribution.

    The entropy ``-sum_v p_v log p_v`` is taken at ``predictors[j]``: a fork position that predicts
    several targets contributes once per target, as each flat trajectory through it would.
    """
    index = torch.as_tensor(predictors, device=device)
    logits = model(**row.tensors(device), logits_to_keep=index, use_cache=False).logits[0]
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    log_softmax = torch.log_softmax(logits, dim=-1)
    target = torch.as_tensor(labels, device=device)
    logprobs = log_softmax.gather(-1, target[:, None])[:, 0]
    if not entropy:
        return logprobs, None
    return logprobs, -(log_softmax.exp() * log_softmax).sum(-1)


def predicted_tokens(row: PackedRow) -> np.ndarray:
    """Row indices of every token that has a prediction (all but roots' first tokens and padding)."""
    return np.flatnonzero(row.pred_pos >= 0)
