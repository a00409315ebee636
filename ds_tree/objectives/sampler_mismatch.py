"""``rollout/logprob_mismatch``: how far the sampler's log-probs are from the trainer's (docs/ROLLOUTS.md).

Online RL samples with one engine (a gathered copy of the policy, or a vLLM server) and trains with
another (the packed tree forward of the DeepSpeed engine). Both should give one number per sampled
token with the same weights; the gap is round-off on the same kernels, more across engines (vLLM's
kernels, bfloat16). With ``objective.old_logprobs: recompute`` the trainer's log-probs of each step's
sampled tokens, computed before its updates with the weights that sampled them, are ``logp_old``: the
mean and max of |sampler - trainer| over the sampled tokens of the step, all ranks, come for free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ds_tree.objectives.rl_rows import RLRow, trajectory_copies


def row_mismatch(item: RLRow) -> np.ndarray:
    """|sampler - trainer| of each trained token of ``item`` that carries a sampler log-prob (each token once)."""
    at = np.full(item.row.n_tokens, -1, dtype=np.int64)
    at[item.targets] = np.arange(item.targets.size)
    seen = np.zeros(item.row.n_tokens, dtype=bool)
    found = []
    for trajectory, in_row in trajectory_copies(item.row):
        if trajectory.logprobs is None:
            continue
        rows, sampler = in_row[1:], trajectory.logprobs[1:]
        keep = (rows >= 0) & np.isfinite(sampler)
        rows, sampler = rows[keep], sampler[keep]
        keep = (at[rows] >= 0) & ~seen[rows]
        rows, sampler = rows[keep], sampler[keep]
        seen[rows] = True
        found.append(np.abs(sampler - np.asarray(item.logp_old, dtype=np.float64)[at[rows]]))
    return np.concatenate(found) if found else np.zeros(0)


def mismatch_scalars(prepared: Sequence[Sequence[RLRow]]) -> dict[str, float]:
    """``rollout/logprob_mismatch`` (mean) and ``rollout/logprob_mismatch_max`` over every rank's rows
    (a collective when a process group is up: every rank calls it)."""
    diffs = [row_mismatch(item) for rows in prepared for item in rows]
    values = np.concatenate(diffs) if diffs else np.zeros(0)
    sums = torch.tensor([float(values.sum()), float(values.size)], dtype=torch.float64)
    worst = torch.tensor([float(values.max()) if values.size else 0.0], dtype=torch.float64)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    total, count = sums.tolist()
    return {
        "rollout/logprob_mismatch": total / count if count else float("nan"),
        "rollout/logprob_mismatch_max": float(worst) if count else float("nan"),
    }
