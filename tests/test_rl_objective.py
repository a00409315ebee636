"""The RL objective on tree tokens equals the flat objective written out per trajectory.

A forest of random trajectories becomes tries (whole, or split into parts that carry their
ancestor path); every tree token gets random log-probs (current, old, reference, sampler) and an
entropy, spread so that ratios leave the clip range on both sides and pass the dual clip. The tree
side folds trajectories into per-token sums (:func:`token_sums`) per part and adds the parts'
losses; the flat side loops over trajectories, gathers each one's per-token values through its
path and applies the textbook PPO formulas. Loss and metrics must agree in float64 to 1e-12
relative to the sum of the magnitudes of their flat terms (terms of both signs can cancel far below
any one of them); the gradients with respect to every tree token's log-prob and entropy to 1e-12 in
norm, per tensor, relative to its norm (:func:`ds_tree.verify.tree_vs_flat.gradient_errors`, what
``ds-tree verify`` reports). Per-element relative bounds measured round-off over cancelled,
near-zero elements instead; a restoration weight off by one trajectory on one token still fails
the norm check by orders of magnitude (test_wrong_restoration_weight_fails_the_gradient_check).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree.comparison import gradient_errors
from ds_tree.config import ConfigError, load_config
from ds_tree.losses.cppo import CPPOSettings, kept_sums, row_divergence, row_pairs
from ds_tree.losses.rl import KL_ESTIMATORS, ppo_tree_loss, token_sums, trajectory_coefficients
from ds_tree.packing.parts import split_tree, whole_tree
from ds_tree.registries import AGGREGATIONS, ESTIMATORS
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest
from tests.helpers.strategies import flat_coefficients, forests, longest

RTOL = 1e-12
GRADIENTS = ("logp", "entropy")
"""The tensors whose gradients are compared, by their norm-based relative error (as ``ds-tree verify``)."""
SETTINGS = settings(max_examples=8, deadline=None)
CLIPS = [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 2.5), (0.1, 0.3, 1.5)]
"""(eps_low, eps_high, dual_clip): symmetric, DAPO's clip-higher, and both with dual clip."""
TRUNCATION = 1.3
KL_COEF, ENTROPY_COEF, CONSTANT = 0.07, 0.013, 50.0


# ------------------------------------------------------------------------- the problem


def _prefix_values(trajectories: list[Trajectory], rng: np.random.Generator) -> dict[int, np.ndarray]:
    """A stand-in critic for ``gae``: one random value per distinct prefix (a critic's value at a token depends on
    the prefix alone, so trajectories sharing a prefix share its values)."""
    by_prefix: dict[bytes, float] = {}
    values = {}
    for trajectory in trajectories:
        ids = trajectory.input_ids
        values[id(trajectory)] = np.array(
            [by_prefix.setdefault(ids[: i + 1].tobytes(), float(rng.normal())) for i in range(len(ids))]
        )
    return values


def _prepare(trajectories: list[Trajectory], rng: np.random.Generator, estimator: str, aggregation: str):
    """Rewards, given advantages, the forest and per-trajectory (path, mask, coefficient, advantage, sampler)."""
    for trajectory in trajectories:
        trajectory.reward = float(rng.choice([0.0, 0.5, 1.0, 1.0]))  # repeats: equal-reward groups occur
        trajectory.advantages = rng.normal(size=len(trajectory))  # read by the "given" estimator
    settings = {"values": _prefix_values(trajectories, rng), "gamma": 0.97, "lam": 0.9} if estimator == "gae" else {}
    advantages = ESTIMATORS.get(estimator)(trajectories, normalise=estimator in ("grpo", "treepo"), **settings)
    advantage_of = {id(t): a for t, a in zip(trajectories, advantages.values, strict=True)}
    trained = [t.loss_mask[1:].sum() for t in trajectories]
    normalisers = {"total_tokens": sum(trained), "sequences": sum(s > 0 for s in trained), "constant": CONSTANT}
    trees = build_forest(trajectories)
    offsets = np.cumsum([0] + [tree.n_tokens for tree in trees])
    items = []
    for tree, offset in zip(trees, offsets, strict=False):
        for trajectory, path in zip(tree.trajectories, tree.paths, strict=True):
            mask = np.concatenate([[0.0], trajectory.loss_mask[1:]])
            coefficient = trajectory_coefficients(trajectory.loss_mask, aggregation, **normalisers)
            items.append((offset + path, mask, coefficient, advantage_of[id(trajectory)], None))
    return trees, offsets, items


def _values(n_tokens: int, items: list, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per forest token: logp, old, ref, entropy; per trajectory: sampler log-probs (differ by trajectory)."""
    logp = -rng.uniform(0.05, 3.0, n_tokens)
    old = logp + rng.uniform(-1.5, 1.5, n_tokens)  # r from 0.22 to 4.5: both clip sides and the dual clip
    values = {
        "logp": logp,
        "old": old,
        "ref": logp + rng.normal(0, 0.5, n_tokens),
        "entropy": rng.uniform(0.1, 3, n_tokens),
    }
    for k, (path, *rest) in enumerate(items):
        items[k] = (path, *rest[:3], old[path] + rng.normal(0, 0.4, path.size))
    return values


def _parts(trees, offsets, budget):
    """Per part: forest index of each of its tokens, and which tokens it owns (the first copy)."""
    out = []
    for tree, offset in zip(trees, offsets, strict=False):
        seen = np.zeros(tree.n_tokens, dtype=bool)
        for part in split_tree(tree, budget) if budget else [whole_tree(tree)]:
            out.append((offset + part.token_index, ~seen[part.token_index]))
            seen[part.token_index] = True
    return out


# ------------------------------------------------------------------------- the two sides


def _tree_side(parts, items, tensors, clip, kl_estimator, importance):
    """Sum over parts (each its own packed row) of the tree loss, and the summed metrics."""
    eps_low, eps_high, dual_clip = clip
    total, metrics = 0.0, {}
    for source, owned in parts:
        to_row = np.full(tensors["logp"].numel(), -1)
        to_row[source] = np.arange(source.size)
        copies = [(to_row[path], *rest) for path, *rest in items if np.any(to_row[path] >= 0)]
        old = tensors["old"].detach().numpy()[source]
        sums = token_sums(
            source.size,
            [c[0] for c in copies],
            [c[1] for c in copies],
            [c[2] for c in copies],
            [c[3] for c in copies],
            owned,
            logp_old=old if importance else None,
            sampler_logprobs=[c[4] for c in copies] if importance else None,
            truncation=TRUNCATION if importance else None,
        )
        targets = sums.active()
        at = source[targets]
        loss, part_metrics = ppo_tree_loss(
            tensors["logp"][at],
            old[targets],
            sums.take(targets),
            eps_low=eps_low,
            eps_high=eps_high,
            dual_clip=dual_clip,
            logp_ref=tensors["ref"][at],
            kl_coef=KL_COEF,
            kl_estimator=kl_estimator,
            entropy=tensors["entropy"][at],
            entropy_coef=ENTROPY_COEF,
        )
        total = total + loss
        for name, value in part_metrics.items():
            combine = max if name == "ratio_max" else (lambda a, b: a + b)
            metrics[name] = combine(metrics.get(name, 0.0), value)
    return total, metrics


def _flat_side(items, tensors, clip, kl_estimator, importance):
    """The flat objective, the sum of its terms' magnitudes (the loss's round-off scale) and the
    metrics: a loop over trajectories with the textbook formulas."""
    eps_low, eps_high, dual_clip = clip
    total = tensors["logp"][:0].sum() + tensors["entropy"][:0].sum()  # 0, in the graph even with no terms
    magnitude = 0.0
    metrics = dict.fromkeys(("tokens", "clip_low", "clip_high", "clip_dual", "ratio_sum", "ratio_max"), 0.0)
    metrics |= dict.fromkeys(("approx_kl", "kl_ref", "entropy"), 0.0)
    for path, mask, coefficient, advantage, sampler in items:
        t = path[1:]
        logp, old, ref, entropy = (tensors[name][t] for name in ("logp", "old", "ref", "entropy"))
        m, c, a = (torch.as_tensor(x[1:]) for x in (mask, coefficient, advantage))
        ratio = torch.exp(logp - old)
        weighted = a * torch.clamp(torch.exp(old - torch.as_tensor(sampler[1:])), max=TRUNCATION) if importance else a
        surrogate = torch.minimum(ratio * weighted, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * weighted)
        if dual_clip is not None:
            surrogate = torch.where(a < 0, torch.maximum(surrogate, dual_clip * weighted), surrogate)
        if kl_estimator == "k1":
            kl = logp - ref
        elif kl_estimator == "k2":
            kl = 0.5 * (logp - ref) ** 2
        else:
            kl = torch.exp(ref - logp) - 1 - (ref - logp)
        terms = c * (-surrogate + KL_COEF * kl - ENTROPY_COEF * entropy)
        total = total + terms.sum()
        with torch.no_grad():
            magnitude += float(terms.abs().sum())
            metrics["tokens"] += float(m.sum())
            metrics["clip_low"] += float((m * ((ratio < 1 - eps_low) & (a < 0))).sum())
            metrics["clip_high"] += float((m * ((ratio > 1 + eps_high) & (a > 0))).sum())
            if dual_clip is not None:
                metrics["clip_dual"] += float((m * ((ratio > dual_clip) & (a < 0))).sum())
            metrics["ratio_sum"] += float((m * ratio).sum())
            if torch.any(m != 0):
                metrics["ratio_max"] = max(metrics["ratio_max"], float(ratio[m != 0].max()))
            metrics["approx_kl"] += float((m * (ratio - 1 - torch.log(ratio))).sum())
            metrics["kl_ref"] += float((m * kl).sum())
            metrics["entropy"] += float((m * entropy).sum())
    return total, magnitude, metrics


def _gradients(loss: torch.Tensor, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    grads = torch.autograd.grad(loss, [tensors[name] for name in GRADIENTS], retain_graph=True)
    return dict(zip(GRADIENTS, grads, strict=True))


def _check(trajectories, seed, estimator, aggregation, budget, importance):
    """Tree and flat sides agree for every clip setting and KL estimator; returns what was built."""
    rng = np.random.default_rng(seed)
    trees, offsets, items = _prepare(trajectories, rng, estimator, aggregation)
    values = _values(int(offsets[-1]), items, rng)
    parts = _parts(trees, offsets, budget)
    for clip in CLIPS:
        for kl_estimator in KL_ESTIMATORS:
            tree_tensors, flat_tensors = (
                {name: torch.tensor(v, requires_grad=name in ("logp", "entropy")) for name, v in values.items()}
                for _ in range(2)
            )
            tree_loss, tree_metrics = _tree_side(parts, items, tree_tensors, clip, kl_estimator, importance)
            flat_loss, magnitude, flat_metrics = _flat_side(items, flat_tensors, clip, kl_estimator, importance)
            assert abs(tree_loss.item() - flat_loss.item()) <= RTOL * magnitude, (clip, kl_estimator)
            errors = gradient_errors(_gradients(flat_loss, flat_tensors), _gradients(tree_loss, tree_tensors))
            assert max(errors.values()) <= RTOL, (errors, clip, kl_estimator)
            assert tree_metrics.keys() == flat_metrics.keys()
            for name, value in flat_metrics.items():
                assert tree_metrics[name] == pytest.approx(value, rel=RTOL, abs=RTOL * flat_metrics["tokens"]), name
    return trees, parts, values, items


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
@SETTINGS
@given(trajectories=forests(), seed=st.integers(0, 2**32 - 1), split=st.booleans(), importance=st.booleans())
def test_tree_objective_equals_flat(trajectories, seed, split, importance, estimator, aggregation):
    budget = longest(trajectories) if split else None
    _check(trajectories, seed, estimator, aggregation, budget, importance)


def _fixed_forest(rng: np.random.Generator) -> list[Trajectory]:
    """3 groups: a prompt (untrained), 3 trained branches shared by several trials, distinct tails, a duplicate."""
    trajectories = []
    for group in range(3):
        prompt = rng.integers(3, 50, 6)
        branches = [rng.integers(3, 50, rng.integers(2, 6)) for _ in range(3)]
        for k in range(7):
            ids = np.concatenate([prompt, branches[k % 3], rng.integers(3, 50, rng.integers(1, 8))])
            mask = np.concatenate([np.zeros(prompt.size), np.ones(ids.size - prompt.size)])
            trajectories.append(Trajectory(ids, mask, group_id=f"g{group}", source=f"g{group}/t{k}"))
        last = trajectories[-1]
        trajectories.append(Trajectory(last.input_ids, last.loss_mask, group_id=last.group_id, source=f"g{group}/dup"))
    return trajectories


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_fixed_forest_exercises_every_regime(estimator):
    """A forest where every branch of the objective is taken: the equality above is not vacuous there."""
    trajectories = _fixed_forest(np.random.default_rng(7))
    for aggregation in AGGREGATIONS.names():
        trees, parts, values, items = _check(trajectories, 11, estimator, aggregation, 20, importance=True)
    assert any(not owned.all() for _, owned in parts), "no duplicated prefix token"
    trained = np.unique(np.concatenate([path[1:][mask[1:] > 0] for path, mask, *_ in items]))
    ratio = np.exp(values["logp"] - values["old"])[trained]
    assert (ratio < 1 - 0.2).any() and (ratio > 1 + 0.3).any() and (ratio > 2.5).any(), "a clip regime is missing"
    weights = np.concatenate([np.exp(values["old"][path[1:]] - sampler[1:]) for path, *_, sampler in items])
    assert (weights > TRUNCATION).any() and (weights < TRUNCATION).any(), "truncation never (or always) active"
    n = int(sum(tree.n_tokens for tree in trees))
    sums = token_sums(n, *zip(*[item[:4] for item in items], strict=True), np.ones(n, dtype=bool))
    both_signs = ((sums.positive > 0) & (sums.negative < 0)).any()
    if estimator == "sibling":  # its advantage is a function of the tree token: one sign per token, by design
        assert not both_signs, "a sibling advantage differs between the paths through a token"
    else:
        assert both_signs, "no token shared by advantages of both signs"


@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
def test_wrong_restoration_weight_fails_the_gradient_check(aggregation):
    """The norm-based check is not blind to a restoration defect: the tree side with one shared,
    trained prefix token counted for one trajectory fewer (its weight off by one trajectory) misses
    the flat gradient by far more than RTOL, and _check's assertion fails on it."""
    trajectories = _fixed_forest(np.random.default_rng(7))
    trees, offsets, items = _prepare(trajectories, np.random.default_rng(11), "grpo", aggregation)
    values = _values(int(offsets[-1]), items, np.random.default_rng(12))
    parts = _parts(trees, offsets, None)
    # a trained token on the paths of several trajectories (a shared branch): drop the first one's term
    counts = np.zeros(int(offsets[-1]), dtype=int)
    for path, mask, *_ in items:
        counts[path[mask > 0]] += 1
    path, mask, coefficient, advantage, sampler = items[0]
    shared = [k for k in range(1, path.size) if mask[k] > 0 and counts[path[k]] >= 2]
    assert shared, "the fixed forest has no shared trained token"
    wrong_mask, wrong_coefficient = mask.copy(), coefficient.copy()
    wrong_mask[shared[0]] = wrong_coefficient[shared[0]] = 0.0
    wrong = [(path, wrong_mask, wrong_coefficient, advantage, sampler), *items[1:]]
    tree_tensors, flat_tensors = (
        {name: torch.tensor(v, requires_grad=name in GRADIENTS) for name, v in values.items()} for _ in range(2)
    )
    tree_loss, _ = _tree_side(parts, wrong, tree_tensors, CLIPS[0], "k1", importance=False)
    flat_loss, _, _ = _flat_side(items, flat_tensors, CLIPS[0], "k1", importance=False)
    errors = gradient_errors(_gradients(flat_loss, flat_tensors), _gradients(tree_loss, tree_tensors))
    assert errors["logp"] > 1e-3 and errors["entropy"] > 1e-3, errors  # measured ~0.05, RTOL is 1e-12
    # and the same data with the right weights passes: the difference above is the defect alone
    tree_loss, _ = _tree_side(parts, items, tree_tensors, CLIPS[0], "k1", importance=False)
    errors = gradient_errors(_gradients(flat_loss, flat_tensors), _gradients(tree_loss, tree_tensors))
    assert max(errors.values()) <= RTOL, errors


def test_coefficients_match_the_flat_normalisations():
    trajectories = _fixed_forest(np.random.default_rng(3))
    trajectories[0].loss_mask[:] = 0.0  # a sequence without trained tokens is not counted
    trained = [t.loss_mask[1:].sum() for t in trajectories]
    normalisers = {"total_tokens": sum(trained), "sequences": sum(s > 0 for s in trained), "constant": CONSTANT}
    expected = {
        "token_mean": flat_coefficients(trajectories, "token_mean"),
        "seq_mean_token_mean": flat_coefficients(trajectories, "sequence_mean"),
        "seq_mean_token_sum": [c / normalisers["sequences"] for c in flat_coefficients(trajectories, "sum")],
        "token_sum_norm": [c / CONSTANT for c in flat_coefficients(trajectories, "sum")],
    }
    for aggregation, coefficients in expected.items():
        for trajectory, c in zip(trajectories, coefficients, strict=True):
            np.testing.assert_allclose(trajectory_coefficients(trajectory.loss_mask, aggregation, **normalisers), c)
    with pytest.raises(ValueError, match="constant"):
        trajectory_coefficients(trajectories[1].loss_mask, "token_sum_norm", total_tokens=1.0, sequences=1.0)
    with pytest.raises(ValueError, match="aggregation"):
        trajectory_coefficients(trajectories[1].loss_mask, "mean", total_tokens=1.0, sequences=1.0)


def test_argument_checks():
    logp = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    sums = token_sums(2, [np.array([0, 1])], [np.ones(2)], [np.ones(2)], [np.ones(2)], np.ones(2, dtype=bool))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_tree_loss(logp, np.zeros(2), sums, dual_clip=1.0)
    with pytest.raises(ValueError, match="logp_ref"):
        ppo_tree_loss(logp, np.zeros(2), sums, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        ppo_tree_loss(logp, np.zeros(2), sums, entropy_coef=0.1)
    with pytest.raises(ValueError, match="importance weights"):
        token_sums(
            2, [np.array([0, 1])], [np.ones(2)], [np.ones(2)], [np.ones(2)], np.ones(2, dtype=bool), truncation=2.0
        )


# ------------------------------------------------------------------------------- CPPO

CPPO = CPPOSettings(delta=0.2, w_min=0.7, budget=0.05)
CPPO_KL = CPPOSettings(delta=0.3, w_min=0.9, budget=0.1, divergence="kl")


def _cppo_tree_side(parts, items, tensors, cppo):
    """CPPO's tree side per part as a packed row computes it: every trained token of the row scored, each (copy,
    trained token) pair's keep from the row's log-probs, folded into the per-token sums, the loss unclipped."""
    total, masked = 0.0, 0.0
    for source, owned in parts:
        to_row = np.full(tensors["logp"].numel(), -1)
        to_row[source] = np.arange(source.size)
        copies = [(to_row[path], *rest[:3]) for path, *rest in items if np.any(to_row[path] >= 0)]
        columns = [list(column) for column in zip(*copies, strict=True)]
        sums = token_sums(source.size, *columns, owned)
        trained = np.concatenate([path[1:][(mask[1:] != 0) & (path[1:] >= 0)] for path, mask, *_ in copies])
        targets = np.union1d(sums.active(), trained)
        old = tensors["old"].detach().numpy()[source][targets]
        logp = tensors["logp"][source[targets]]
        pairs = row_pairs(*columns, owned)
        divergence, rising = row_divergence(source.size, targets, logp.detach().numpy(), old, cppo.divergence)
        kept, part_masked = kept_sums(pairs, divergence, rising, cppo)
        sums = replace(sums.take(targets), positive=kept[targets], negative=np.zeros(targets.size))
        loss, _ = ppo_tree_loss(
            logp,
            old,
            sums,
            logp_ref=tensors["ref"][source[targets]],
            kl_coef=KL_COEF,
            entropy=tensors["entropy"][source[targets]],
            entropy_coef=ENTROPY_COEF,
            ratio_clip=False,
        )
        total, masked = total + loss, masked + part_masked.sum()
    return total, masked


def _cppo_flat_side(items, tensors, cppo):
    """CPPO written out per trajectory (arXiv 2606.10968, Eq. 8-11) with a loop over its trained tokens; returns the
    loss, its terms' magnitude, the masked pairs' loss-mask sum and how often each clause decided."""
    total = tensors["logp"][:0].sum() + tensors["entropy"][:0].sum()
    magnitude, masked = 0.0, 0.0
    regimes = {"back": 0, "within": 0, "over_delta": 0, "over_budget": 0}
    for path, mask, coefficient, advantage, _ in items:
        trained = [k for k in range(1, path.size) if mask[k] != 0]
        big_t = len(trained)
        spent = allowed = 0.0
        for position, k in enumerate(trained, start=1):
            t = path[k]
            logp, old = tensors["logp"][t], float(tensors["old"][t])
            pi, mu = float(torch.exp(logp.detach())), np.exp(old)
            if cppo.divergence == "tv":
                divergence = abs(pi - mu)
            else:
                divergence = mu * np.log(mu / pi) + (1 - mu) * np.log((1 - mu) / (1 - pi))
            weight = cppo.w_min + (1 - cppo.w_min) * (big_t - position) / max(big_t - 1, 1)
            threshold = min(cppo.delta, cppo.delta + cppo.budget * allowed - spent)
            drift = weight * divergence
            if advantage[k] * (pi / mu - 1) <= 0:
                keep, regime = True, "back"
            elif drift <= threshold:
                keep, regime = True, "within"
            else:
                keep, regime = False, "over_delta" if drift > cppo.delta else "over_budget"
            regimes[regime] += 1
            spent, allowed = spent + drift, allowed + weight
            kl = torch.exp(tensors["ref"][t] - logp) - 1 - (tensors["ref"][t] - logp)
            surrogate = torch.exp(logp - old) * advantage[k] if keep else logp * 0
            term = coefficient[k] * (-surrogate + KL_COEF * kl - ENTROPY_COEF * tensors["entropy"][t])
            total = total + term
            magnitude += abs(term.item())
            masked += 0.0 if keep else float(mask[k])
    return total, magnitude, masked, regimes


def _check_cppo(trajectories, seed, estimator, aggregation, budget, cppo, tree_cppo=None):
    rng = np.random.default_rng(seed)
    trees, offsets, items = _prepare(trajectories, rng, estimator, aggregation)
    values = _values(int(offsets[-1]), items, rng)
    values["old"] = np.minimum(values["old"], -0.02)  # probabilities (the binary KL reads 1 - pi_old)
    parts = _parts(trees, offsets, budget)
    tree_tensors, flat_tensors = (
        {name: torch.tensor(v, requires_grad=name in GRADIENTS) for name, v in values.items()} for _ in range(2)
    )
    tree_loss, tree_masked = _cppo_tree_side(parts, items, tree_tensors, tree_cppo or cppo)
    flat_loss, magnitude, flat_masked, regimes = _cppo_flat_side(items, flat_tensors, cppo)
    assert abs(tree_loss.item() - flat_loss.item()) <= RTOL * magnitude
    errors = gradient_errors(_gradients(flat_loss, flat_tensors), _gradients(tree_loss, tree_tensors))
    assert max(errors.values()) <= RTOL, errors
    assert tree_masked == pytest.approx(flat_masked, rel=RTOL)
    return parts, regimes


@pytest.mark.parametrize("cppo", [CPPO, CPPO_KL], ids=["tv", "kl"])
@pytest.mark.parametrize("estimator", ["grpo", "given"])
@SETTINGS
@given(trajectories=forests(), seed=st.integers(0, 2**32 - 1), split=st.booleans())
def test_cppo_tree_equals_flat(trajectories, seed, split, estimator, cppo):
    """CPPO's mask, per (path, token) with the path's own length, folded into the tree's sums: tree == flat."""
    budget = longest(trajectories) if split else None
    _check_cppo(trajectories, seed, estimator, "seq_mean_token_mean", budget, cppo)


@pytest.mark.parametrize("cppo", [CPPO, CPPO_KL], ids=["tv", "kl"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS.names())
def test_cppo_fixed_forest_exercises_every_clause(aggregation, cppo):
    """On trees split into parts with advantages of both signs, every clause of the mask decides somewhere: kept
    stepping back, kept within the threshold, masked over delta, and masked by the prefix budget alone."""
    trajectories = _fixed_forest(np.random.default_rng(7))
    parts, regimes = _check_cppo(trajectories, 11, "grpo", aggregation, 20, cppo)
    assert any(not owned.all() for _, owned in parts), "no duplicated prefix token"
    assert all(regimes.values()), regimes


def test_cppo_mask_is_not_blind():
    """The comparison fails when the tree side ignores the prefix budget (a mask of the token threshold alone)."""
    trajectories = _fixed_forest(np.random.default_rng(7))
    with pytest.raises(AssertionError):
        _check_cppo(trajectories, 11, "grpo", "token_mean", 20, CPPO, tree_cppo=replace(CPPO, budget=1e9))


GRPO_CPPO = ["objective.kind=grpo", "objective.cppo.enabled=true"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["objective.cppo.enabled=true"], r"objective\.cppo: only with objective\.kind grpo or ppo \(kind is sft\)"),
        (["objective.kind=grpo", "objective.cppo.budget=0.1"], r"objective\.cppo\.budget: only with .*enabled: true"),
        ([*GRPO_CPPO, "objective.cppo.delta=0"], r"objective\.cppo\.delta must be > 0"),
        ([*GRPO_CPPO, "objective.cppo.w_min=1.5"], r"objective\.cppo\.w_min must be in \(0, 1\]"),
        ([*GRPO_CPPO, "objective.cppo.budget=-1"], r"objective\.cppo\.budget must be >= 0"),
        ([*GRPO_CPPO, "objective.cppo.divergence=js"], r"objective\.cppo\.divergence must be one of tv, kl"),
        ([*GRPO_CPPO, "objective.dual_clip=2"], r"objective\.dual_clip: CPPO's mask replaces the ratio clip"),
        ([*GRPO_CPPO, "objective.importance_truncation=2"], r"objective\.importance_truncation: not combined"),
    ],
)
def test_bad_cppo_settings_are_refused_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny_cpu.yaml", overrides)


def test_cppo_settings_reach_the_loss():
    objective = load_config("configs/tiny_cpu.yaml", [*GRPO_CPPO, "objective.cppo.w_min=0.5"]).objective
    assert objective.rl_settings().cppo == CPPOSettings(w_min=0.5)
    assert load_config("configs/tiny_cpu.yaml", ["objective.kind=grpo"]).objective.rl_settings().cppo is None


def test_console_line_shows_cppos_masked_fraction_instead_of_the_clip():
    from ds_tree.run.metrics import console_line

    scalars = {"loss/train": 0.5, "optim/lr": 1e-3, "optim/grad_norm": 1.0, "time/step_s": 1.0}
    scalars |= {"throughput/flat_tokens_per_s": 10.0, "throughput/unique_tokens_per_s": 5.0}
    scalars |= {"tree/por": 0.5, "tree/err": 0.5, "rl/reward_mean": 0.25, "rl/approx_kl": 0.01, "rl/entropy": 2.0}
    scalars |= {"rl/clip_frac_low": 0.0, "rl/clip_frac_high": 0.0}
    assert "clip 0.000/0.000" in console_line(1, 2, scalars)
    line = console_line(1, 2, scalars | {"rl/cppo_masked_frac": 0.125})
    assert "masked 0.125" in line and "clip" not in line
