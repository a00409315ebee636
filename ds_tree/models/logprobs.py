"""Forward of packed rows and per-target log-probabilities.

The decoder runs once over the packed row (tree attention, tree positions). Hidden states are
then gathered at ``pred_pos`` of the requested target tokens *before* the LM head (the model's
own ``logits_to_keep`` with indices), so the head and the softmax run on exactly one row per
target: a fork position that predicts several children appears once per child, and untrained
tokens cost nothing.

With ``head_chunk > 0`` the head, log-softmax and entropy run over chunks of that many targets,
each inside a non-reentrant :func:`torch.utils.checkpoint.checkpoint`: a chunk's ``[chunk, vocab]``
logits are freed after its forward and recomputed in the backward, so the head's peak memory is
``head_chunk x vocab`` instead of ``targets x vocab``. Same numbers as the unchunked head (each
target's softmax row is computed alone either way). The chunks run inside the model's single call
of its head module (its ``forward`` replaced for that call), so the model's forward, the DeepSpeed
engine's and ZeRO-3's module hooks see exactly what they see unchunked.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from ds_tree.models.families import family_of
from ds_tree.packing.rows import PackedRow

# Gemma's ``final_logit_softcapping`` is the one transform of the logits after ``lm_head`` that the
# chunked head takes: the chunks apply it themselves, with the model's own operations in the model's
# order, while the model's forward sees it switched off (:func:`logprobs_and_entropy_at`).
SOFTCAP = "final_logit_softcapping"


def check_head_chunking(config) -> None:
    """Refuse a model whose logits are more than ``lm_head(hidden)`` (the chunked head applies ``lm_head``
    alone): a config field its family lists in ``logit_transforms`` (Cohere's and Granite's scaling) set to
    another value than those that leave the logits unchanged."""
    for name, identities in family_of(config).logit_transforms.items():
        value = getattr(config, name, None)
        if value not in identities:
            raise ValueError(f"model.head_chunk: this model transforms its logits ({name}={value}); set head_chunk=0")


def target_logprobs(
    model: PreTrainedModel,
    row: PackedRow,
    targets: np.ndarray,
    device: torch.device | str = "cpu",
    *,
    head_chunk: int = 0,
) -> torch.Tensor:
    """``log p(input_ids[t] | context of t)`` for every row index ``t`` in ``targets``.

    Every target must have ``pred_pos[t] >= 0``. Computed in float32 or wider, whatever the model
    dtype (a bf16 log-softmax over a large vocabulary loses about 3 digits).
    """
    predictors = row.pred_pos[targets]
    if np.any(predictors < 0):
        raise ValueError("a target token has no prediction (a root's first token or padding)")
    return logprobs_at(model, row, predictors, row.input_ids[targets], device, head_chunk=head_chunk)


def logprobs_at(
    model: PreTrainedModel,
    row: PackedRow,
    predictors: np.ndarray,
    labels: np.ndarray,
    device: torch.device | str = "cpu",
    *,
    head_chunk: int = 0,
) -> torch.Tensor:
    """``log p(labels[j])`` from the hidden state at row position ``predictors[j]``.

    ``model`` may be the DeepSpeed engine itself: its forward does the ZeRO bookkeeping
    (ZeRO-3 counts micro-steps there to accumulate rather than overwrite gradients).
    ``logits_to_keep`` given as indices makes the model apply its LM head to those rows only;
    ``head_chunk > 0`` applies it ``head_chunk`` targets at a time (module docstring).
    """
    return logprobs_and_entropy_at(model, row, predictors, labels, device, entropy=False, head_chunk=head_chunk)[0]


def logprobs_and_entropy_at(
    model: PreTrainedModel,
    row: PackedRow,
    predictors: np.ndarray,
    labels: np.ndarray,
    device: torch.device | str = "cpu",
    *,
    entropy: bool | str | Statistic | None = True,
    head_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_at` and, with ``entropy``, the entropy of each predicted distribution
    (``"metric"``: without a graph, for a loss that only reports it), or with a :data:`Statistic` that
    statistic instead, computed on the same chunks of the head.

    The entropy ``-sum_v p_v log p_v`` is taken at ``predictors[j]``: a fork position that predicts
    several targets contributes once per target, as each flat trajectory through it would.
    """
    index = torch.as_tensor(predictors, device=device)
    target = torch.as_tensor(labels, device=device)
    if head_chunk <= 0:
        logits = model(**row.tensors(device), logits_to_keep=index, use_cache=False).logits[0]
        return _head_outputs(logits, target, entropy, slice(None))
    # One call of the head module per forward, as unchunked: ZeRO-3 gathers its weight in that
    # call's hooks (and again before its backward, where the chunks are recomputed), and every
    # rank must make the same calls whatever its number of targets.
    with _head_replaced(
        model, lambda head, softcap: functools.partial(_chunked_head, head, target, head_chunk, entropy, softcap)
    ):
        outputs = model(**row.tensors(device), logits_to_keep=index, use_cache=False).logits[0]
    return outputs[:, 0], outputs[:, 1] if entropy else None


@torch.no_grad()
def hidden_states_at(
    model: PreTrainedModel, row: PackedRow, predictors: np.ndarray, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[len(predictors), hidden]``: the final hidden states at row positions ``predictors``, what the LM head
    would take (no gradient): a frozen model's forward whose head a caller applies later, chunk by chunk
    (on-policy distillation's teacher, :class:`HeadOf`). Its head module is called once, on the hidden
    states, and returns them (``forward`` replaced for the call: ZeRO-3's hooks stay)."""
    index = torch.as_tensor(predictors, device=device)
    with _head_replaced(model, lambda head, softcap: lambda hidden: hidden):
        return model(**row.tensors(device), logits_to_keep=index, use_cache=False).logits[0]


@contextlib.contextmanager
def _head_replaced(model, forward_of):
    """While inside, the LM head module's ``forward`` is ``forward_of(head, softcap)``, and the model does not
    soft-cap its head's outputs (the replacement caps logits itself where it makes them). Only ``forward`` is
    replaced, for this call: the module's hooks stay."""
    causal_lm = getattr(model, "module", model)  # the DeepSpeed engine wraps the Hugging Face model
    check_head_chunking(causal_lm.config)
    head = causal_lm.get_output_embeddings()
    softcap = getattr(causal_lm.config, SOFTCAP, None)
    head.forward = forward_of(head, softcap)
    if softcap is not None:  # the replacement caps its logits; the model must not cap its outputs
        setattr(causal_lm.config, SOFTCAP, None)
    try:
        yield
    finally:
        del head.forward
        if softcap is not None:
            setattr(causal_lm.config, SOFTCAP, softcap)


@dataclass(frozen=True)
class HeadOf:
    """A model's LM head as a plain function of hidden states: its weight (and bias) and its final
    soft-capping, applied as :func:`_chunk_outputs` applies the model's own (on-policy distillation's
    teacher, whose hidden states :func:`hidden_states_at` gave)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None

    def log_softmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` log-probabilities (float32 or wider) of hidden states ``[n, hidden]``."""
        logits = torch.nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()
        return torch.log_softmax(logits, dim=-1)


def _chunked_head(
    head: torch.nn.Module,
    target: torch.Tensor,
    head_chunk: int,
    entropy: bool | str | Statistic | None,
    softcap: float | None,
    hidden: torch.Tensor,
) -> torch.Tensor:
    """``[1, targets, hidden]`` -> ``[1, targets, 2]``: each target's log-prob and entropy (or 0)."""
    chunks = [
        checkpoint(
            _chunk_outputs,
            head,
            hidden[0, start : start + head_chunk],
            target[start : start + head_chunk],
            entropy,
            softcap,
            slice(start, start + head_chunk),
            use_reentrant=False,
        )
        for start in range(0, max(len(target), 1), head_chunk)  # no target: one empty chunk, as unchunked
    ]
    logprobs = torch.cat([chunk[0] for chunk in chunks])
    entropies = torch.cat([chunk[1] for chunk in chunks]) if entropy else torch.zeros_like(logprobs)
    return torch.stack([logprobs, entropies], dim=-1)[None]


def _chunk_outputs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    target: torch.Tensor,
    entropy: bool | str | Statistic | None,
    softcap: float | None,
    rows: slice,
):
    """One chunk (the call's targets ``rows``): the head's class ``forward`` on the (gathered) weights,
    bypassing the module hooks, then the model's final soft-capping if it has one (Gemma 2:
    ``tanh(logits / cap) * cap``)."""
    logits = type(head).forward(head, hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return _head_outputs(logits, target, entropy, rows)


Statistic = Callable[[torch.Tensor, slice], torch.Tensor]
"""In place of the entropy, another statistic of each predicted distribution: ``statistic(log_softmax,
rows)`` gets the ``[n, vocab]`` log-probabilities of the call's targets ``rows`` (a chunk of them, or
``slice(None)``) and returns ``[n]`` values, differentiable (a divergence to a teacher's distribution at
the same targets: on-policy distillation)."""


def _head_outputs(
    logits: torch.Tensor, target: torch.Tensor, entropy: bool | str | Statistic | None, rows: slice
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    log_softmax = torch.log_softmax(logits, dim=-1)
    logprobs = log_softmax.gather(-1, target[:, None])[:, 0]
    if not entropy:
        return logprobs, None
    if callable(entropy):
        return logprobs, entropy(log_softmax, rows)
    if entropy == "metric":  # reported, not trained: no graph (it would hold a [targets, vocab] product)
        log_softmax = log_softmax.detach()
    return logprobs, -(log_softmax.exp() * log_softmax).sum(-1)


def predicted_tokens(row: PackedRow) -> np.ndarray:
    """Row indices of every token that has a prediction (all but roots' first tokens and padding)."""
    return np.flatnonzero(row.pred_pos >= 0)
