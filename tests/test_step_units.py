"""A training rank's share of a step's host work over a real 2-process gloo group (ds_tree/packing/step_units.py,
ds_tree/objectives/rl_statistics.py): with the groups held where they were sampled (online rollouts), every rank's
items are the whole-step plan's for it, each group sent only to the ranks that need it (fewer bytes than the
all-gather of the step); the RL host work's advantages, mini-batch normalisers and statistics equal the whole
step's to the bit, for every registered estimator (``gae``: from values each rank scores at the tokens its items
own, merged over the ranks at the step, in every layout); the self-check's sample is the whole step's on every
rank."""

from __future__ import annotations

import json
import pickle
import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.engine.self_check import sample_groups
from ds_tree.losses.advantages import estimate
from ds_tree.objectives.base import check_sample
from ds_tree.objectives.critic import gae_advantages
from ds_tree.objectives.policy_gradient import rl_host_work
from ds_tree.objectives.rl_rows import StepNormalisers, trajectory_copies
from ds_tree.objectives.rl_statistics import AdvantageRule
from ds_tree.packing.exchange import Collectives
from ds_tree.packing.plan import PlanSettings, plan_step
from ds_tree.packing.step_units import HeldUnits, StepData, plan_units
from ds_tree.registries import ESTIMATORS
from ds_tree.trees.token_arrays import TOKEN_FIELDS
from ds_tree.trees.trajectory import group_trajectories
from tests.helpers.rollouts import rl_trajectories

GROUPS, PER_GROUP = 9, 4
HOST_ESTIMATORS = [name for name in ESTIMATORS.names() if name != "gae"]
"""The estimators the host work computes ahead (``gae`` waits for the critic's values at the step)."""


def step_groups() -> list[list]:
    trajectories = rl_trajectories(seed=3, groups=GROUPS, per_group=PER_GROUP)
    rng = np.random.default_rng(0)
    for t in trajectories:  # the "given" estimator's
        t.advantages = rng.normal(size=len(t))
    return group_trajectories(trajectories)


def held_data(groups: list[list], rank: int, world: int) -> StepData:
    """The step as online rollouts leave it: group ``g`` on rank ``g mod world`` (a copy: no object shared)."""
    owners = np.arange(len(groups)) % world
    sizes = np.array([sum(len(t) for t in g) for g in groups], dtype=np.int64)
    held = {u: pickle.loads(pickle.dumps(g)) for u, g in enumerate(groups) if owners[u] == rank}
    return StepData(HeldUnits(sizes, held), owners)


def settings_list(longest: int) -> list[PlanSettings]:
    base = PlanSettings(budget=longest, block=4, cost_per_pair=0.01, dfs_chunk=7)
    tight = replace(base, budget=longest - 5)
    return [
        base,
        replace(base, budget=longest + 30),  # several trees a row
        replace(tight, over_budget="dfs"),  # walked trees beside packed rows
        replace(base, merge="global"),  # one trie: every group to every rank
        replace(tight, sequence_parallel_size=2),  # shards of rows computed together
    ]


def same_items(plan, expected) -> bool:
    """Same kinds, token arrays and trajectories (by content: those that travelled are copies)."""
    if [row.kind for row in plan.rows] != [row.kind for row in expected.rows]:
        return False
    for row, reference in zip(plan.rows, expected.rows, strict=True):
        if any(not np.array_equal(getattr(row, n), getattr(reference, n)) for n in TOKEN_FIELDS):
            return False
        for a, b in zip(row.layout_parts, reference.layout_parts, strict=True):
            if [t.source for t in a.tree.trajectories] != [t.source for t in b.tree.trajectories]:
                return False
    return True


def rl_reference(groups: list[list], estimator: str, normalise: bool, mini_batches: int, **settings) -> dict:
    """The whole step's advantages, normalisers and statistics as one process computes them (``settings``: the
    estimator's, :func:`~ds_tree.losses.advantages.estimate`)."""
    trajectories = [t for g in groups for t in g]
    computed = estimate(trajectories, estimator, normalise, **settings)
    masks = [t.loss_mask[1:] for t in trajectories]
    weight = float(sum(m.sum() for m in masks))
    mean = float(sum((m * a[1:]).sum() for m, a in zip(masks, computed.values, strict=True))) / weight
    spread = float(sum((m * (a[1:] - mean) ** 2).sum() for m, a in zip(masks, computed.values, strict=True)))
    rewards = np.array([t.reward for t in trajectories])
    batches = np.array_split(np.arange(len(groups)), mini_batches)
    normalisers = [StepNormalisers.of([t for g in chunk for t in groups[g]]) for chunk in batches]
    return {
        "advantages": {t.source: a.tolist() for t, a in zip(trajectories, computed.values, strict=True)},
        "normalisers": [[n.total_tokens, n.sequences] for n in normalisers],
        "statistics": [rewards.mean(), rewards.std(), mean, (spread / weight) ** 0.5, computed.singletons],
    }


GAE = {"gamma": 0.9, "lam": 0.8}
"""``gae``'s settings here; its values are :func:`prefix_values`, a stand-in for a critic's."""


def prefix_values(trajectory) -> np.ndarray:
    """A value per token that is a function of the trajectory's prefix up to it (as a critic's is): the same on
    every path through a tree token."""
    return 0.01 * np.asarray(trajectory.input_ids, dtype=np.float64) + 0.001 * np.arange(len(trajectory))


def gae_report(settings: PlanSettings, groups: list[list], rank: int, comm: Collectives, normalise: bool) -> dict:
    """``gae`` on this rank's share: the host work plans it without advantages, then each rank scores the tokens
    its items own (:func:`prefix_values` for the critic's forward) and :func:`gae_advantages` merges the values
    over the ranks holding each group and estimates (``normalise``: whitened over the step's trained tokens)."""
    rule = AdvantageRule("gae", normalise, 1.0, **GAE)
    host = rl_host_work(settings, rule, mini_batches=2, sample=True)(held_data(groups, rank, 2), comm)
    scores = {id(t): np.full(len(t), np.nan) for group in host.groups for t in group.trajectories}
    for plan in host.plans:
        for row in plan.rows:
            for trajectory, path in trajectory_copies(row):
                mine = np.flatnonzero(path >= 0)
                mine = mine[row.owned[path[mine]] & (row.pred_pos[path[mine]] >= 0)]
                scores[id(trajectory)][mine] = prefix_values(trajectory)[mine]
    done = gae_advantages(host.groups, scores, host.sample_groups, rule, 2, comm)
    statistics = done.statistics
    return {
        "advantages": {t.source: done.held.by_trajectory[id(t)].tolist() for t in host.trajectories},
        "statistics": [statistics.reward_mean, statistics.reward_std, statistics.advantage_mean]
        + [statistics.advantage_std, statistics.singletons],
        "sample_advantages": {t.source: done.sample_advantages[id(t)].tolist() for t in host.sample},
        "unscaled": {t.source: done.held.unscaled[id(t)].tolist() for t in host.trajectories},
    }


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    comm = Collectives()
    groups = step_groups()
    trajectories = [t for g in groups for t in g]
    report = {"plans": [], "received": [], "rl": {}}
    longest = max(len(t) for t in trajectories)
    for settings in settings_list(longest):
        comm.received_bytes = 0
        plan, _ = plan_units(held_data(groups, rank, 2), settings, comm)
        expected = plan_step(trajectories, settings, 2).for_rank(rank)
        counts = [plan.flat_tokens, plan.tree_tokens, plan.packed_tokens]
        same = counts == [expected.flat_tokens, expected.tree_tokens, expected.packed_tokens]
        report["plans"].append(same and same_items(plan, expected))
        report["received"].append(comm.received_bytes)
    settings = PlanSettings(budget=max(len(t) for t in trajectories) + 30)
    for normalise in (False, True):
        report[f"gae-{normalise}"] = [gae_report(c, groups, rank, comm, normalise) for c in settings_list(longest)]
    for estimator in HOST_ESTIMATORS:
        normalise = ESTIMATORS.get(estimator).normalise is not None
        rule = AdvantageRule(estimator, normalise, 1.0)
        host = rl_host_work(settings, rule, mini_batches=2, sample=True)(held_data(groups, rank, 2), comm)
        held = {t.source: host.advantages[id(t)].tolist() for t in host.trajectories}
        statistics = host.statistics
        report["rl"][estimator] = {
            "advantages": held,
            "normalisers": [[n.total_tokens, n.sequences] for n in host.normalisers],
            "statistics": [statistics.reward_mean, statistics.reward_std, statistics.advantage_mean]
            + [statistics.advantage_std, statistics.singletons],
            "sample": [t.source for t in host.sample],
            "sample_advantages": {t.source: host.sample_advantages[id(t)].tolist() for t in host.sample},
        }
    sample, _ = check_sample(held_data(groups, rank, 2), comm)
    report["sample"] = [t.source for t in sample]
    dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(report))


@pytest.mark.distributed
def test_two_gloo_ranks_plan_and_score_only_what_they_hold(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = str(tmp_path / "report")
    torch.multiprocessing.start_processes(_rank, args=(port, out), nprocs=2, start_method="fork")
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    groups = step_groups()
    for rank, report in enumerate(reports):
        assert all(report["plans"]), (rank, report["plans"])
        all_gather = sum(len(pickle.dumps(g, protocol=5)) for g in groups[1 - rank :: 2])  # the other rank's share
        for received, settings in zip(report["received"], settings_list(60), strict=True):
            if settings.merge == "global":
                assert received > 0.9 * all_gather  # one trie of the step: every group goes to every rank
            else:
                assert received < all_gather, (received, all_gather)
    sample = [t.source for t in sample_groups([t for g in groups for t in g])]
    assert reports[0]["sample"] == reports[1]["sample"] == sample and sample
    trajectories = [t for g in groups for t in g]
    values = {id(t): prefix_values(t) for t in trajectories}
    raw = rl_reference(groups, "gae", False, 2, values=values, **GAE)["advantages"]
    for normalise in (False, True):  # whitened: the step's per-token mean and std, summed over ranks in step order
        gae = rl_reference(groups, "gae", normalise, 2, values=values, **GAE)
        assert (gae["advantages"] == raw) != normalise
        if normalise:
            assert abs(gae["statistics"][2]) < 1e-12 and abs(gae["statistics"][3] - 1) < 1e-12, gae["statistics"]
        for first, second in zip(reports[0][f"gae-{normalise}"], reports[1][f"gae-{normalise}"], strict=True):
            held = first["advantages"] | second["advantages"]  # each layout of settings_list
            assert set(held) == set(gae["advantages"])
            for source, advantages in held.items():  # to the bit
                assert advantages == gae["advantages"][source], source
            assert first["unscaled"] | second["unscaled"] == raw  # the critic's returns are A + V of these
            assert first["statistics"] == second["statistics"] == gae["statistics"]
            assert first["sample_advantages"] == second["sample_advantages"]
            assert first["sample_advantages"] == {s: gae["advantages"][s] for s in sample}
    for estimator in HOST_ESTIMATORS:
        normalise = ESTIMATORS.get(estimator).normalise is not None
        expected = rl_reference(groups, estimator, normalise, 2)
        first, second = reports[0]["rl"][estimator], reports[1]["rl"][estimator]
        held = first["advantages"] | second["advantages"]
        assert set(held) == set(expected["advantages"])  # every trajectory held by a rank
        for source, values in held.items():  # to the bit
            assert values == expected["advantages"][source], (estimator, source)
        assert first["normalisers"] == second["normalisers"] == expected["normalisers"], estimator
        assert first["statistics"] == second["statistics"] == expected["statistics"], estimator
        assert first["sample"] == second["sample"] == sample
        assert first["sample_advantages"] == second["sample_advantages"]
        assert first["sample_advantages"] == {s: expected["advantages"][s] for s in sample}
