"""On-policy distillation's divergences between a student ``q`` and a teacher ``p`` (``objective.kind:
distill``; docs/RL.md, "On-policy distillation").

``reverse_kl_sampled`` is no divergence computed here: the reverse KL's gradient estimated on the sampled
tokens, ``-sum_t c_t (log p(s_t) - log q_old(s_t)) grad log q(s_t)``, is the clipped policy-gradient objective
(:mod:`ds_tree.losses.rl`) with the per-token advantage ``A_t = log p(s_t) - log q_old(s_t)`` (Agarwal et al.
2024, arXiv 2306.13649; Qwen3's on-policy distillation). ``A_t`` depends on the token's context only, so every
trajectory through a tree token has it: the sign split's sums restore it exactly.

The others compare the two whole distributions at the context of every trained token (GKD's losses):
``kl`` ``KL(p || q)``, ``reverse_kl`` ``KL(q || p)``, ``jsd`` the generalised Jensen-Shannon divergence
``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``. Each is a function of the
context, weighed by the token's restoration weight ``sum_i c_i`` as SFT's loss is; :func:`divergence` takes
both log-softmax rows of a chunk of targets, so the vocabulary is never materialised for a whole row.
"""

from __future__ import annotations

import math

import torch

LOSSES = ("reverse_kl_sampled", "kl", "jsd", "reverse_kl")
FULL_VOCABULARY = ("kl", "jsd", "reverse_kl")
"""The losses over the whole vocabulary (the others need the teacher's log-prob of the sampled token only)."""


def divergence(student: torch.Tensor, teacher: torch.Tensor, loss: str, beta: float = 0.5) -> torch.Tensor:
    """``[n]``: the divergence ``loss`` (module docstring) between rows of log-probabilities ``[n, vocab]``,
    ``student`` (differentiable) and ``teacher``."""
    teacher = teacher.to(student.dtype)
    if loss == "kl":
        return (teacher.exp() * (teacher - student)).sum(-1)
    if loss == "reverse_kl":
        return (student.exp() * (student - teacher)).sum(-1)
    if loss == "jsd":
        if not 0 < beta < 1:
            raise ValueError(f"the jsd's beta must be in (0, 1), got {beta}")
        mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1 - beta)]), dim=0)
        to_teacher = (teacher.exp() * (teacher - mixture)).sum(-1)
        to_student = (student.exp() * (student - mixture)).sum(-1)
        return beta * to_teacher + (1 - beta) * to_student
    raise ValueError(f"a full-vocabulary divergence is one of {FULL_VOCABULARY}, got {loss!r}")
