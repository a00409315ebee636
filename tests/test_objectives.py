"""Every registered objective (:data:`ds_tree.registries.OBJECTIVES`) computes on trees exactly what it
computes on the flat baseline: its prepared updates (:meth:`~ds_tree.objectives.base.Objective.prepare_step`),
run by the runners of their items' kinds (:meth:`~ds_tree.objectives.base.Objective.run_update`), give the flat
layout's loss, gradient and metrics in float64, on packed trees split into parts and on walked trees. A new
objective registered in ``OBJECTIVES`` is checked here with no test of its own to write."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_tree.comparison import TOLERANCES, gradient_errors, relative_error
from ds_tree.config import load_config
from ds_tree.data.dataset_reader import LoadedGroups
from ds_tree.data.sampler import StepSampler
from ds_tree.engine.layout import StepLayout
from ds_tree.models.loading import load_model
from ds_tree.objectives.base import Components, StepContext
from ds_tree.registries import ESTIMATORS, OBJECTIVES
from ds_tree.trees.trajectory import group_trajectories
from ds_tree.verify.tree_vs_flat import perturb_parameters
from tests.helpers.processes import one_rank_group
from tests.helpers.rollouts import rl_trajectories

MODEL = "configs/models/tiny_llama.json"
RL_OVERRIDES = ["objective.mini_batches=2", "objective.entropy_coef=0.01", "objective.eps_low=0.05"]
"""What every objective that reads the clipped objective's fields sets (both clips act)."""
TEACHER = ["objective.teacher=configs/models/tiny_qwen2.json", "objective.mini_batches=2"]
KIND_OVERRIDES = {
    "sft": [],
    "distill": [*TEACHER, "objective.eps_low=0.05"],
    "distill_kl": [*TEACHER, "objective.distill.loss=kl", "model.head_chunk=5"],
    "distill_jsd": [*TEACHER, "objective.distill.loss=jsd", "objective.distill.beta=0.3"],
    "distill_reverse_kl": [*TEACHER, "objective.distill.loss=reverse_kl", "objective.ppo_epochs=2"],
    "dpo": ["objective.dpo.beta=0.5"],
    "dpo_ipo": ["objective.dpo.loss=ipo"],
    "dpo_smoothed": ["objective.dpo.label_smoothing=0.2"],
}
"""Each objective's settings (a registered objective not named here takes :data:`RL_OVERRIDES`), and the
variants of some, named ``<kind>_<variant>``."""
VARIANTS = [name for name in KIND_OVERRIDES if name.partition("_")[0] in ("distill", "dpo") and "_" in name]
TOLERANCE = TOLERANCES[torch.float64]
BUDGETS = {"dpo": 52}
"""Budgets other than 64 that split the step's trees into parts: DPO packs its paired sequences only (a
smaller tree than the step's), the longest of 51 tokens."""


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """A 1-rank process group: the objectives sum their normalisers and metrics over the ranks."""
    with one_rank_group():
        yield


class PlainBackward:
    """Each update's ``backward`` as plain autograd, one process (the flat baseline's; DeepSpeed's scaling
    around it is tests/test_engine.py's)."""

    @staticmethod
    def backward_for(n_rows: int):
        return torch.Tensor.backward


def run_objective(
    name: str, mode: str, extra: tuple[str, ...] = ()
) -> tuple[list[tuple[float, dict]], dict[str, float], object]:
    """Objective ``name`` on one step of three groups in layout ``mode`` (``extra``: more config overrides): each
    update's loss and gradient (the policy moved off the old one between the preparation and the updates), then
    the step's metrics."""
    kind = name.partition("_")[0] if name in VARIANTS else name
    overrides = [f"objective.kind={kind}", *KIND_OVERRIDES.get(name, RL_OVERRIDES), *extra]
    packing = [f"packing.budget={BUDGETS.get(kind, 64)}", f"packing.mode={mode}", "data.groups_per_step=3"]
    packing += ["packing.dfs_chunk=16"] if mode == "dfs" else []
    config = load_config("configs/tiny_cpu.yaml", [*overrides, *packing])
    trajectories = rl_trajectories(seed=1, groups=3, per_group=4)
    rng = np.random.default_rng(2)
    for trajectory in trajectories:  # the data's own advantages (estimator "given", PPO's default)
        trajectory.advantages = rng.normal(size=len(trajectory))
    model = load_model(MODEL, attention="torch", dtype=torch.float64, seed=0)
    groups = group_trajectories(trajectories)
    context = StepContext(
        config,
        model,
        PlainBackward(),
        StepLayout(config, {}, pad_id=0, world_size=1),
        None,
        rank=0,
        groups=LoadedGroups(groups),
        sampler=StepSampler(len(groups), len(groups), seed=0),
    )
    objective = OBJECTIVES.get(kind)(config)
    objective.check_data(trajectories)
    objective.build(Components(model, {}))
    prepared = objective.prepare_step(0, context)
    assert len(prepared.trajectories) == len(trajectories)
    perturb_parameters(model, 0.5, 1)  # ratios off 1: both clips of the RL objectives act
    results, outputs = [], []
    for update in prepared.updates:
        model.zero_grad(set_to_none=True)
        outputs.append(objective.run_update(update, context))
        gradients = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((outputs[-1].loss, gradients))
    losses = [loss for loss, _ in results]  # one rank: the global losses
    return results, objective.step_metrics(prepared, outputs, losses, context), prepared


@pytest.mark.parametrize("mode", ["tree", "dfs"])
@pytest.mark.parametrize("name", [*OBJECTIVES.names(), *VARIANTS])
def test_every_objective_on_trees_equals_its_flat_baseline(name: str, mode: str) -> None:
    check_against_flat(name, mode)


@pytest.mark.parametrize("estimator", [name for name in ESTIMATORS.names() if name not in ("grpo", "given", "gae")])
def test_every_estimator_on_trees_equals_its_flat_baseline(estimator: str) -> None:
    """The estimators the objectives' defaults do not cover (``grpo``, ``given`` above; ``gae`` trains a critic:
    tests/test_rl_critic.py), on packed trees split into parts."""
    check_against_flat("grpo", "tree", (f"objective.estimator={estimator}",))


def check_against_flat(name: str, mode: str, extra: tuple[str, ...] = ()) -> None:
    flat, flat_scalars, _ = run_objective(name, "flat", extra)
    tree, tree_scalars, prepared = run_objective(name, mode, extra)
    assert len(tree) == len(flat) >= 1
    kinds = {row.kind for update in prepared.updates for row in update.plan.rows}
    assert kinds == ({"walked"} if mode == "dfs" else {"packed"}), kinds
    if mode == "tree":  # the budget splits trees into parts: prefixes copied, each token owned once
        assert any(row.n_real and len(row.parts) > 1 for update in prepared.updates for row in update.plan.rows)
    for (tree_loss, tree_gradients), (flat_loss, flat_gradients) in zip(tree, flat, strict=True):
        assert flat_loss != 0 and relative_error(tree_loss, flat_loss) <= TOLERANCE, (tree_loss, flat_loss)
        assert set(tree_gradients) == set(flat_gradients)
        worst = max(gradient_errors(flat_gradients, tree_gradients).values())
        assert worst <= TOLERANCE, worst
    assert set(tree_scalars) == set(flat_scalars)
    for key, value in flat_scalars.items():
        assert abs(tree_scalars[key] - value) <= TOLERANCE * max(abs(value), 1.0), (key, tree_scalars[key], value)
    if name not in KIND_OVERRIDES:  # the RL objectives report the clipped ratios: the perturbation moved them
        assert flat_scalars["rl/clip_frac_low"] + flat_scalars["rl/clip_frac_high"] > 0, flat_scalars
