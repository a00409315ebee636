"""The RL objective on a real model: tree mode equals the flat baseline and a per-trajectory oracle.

Old policy: a tiny Llama at a seed; trained policy: the same weights moved off it
(:func:`ds_tree.verify.tree_vs_flat.perturb_parameters`), so ratios leave the clip range on both sides
(each case asserts clipped tokens on both sides, so the clipping branches are really exercised).
Random forests have shared prefixes with advantages of both signs on shared tokens, and budgets
that force splits (prefix copies without weight). float64: 1e-10 relative.
"""

from __future__ import annotations

import functools
import typing

import numpy as np
import pytest
import torch

from ds_tree import config as config_module
from ds_tree.errors import DataError
from ds_tree.losses.rl import KL_ESTIMATORS, RLSettings, trajectory_coefficients
from ds_tree.losses.sft import Normalisers
from ds_tree.models.loading import load_model
from ds_tree.objectives import rl_rows
from ds_tree.objectives.sft import run_rows
from ds_tree.packing.modes import pack_trajectories
from ds_tree.registries import AGGREGATIONS, ESTIMATORS
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest
from ds_tree.verify.tree_vs_flat import compare_rl, perturb_parameters
from tests.helpers.rollouts import rl_trajectories

MODEL = "configs/models/tiny_llama.json"


CASES = [
    ("grpo", False, RLSettings()),
    ("grpo", True, RLSettings(eps_low=0.1, eps_high=0.28, dual_clip=1.3)),
    ("rloo", False, RLSettings(aggregation="seq_mean_token_mean", kl_coef=0.1, kl_estimator="k1")),
    ("treepo", True, RLSettings(aggregation="seq_mean_token_sum", kl_coef=0.05, kl_estimator="k2", entropy_coef=0.01)),
    ("treepo", False, RLSettings(aggregation="token_sum_norm", aggregation_constant=64.0, kl_coef=0.1)),
]


@pytest.mark.parametrize("budget", [4096, 64])
@pytest.mark.parametrize(("estimator", "normalise", "settings"), CASES)
def test_rl_tree_equals_flat(estimator, normalise, settings, budget):
    report = compare_rl(
        rl_trajectories(), MODEL, estimator=estimator, normalise_advantages=normalise, settings=settings, budget=budget
    )
    assert report["passed"], report
    metrics = report["metrics_flat"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0, metrics
    if settings.dual_clip:
        assert metrics["clip_dual"] > 0, metrics
    if budget == 64:
        assert report["rows_tree"] > 1  # the trees were split into parts


@functools.cache
def _policies():
    old = load_model(MODEL, attention="torch", dtype=torch.float64, seed=0)
    new = load_model(MODEL, attention="torch", dtype=torch.float64, seed=0)
    perturb_parameters(new, 0.5, 1)
    return old, new


def _flat_logprobs(model, trajectories) -> dict[int, np.ndarray]:
    """Each trajectory alone (flat rows), every predicted token's log-prob."""
    rows = pack_trajectories(trajectories, "flat", 4096)
    with torch.no_grad():
        return run_rows(model, rows, Normalisers(1.0, 1.0, 1.0), collect_logprobs=True).trajectory_logprobs


def oracle_loss(trajectories, advantages, settings: RLSettings, logp_old=None, importance=None) -> float:
    """``sum_i sum_t c_it * (-w_it g(r_t, A_it) + beta * kl_t)``, one trajectory at a time (no entropy).

    ``logp_old``: the old log-probs per trajectory (default: the old policy's); ``importance``: the
    truncated importance weights ``w_it`` per trajectory (default 1). The KL reference is the old policy.
    """
    old, new = _policies()
    logp_ref, logp_new = _flat_logprobs(old, trajectories), _flat_logprobs(new, trajectories)
    logp_old = logp_old or logp_ref
    trained = [t.trained_tokens for t in trajectories]
    total, sequences = sum(trained), sum(n > 0 for n in trained)
    loss = 0.0
    for trajectory, advantage in zip(trajectories, advantages, strict=True):
        c = trajectory_coefficients(
            trajectory.loss_mask,
            settings.aggregation,
            total_tokens=total,
            sequences=sequences,
            constant=settings.aggregation_constant,
        )[1:]
        a = advantage[1:]
        ratio = np.exp(logp_new[id(trajectory)] - logp_old[id(trajectory)])
        clipped = np.clip(ratio, 1 - settings.eps_low, 1 + settings.eps_high)
        if importance is not None:
            a = a * importance[id(trajectory)]
        surrogate = np.minimum(ratio * a, clipped * a)
        if settings.dual_clip:
            surrogate = np.where(a < 0, np.maximum(surrogate, settings.dual_clip * a), surrogate)
        x = logp_ref[id(trajectory)] - logp_new[id(trajectory)]
        kl = {"k1": -x, "k2": 0.5 * x**2, "k3": np.expm1(x) - x}[settings.kl_estimator]
        loss += float((c * (-surrogate + settings.kl_coef * kl)).sum())
    return loss


@pytest.mark.parametrize(("estimator", "normalise", "settings"), [c for c in CASES if not c[2].entropy_coef])
def test_rl_tree_loss_equals_per_trajectory_oracle(estimator, normalise, settings):
    trajectories = rl_trajectories(seed=1)
    computed = ESTIMATORS.get(estimator)(trajectories, normalise=normalise)
    report = compare_rl(
        trajectories, MODEL, estimator=estimator, normalise_advantages=normalise, settings=settings, budget=64
    )
    expected = oracle_loss(trajectories, computed.values, settings)
    assert abs(report["loss_tree"] - expected) <= 1e-10 * abs(expected), (report["loss_tree"], expected)


def test_prefix_copies_count_their_trajectories(monkeypatch):
    """Mutation guard: listing only the trajectories whose leaf a part holds (the SFT view) loses the
    advantage sums of shared tokens owned by a part whose trajectories end elsewhere."""

    def leaves_only(row):
        return [(t, path) for t, path in original(row) if path[-1] >= 0]

    original = rl_rows.trajectory_copies
    assert compare_rl(rl_trajectories(), MODEL, budget=64)["passed"]
    monkeypatch.setattr(rl_rows, "trajectory_copies", leaves_only)
    assert not compare_rl(rl_trajectories(), MODEL, budget=64)["passed"]


def test_config_choices_are_the_library_registries():
    assert typing.get_args(config_module.Estimator)[1].names() == ("", *ESTIMATORS)
    assert typing.get_args(config_module.Aggregation)[1].names() == AGGREGATIONS.names()
    assert typing.get_args(config_module.KLEstimator) == KL_ESTIMATORS
    assert typing.get_args(config_module.OldLogprobs) == rl_rows.OLD_LOGPROBS


def with_sampler_logprobs(trajectories, *, agree_on_shared: bool, seed: int = 5) -> list[Trajectory]:
    """Copies carrying sampler log-probs: the old policy's plus noise, so ratios leave the clip range.

    ``agree_on_shared``: the noise is a function of the token's context (its prefix), so trajectories
    through a shared token carry the same value (as a tree sampler writes them); otherwise each
    trajectory draws its own (independent samples).
    """
    old, _ = _policies()
    logprobs = _flat_logprobs(old, trajectories)
    rng = np.random.default_rng(seed)
    copies = []
    for trajectory in trajectories:
        ids = trajectory.input_ids.tolist()
        if agree_on_shared:
            noise = [
                np.random.default_rng(hash(tuple(ids[: k + 1])) % 2**32).normal(0, 0.3) for k in range(1, len(ids))
            ]
        else:
            noise = rng.normal(0, 0.3, len(ids) - 1)
        values = np.full(len(ids), np.nan)
        values[1:] = logprobs[id(trajectory)] + np.asarray(noise)
        copies.append(
            Trajectory(
                trajectory.input_ids,
                trajectory.loss_mask,
                group_id=trajectory.group_id,
                reward=trajectory.reward,
                source=trajectory.source,
                logprobs=values,
            )
        )
    return copies


@pytest.mark.parametrize("budget", [4096, 64])
def test_old_logprobs_from_data(budget):
    trajectories = with_sampler_logprobs(rl_trajectories(seed=2), agree_on_shared=True)
    settings = RLSettings(old_logprobs="data", dual_clip=1.5)
    report = compare_rl(trajectories, MODEL, settings=settings, budget=budget)
    assert report["passed"], report
    metrics = report["metrics_flat"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0, metrics
    computed = ESTIMATORS.get("grpo")(trajectories)
    old = {id(t): t.logprobs[1:] for t in trajectories}
    expected = oracle_loss(trajectories, computed.values, settings, logp_old=old)
    assert abs(report["loss_tree"] - expected) <= 1e-10 * abs(expected), (report["loss_tree"], expected)


def test_old_logprobs_from_data_must_agree_on_shared_tokens():
    trajectories = with_sampler_logprobs(rl_trajectories(seed=2), agree_on_shared=False)
    with pytest.raises(DataError, match="differ by"):
        compare_rl(trajectories, MODEL, settings=RLSettings(old_logprobs="data"))


@pytest.mark.parametrize("budget", [4096, 64])
def test_truncated_importance_weights(budget):
    """Per-trajectory sampler log-probs that differ on shared tokens: the weights fold into P and N."""
    trajectories = with_sampler_logprobs(rl_trajectories(seed=3), agree_on_shared=False)
    settings = RLSettings(importance_truncation=1.2)
    report = compare_rl(trajectories, MODEL, settings=settings, budget=budget)
    assert report["passed"], report
    computed = ESTIMATORS.get("grpo")(trajectories)
    old, _ = _policies()
    logp_old = _flat_logprobs(old, trajectories)
    weights = {id(t): np.minimum(np.exp(logp_old[id(t)] - t.logprobs[1:]), 1.2) for t in trajectories}
    assert any(np.any(w == 1.2) for w in weights.values()) and any(np.any(w < 1) for w in weights.values())
    expected = oracle_loss(trajectories, computed.values, settings, importance=weights)
    assert abs(report["loss_tree"] - expected) <= 1e-10 * abs(expected), (report["loss_tree"], expected)


def test_shared_logprobs_checked_before_training():
    """The trainer's up-front check (``old_logprobs: data``) refuses what the step would refuse later."""
    agreeing = with_sampler_logprobs(rl_trajectories(seed=2), agree_on_shared=True)
    for tree in build_forest(agreeing):
        rl_rows.check_shared_logprobs(tree)
    disagreeing = with_sampler_logprobs(rl_trajectories(seed=2), agree_on_shared=False)
    with pytest.raises(
        DataError, match=r"g\d:\d, g\d:\d: these trajectories share a token whose sampler log-probs differ"
    ):
        for tree in build_forest(disagreeing):
            rl_rows.check_shared_logprobs(tree)


def sampled_groups(mismatch: float) -> list[Trajectory]:
    """Two trees drawn by the HF tree sampler (what the online loop trains on), with the sampler's own
    per-token log-probs recorded, from the old policy's weights moved by ``mismatch`` times their spread
    (a sampler that disagrees with the trainer, as a generation server's kernels or dtype do)."""
    from ds_tree.sampling.hf import SamplerSettings, sample_tree

    sampler = load_model(MODEL, attention="torch", dtype=torch.float64, seed=0)
    perturb_parameters(sampler, mismatch, 9)
    settings = SamplerSettings(segment_length=4, branching=2, max_depth=2, width=4, max_new_tokens=12)
    rng = np.random.default_rng(0)
    trajectories = []
    for group, prompt in enumerate([[1, 17, 300, 42, 9], [5, 6, 7]]):
        generator = torch.Generator().manual_seed(group)
        tree = sample_tree(sampler, prompt, settings, generator=generator, eos_token_ids=[])
        for trajectory in tree.trajectories(f"s{group}"):
            trajectory.reward = float(rng.normal())
            trajectories.append(trajectory)
    return trajectories


def test_online_sampler_logprobs_as_old_logprobs_and_importance_weights():
    """The online loop's trajectories carry the sampler's log-probs: ``old_logprobs: data`` takes them as
    ``pi_old`` and truncated importance sampling weighs each token by ``min(pi_old / pi_sampler, C)`` with
    them; tree equals flat and the per-trajectory oracle in both."""
    trajectories = sampled_groups(mismatch=0.2)
    advantages = ESTIMATORS.get("grpo")(trajectories).values
    sampler = {id(t): np.nan_to_num(t.logprobs[1:]) for t in trajectories}  # NaN: prompt tokens, untrained
    data = RLSettings(old_logprobs="data")
    report = compare_rl(trajectories, MODEL, settings=data, budget=32)
    assert report["passed"] and report["rows_tree"] > 2, report  # split under the budget
    expected = oracle_loss(trajectories, advantages, data, logp_old=sampler)
    assert abs(report["loss_tree"] - expected) <= 1e-10 * abs(expected), (report["loss_tree"], expected)
    truncated = RLSettings(importance_truncation=1.1)
    report = compare_rl(trajectories, MODEL, settings=truncated, budget=32)
    assert report["passed"], report
    old, _ = _policies()
    logp_old = _flat_logprobs(old, trajectories)
    weights = {id(t): np.minimum(np.exp(logp_old[id(t)] - sampler[id(t)]), 1.1) for t in trajectories}
    trained = np.concatenate([w[t.loss_mask[1:] != 0] for t, w in zip(trajectories, weights.values(), strict=True)])
    assert np.any(trained == 1.1) and np.any(trained < 0.9), trained  # the mismatch is corrected both ways
    expected = oracle_loss(trajectories, advantages, truncated, importance=weights)
    assert abs(report["loss_tree"] - expected) <= 1e-10 * abs(expected), (report["loss_tree"], expected)
