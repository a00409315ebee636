"""The SFT objective's accumulation over a rank's work items: the one call every entry point makes.

:func:`run_rows` gives each item its restoration-weighted NLL (:func:`~ds_tree.losses.terms.sft_terms`)
and runs the items with their kinds' runners (:func:`~ds_tree.engine.runners.run_items`): packed rows
and sequence-parallel shards at once, walked trees chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from ds_tree.engine.dfs import DfsSettings, WalkStats
from ds_tree.engine.runners import RunContext, StepOutput, run_items
from ds_tree.losses.sft import Normalisers, restoration_weights
from ds_tree.losses.terms import sft_terms
from ds_tree.models.logprobs import predicted_tokens
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.packing.rows import PackedRow

__all__ = ["StepOutput", "global_normalisers", "run_rows"]


def global_normalisers(rows: Sequence[PackedRow]) -> Normalisers:
    """This rank's :meth:`~ds_tree.losses.sft.Normalisers.from_rows` summed over all ranks (one all-reduce of
    three float64 scalars, before the step's first forward): every row's loss is then a term of the global
    objective."""
    values = Normalisers.from_rows(rows).as_tensor()
    dist.all_reduce(values)
    return Normalisers.from_tensor(values)


def run_rows(
    model: PreTrainedModel,
    rows: Sequence[PackedRow],
    normalisers: Normalisers,
    normalisation: str = "token_mean",
    policy: str = "exact",
    *,
    backward: Callable[[torch.Tensor], None] | None = None,
    backward_for: Callable[[int], Callable[[torch.Tensor], None]] | None = None,
    dfs: DfsSettings | None = None,
    collect_logprobs: bool = False,
    device: torch.device | str = "cpu",
    head_chunk: int = 0,
    router_aux: RouterAuxLoss | None = None,
    stats: WalkStats | None = None,
) -> StepOutput:
    """Forward every item of ``rows`` and hand its SFT loss to ``backward``.

    Only tokens with a non-zero weight reach the LM head, unless ``collect_logprobs`` asks for
    every trajectory's log-probabilities (then every predicted token of a packed row does). An item
    with nothing to train (an empty padding row) still runs forward and backward with a zero loss:
    under ZeRO-3 every rank must take part in the same number of forwards and backwards.
    ``backward_for(n)`` gives the ``backward`` of ``n`` calls instead of one ``backward``;
    ``dfs``: how walked items (:class:`~ds_tree.packing.dfs_rows.DfsRow`) are walked.
    ``head_chunk``: see :mod:`ds_tree.models.logprobs`. ``router_aux`` adds the router
    load-balancing loss (:mod:`ds_tree.models.moe`) to each item's loss.
    """
    terms = []
    for row in rows:
        weights = restoration_weights(row, normalisers, normalisation, policy)
        terms.append(sft_terms(weights, predicted_tokens(row) if collect_logprobs else None))
    run = RunContext(device, head_chunk, dfs, router_aux, collect_logprobs, stats)
    if backward_for is None:
        backward_for = lambda _: backward or (lambda loss: None)  # noqa: E731
    return run_items(model, rows, terms, run, backward_for)
