"""PPO's learned critic in ``verify`` (``--estimator gae --critic SOURCE``): its values, GAE and its gradient, tree vs
flat, from the same weights on the same data.

Two critics, as the RL check has two policies: the old one (the value model at ``seed``, or a value head on the old
policy's trunk for ``source: policy``), whose values before the update give GAE's baseline and the value clip's
centre, and the trained one (the same weights moved by the perturbation, the head on the trained policy's trunk),
whose loss and gradient are compared. Each layout scores the values on its own items (:meth:`CriticCheck.values`), so
the advantages each layout trains with are its own; the report compares the values, the value loss and every
critic gradient with the flat layout's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ds_tree.comparison import gradient_errors, metric_errors, relative_error
from ds_tree.engine.dfs import DfsSettings
from ds_tree.engine.runners import RunContext, StepOutput, run_items
from ds_tree.losses.advantages import batch_whitened, check_finite_statistics, estimate
from ds_tree.losses.rl import RLSettings
from ds_tree.model_roles.values import TrunkValueHead, load_value_model, policy_trunk, values_at
from ds_tree.objectives.critic import critic_values, returns_of, value_item_terms
from ds_tree.objectives.rl_rows import StepNormalisers
from ds_tree.trees.trajectory import Trajectory


@dataclass
class CriticResult:
    """One layout's critic: its values before the update, its loss and gradients after the perturbation."""

    values: dict[int, np.ndarray]
    loss: float
    gradients: dict[str, torch.Tensor]
    metrics: dict[str, float]


@dataclass
class CriticCheck:
    """The old and the trained critic of a check (module docstring)."""

    old: torch.nn.Module
    trained: torch.nn.Module
    value_clip: float
    gamma: float
    lam: float

    @classmethod
    def of(
        cls,
        source: str,
        *,
        old_policy: torch.nn.Module,
        policy: torch.nn.Module,
        attention: str,
        dtype: torch.dtype,
        seed: int,
        perturbation: float,
        value_clip: float,
        gamma: float,
        lam: float,
        perturb: Callable[[torch.nn.Module, float, int], None],
    ) -> CriticCheck:
        """The critics of ``source`` (``policy``: heads on the old and the trained policy's trunks), the trained one
        moved by ``perturb(module, perturbation, seed)`` (the policy's perturbation,
        :func:`~ds_tree.verify.tree_vs_flat.perturb_parameters`; its head only on a trunk)."""
        if source == "policy":
            hidden = policy.config.get_text_config().hidden_size
            old = TrunkValueHead(policy_trunk(old_policy), hidden, dtype, seed)
            trained = TrunkValueHead(policy_trunk(policy), hidden, dtype, seed)
            perturb(trained.score, perturbation, seed + 2)
        else:
            old = load_value_model(source, attention=attention, dtype=dtype, seed=seed)
            trained = load_value_model(source, attention=attention, dtype=dtype, seed=seed)
            perturb(trained, perturbation, seed + 2)
        old.requires_grad_(False)
        return cls(old, trained, value_clip, gamma, lam)

    def values(
        self, trajectories: list[Trajectory], rows, dfs: DfsSettings | None, merged: bool = True
    ) -> dict[int, np.ndarray]:
        """The old critic's values at every trained token, scored on ``rows`` (their layout; ``merged``: over the
        ranks, False for one process's baseline inside a group, :func:`~ds_tree.objectives.critic.critic_values`)."""
        return critic_values(self.old, trajectories, rows, RunContext("cpu", 0, dfs, head=values_at), merged)

    def advantages(self, trajectories: list[Trajectory], values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """GAE from ``values`` (statistics that overflow float64 refused as a data error)."""
        computed = estimate(trajectories, "gae", values=values, gamma=self.gamma, lam=self.lam)
        check_finite_statistics(trajectories, computed.values)
        return computed.by_trajectory()

    def run(
        self,
        trajectories: list[Trajectory],
        rows,
        values: dict[int, np.ndarray],
        advantages: dict[int, np.ndarray],
        settings: RLSettings,
        dfs: DfsSettings | None,
        backward=torch.Tensor.backward,
    ) -> StepOutput:
        """The trained critic's value loss of ``rows`` (one update's items, all of ``trajectories``), backwarded."""
        returns = returns_of(trajectories, advantages, values)
        terms = value_item_terms(rows, StepNormalisers.of(trajectories), returns, values, settings, self.value_clip)
        self.trained.zero_grad(set_to_none=True)
        run = RunContext("cpu", 0, dfs, head=values_at)
        return run_items(self.trained, rows, terms, run, lambda _: backward)

    def gradients(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in self.trained.named_parameters() if p.grad is not None}

    def result(self, trajectories, rows, values, advantages, settings, dfs) -> CriticResult:
        """:meth:`run` on one process: the loss, gradients and metric sums."""
        output = self.run(trajectories, rows, values, advantages, settings, dfs)
        return CriticResult(values, output.loss, self.gradients(), output.metrics or {})


def policy_advantages(
    trajectories: list[Trajectory], advantages: dict[int, np.ndarray], normalise: bool
) -> dict[int, np.ndarray]:
    """What the policy trains with: GAE's ``advantages``, whitened over the batch with ``normalise``
    (:func:`~ds_tree.losses.advantages.batch_whitened`); the critic's returns keep them as they are."""
    if not normalise:
        return advantages
    values = batch_whitened(trajectories, [advantages[id(t)] for t in trajectories])
    return {id(t): v for t, v in zip(trajectories, values, strict=True)}


def critic_errors(flat: CriticResult, other: CriticResult, prefix: str = "") -> dict:
    """The report's ``critic_*`` fields of ``other`` against ``flat`` (``prefix``: ``dfs_`` for the walked layout)."""
    errors = gradient_errors(flat.gradients, other.gradients)
    differences = np.concatenate([np.zeros(0)] + [np.abs(other.values[k] - flat.values[k]) for k in flat.values])
    value_error = float(differences[~np.isnan(differences)].max(initial=0.0))  # NaN: untrained tokens, no value
    report = {
        f"{prefix}critic_loss_rel_err": relative_error(other.loss, flat.loss),
        f"{prefix}critic_max_rel_grad_err": max(errors.values(), default=0.0),
        f"{prefix}critic_max_abs_value_err": value_error,
        f"{prefix}critic_max_rel_metric_err": max(metric_errors(flat.metrics, other.metrics).values(), default=0.0),
    }
    if not prefix:
        report |= {
            "critic_loss_flat": flat.loss,
            "critic_loss_tree": other.loss,
            "critic_worst_parameter": max(errors, key=errors.get) if errors else None,
            "critic_parameters": len(flat.gradients),
            "critic_metrics_flat": flat.metrics,
        }
    return report
