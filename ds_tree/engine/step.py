"""Forward and backward of packed rows: the computation every mode and entry point shares."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from ds_tree.losses.sft import Normalisers, restoration_weights, weighted_nll
from ds_tree.models.logprobs import logprobs_at, predicted_tokens, target_logprobs
from ds_tree.models.moe import RouterAuxLoss, captured_router_logits
from ds_tree.packing.rows import PackedRow


@dataclass
class StepOutput:
    loss: float = 0.0
    """Sum over rows of the (unscaled) weighted loss: the global objective's share of these rows
    (with ``router_aux``: plus its coefficient times ``router_aux``)."""
    router_aux: float | None = None
    """These rows' share of the router load-balancing loss, before its coefficient (MoE models only)."""
    trajectory_logprobs: dict[int, np.ndarray] = field(default_factory=dict)
    """``id(trajectory) -> log p`` of its tokens 1.. (only when asked for)."""


def run_rows(
    model: PreTrainedModel,
    rows: Sequence[PackedRow],
    normalisers: Normalisers,
    normalisation: str = "token_mean",
    policy: str = "exact",
    *,
    backward: Callable[[torch.Tensor], None] | None = None,
    collect_logprobs: bool = False,
    device: torch.device | str = "cpu",
    head_chunk: int = 0,
    router_aux: RouterAuxLoss | None = None,
) -> StepOutput:
    """Forward every row, and hand each row's loss to ``backward`` (e.g. ``Tensor.backward``).

    Only tokens with a non-zero weight reach the LM head, unless ``collect_logprobs`` asks for
    every trajectory's log-probabilities (then every predicted token does). A row with nothing to
    train (an empty padding row) still runs forward and backward with a zero loss: under ZeRO-3
    every rank must take part in the same number of forwards and backwards. ``head_chunk``: see
    :mod:`ds_tree.models.logprobs`. ``router_aux`` adds the router load-balancing loss
    (:mod:`ds_tree.models.moe`) to each row's loss.
    """
    output = StepOutput(router_aux=None if router_aux is None else 0.0)
    for row in rows:
        weights = restoration_weights(row, normalisers, normalisation, policy)
        targets = predicted_tokens(row) if collect_logprobs else np.flatnonzero(weights)
        with captured_router_logits(model, enabled=router_aux is not None) as router_logits:
            if targets.size == 0:
                logprobs = logprobs_at(
                    model, row, np.zeros(1, dtype=np.int64), row.input_ids[:1], device, head_chunk=head_chunk
                )
                loss = weighted_nll(logprobs, np.zeros(1))
            else:
                logprobs = target_logprobs(model, row, targets, device, head_chunk=head_chunk)
                loss = weighted_nll(logprobs, weights[targets])
        if router_aux is not None:
            aux = router_aux.row_share(router_logits, row)
            loss = loss + router_aux.coefficient * aux.to(loss.dtype)
            output.router_aux += float(aux.detach())
        if backward is not None:
            backward(loss)
        output.loss += float(loss.detach())
        if collect_logprobs:  # every trajectory, even a 1-token one with nothing to predict
            by_token = np.full(row.n_tokens, np.nan)
            if targets.size:
                by_token[targets] = logprobs.detach().double().cpu().numpy()
            for part, trajectory_id, path in row.trajectory_paths():
                output.trajectory_logprobs[id(part.tree.trajectories[trajectory_id])] = by_token[path[1:]]
    return output
