"""Each rank plans its own share of a step (ds_tree/packing/distributed.py): from summaries exchanged between
ranks, every rank's items equal what the whole-step planner (``plan_step``) gives that rank, for every
execution kind and world sizes 1..8; every trajectory is trained exactly once over the ranks with its
restoration weights; the loss and gradients of a step on 2 simulated ranks are the old planner's; and the
exchange runs over torch.distributed (gloo)."""

from __future__ import annotations

import json
import pickle
import random
import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.comparison import gradient_errors, relative_error
from ds_tree.engine.dfs import DfsSettings
from ds_tree.errors import DataError
from ds_tree.losses.sft import Normalisers
from ds_tree.models.loading import load_model
from ds_tree.objectives.sft import run_rows
from ds_tree.packing.balance import lpt_shares
from ds_tree.packing.distributed import (
    GroupUnits,
    RankPlanner,
    all_gather_exchange,
    balance_summaries,
    plan_rank,
    simulate_ranks,
)
from ds_tree.packing.plan import PlanSettings, balance, plan_step
from ds_tree.trees.random_trees import TreeShape, random_token_paths
from ds_tree.trees.token_arrays import TOKEN_FIELDS
from ds_tree.trees.trajectory import Trajectory

TINY = "configs/models/tiny_llama.json"


def random_groups(groups: int, seed: int) -> list[list[Trajectory]]:
    """Groups of random trees (some groups two trees: distinct first tokens), fractional loss masks."""
    rng = random.Random(seed)
    out = []
    for group in range(groups):
        trees, depth = rng.choice([1, 1, 2]), rng.randint(1, 4)
        shape = TreeShape(trees=trees, depth=depth, children=(1, 3), node_tokens=(1, 12), alphabet=(3, 200))
        paths = random_token_paths(rng, shape)
        masks = [np.array([rng.choice([0.0, 1.0, 0.5]) for _ in path]) for path in paths]
        out.append([Trajectory(np.array(p), m, group_id=f"g{group}") for p, m in zip(paths, masks, strict=True)])
    return out


def settings_for(groups: list[list[Trajectory]]) -> list[PlanSettings]:
    """One setting per kind and mix of kinds: packed (split trees too), flat, dfs, over_budget dfs, and each
    under sequence parallelism (S = 2: shards, walked shards, walked shards beside packed rows), merge global."""
    longest = max(len(t) for group in groups for t in group)
    base = PlanSettings(budget=longest, block=4, cost_per_pair=0.01, dfs_chunk=7)
    tight = replace(base, budget=longest - 3)  # some paths over it
    kinds = [base, replace(base, budget=longest // 2 + 8), replace(base, mode="flat"), replace(tight, mode="dfs")]
    kinds += [replace(tight, over_budget="dfs"), replace(base, merge="global")]
    kinds += [replace(tight, sequence_parallel_size=2), replace(tight, mode="dfs", sequence_parallel_size=2)]
    kinds += [replace(tight, over_budget="dfs", sequence_parallel_size=2)]
    kinds += [replace(base, mode="flat", budget=longest // 2)]
    return kinds


def assert_same_item(new, old) -> None:
    """Same class, token arrays, shard position and parts (the same trajectory objects, ids, token indices)."""
    assert type(new) is type(old)
    for name in TOKEN_FIELDS:
        assert np.array_equal(getattr(new, name), getattr(old, name)), name
    for name in ("n_real", "position", "chunk", "size", "start", "end"):
        assert getattr(new, name, None) == getattr(old, name, None), name
    assert len(new.parts) == len(old.parts)
    for a, b in zip(new.layout_parts, old.layout_parts, strict=True):
        assert a.trajectory_ids == b.trajectory_ids and np.array_equal(a.token_index, b.token_index)
        assert [id(t) for t in a.tree.trajectories] == [id(t) for t in b.tree.trajectories]


def test_the_heap_lpt_picks_what_the_linear_scan_picked():
    """The balance's greedy LPT by a heap equals the min-over-ranks scan it replaced, ties included."""

    def linear(costs, world):
        order = sorted(range(len(costs)), key=lambda i: -costs[i])
        loads, assignment = [0.0] * world, [[] for _ in range(world)]
        for index in order:
            rank = min(range(world), key=lambda r: (loads[r], len(assignment[r])))
            assignment[rank].append(index)
            loads[rank] += costs[index]
        return [sorted(members) for members in assignment]

    rng = random.Random(0)
    for _ in range(200):
        costs = [float(rng.choice([0, 1, 2, 3, 7.5, rng.random()])) for _ in range(rng.randint(0, 40))]
        world = rng.randint(1, 9)
        assert lpt_shares(costs, world) == linear(costs, world)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_rank_gets_the_items_of_the_whole_step_plan(seed):
    groups = random_groups(7, seed)
    trajectories = [t for group in groups for t in group]
    for settings in settings_for(groups):
        for world in range(1, 9):
            if world % settings.sequence_parallel_size:
                continue
            try:
                old = plan_step(trajectories, settings, world)
            except DataError as error:  # a path over the budget: the same error on every rank
                with pytest.raises(DataError, match="longer than the token budget") as raised:
                    simulate_ranks(GroupUnits(groups), settings, world)
                assert str(raised.value) == str(error)
                continue
            new = simulate_ranks(GroupUnits(groups), settings, world)
            for rank, plan in enumerate(new):
                expected = old.for_rank(rank)
                counts = (plan.flat_tokens, plan.tree_tokens, plan.packed_tokens)
                assert counts == (expected.flat_tokens, expected.tree_tokens, expected.packed_tokens), settings
                assert [row.kind for row in plan.rows] == [row.kind for row in expected.rows], (settings, world)
                for row, reference in zip(plan.rows, expected.rows, strict=True):
                    assert_same_item(row, reference)


def test_the_union_of_the_ranks_items_covers_every_trajectory_once_with_its_weights():
    """Checked on the items alone (not against plan_step): every trajectory is listed by exactly one item
    over all ranks, and each restoration sum over all ranks' items is the trajectories' own total."""
    groups = random_groups(9, seed=5)
    trajectories = [t for group in groups for t in group]
    for settings in settings_for(groups):
        world = 4
        try:
            plans = simulate_ranks(GroupUnits(groups), settings, world)
        except DataError:
            continue
        items = [row for plan in plans for row in plan.rows]
        listed = [id(part.tree.trajectories[i]) for row in items for part in row.parts for i in part.trajectory_ids]
        assert sorted(listed) == sorted(id(t) for t in trajectories), settings
        coefficients = [np.concatenate([[0.0], t.loss_mask[1:]]) for t in trajectories]
        total = sum(float(row.mask_sum.sum()) for row in items)
        assert total == pytest.approx(sum(float(c.sum()) for c in coefficients), rel=1e-12)
        sequences = sum(float(row.seq_mean_sum.sum()) for row in items)
        assert sequences == pytest.approx(sum(c.sum() > 0 for c in coefficients), rel=1e-12)


def test_the_balance_is_the_whole_step_plans():
    groups = random_groups(40, seed=3)
    trajectories = [t for group in groups for t in group]
    for settings in settings_for(groups)[:3] + settings_for(groups)[6:]:
        for world in (2, 4, 8):
            planners = [RankPlanner(GroupUnits(groups), settings, world, rank) for rank in range(world)]
            try:
                assignment = balance_summaries([p.summarise() for p in planners], settings, world)
            except DataError:
                continue
            expected = plan_step(trajectories, settings, world).rank_costs()
            assert np.allclose(assignment.rank_costs(), expected, rtol=1e-12)
            assert balance(assignment.rank_costs().tolist()) == pytest.approx(balance(expected), rel=1e-12)


def test_a_rank_builds_only_its_share_and_its_own_items_trees():
    """Summaries: a 1/W share of the units' flat tokens; materialising: only the units its items hold; what it sends is
    a few numbers per part (not the trajectories)."""
    groups = random_groups(32, seed=2)
    settings = PlanSettings(budget=max(len(t) for group in groups for t in group))
    world = 8
    planners = [RankPlanner(GroupUnits(groups), settings, world, rank) for rank in range(world)]
    summaries = [planner.summarise() for planner in planners]
    assert sorted(unit for p in planners for unit in p.read_units) == list(range(32))
    sizes = GroupUnits(groups).sizes()
    shares = [int(sizes[sorted(p.read_units)].sum()) for p in planners]
    assert max(shares) <= sizes.sum() / world + sizes.max()  # the greedy LPT's bound on flat tokens
    assignment = planners[0].balance(summaries)
    for rank, planner in enumerate(planners):
        summarised = set(planner.read_units)
        planner.materialise(assignment)
        assert planner.read_units == summarised | set(assignment.units_of(rank))
    per_part = len(pickle.dumps(summaries)) / sum(len(s.parts) for s in summaries)
    assert per_part < 120, per_part


@pytest.fixture(scope="module")
def model():
    return load_model(TINY, attention="reference", dtype=torch.float64, seed=0)


def _step(model, plans, dfs: DfsSettings) -> tuple[float, dict[str, torch.Tensor]]:
    """One step over simulated ranks: the normalisers summed over the ranks (the all-reduce), each rank's items
    forwarded and backwarded, the gradients summed (DeepSpeed's all-reduce, its average cancelled)."""
    normalisers = Normalisers.from_tensor(sum(Normalisers.from_rows(plan.rows).as_tensor() for plan in plans))
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for plan in plans:
        loss += run_rows(model, plan.rows, normalisers, backward=torch.Tensor.backward, dfs=dfs).loss
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, gradients


@pytest.mark.parametrize("over_budget", ["error", "dfs"])
def test_a_step_on_two_simulated_ranks_trains_as_the_whole_step_plan(model, over_budget):
    """float64 tiny Llama: loss and gradients of the new planner's step equal the old planner's (packed rows,
    split trees, walked trees beside them)."""
    groups = random_groups(6, seed=11)
    trajectories = [t for group in groups for t in group]
    longest = max(len(t) for t in trajectories)
    settings = PlanSettings(budget=longest if over_budget == "error" else longest - 3, over_budget=over_budget)
    dfs = DfsSettings(chunk=8)
    old_plan = plan_step(trajectories, settings, 2)
    old = _step(model, [old_plan.for_rank(rank) for rank in range(2)], dfs)
    new_plans = simulate_ranks(GroupUnits(groups), settings, 2)
    assert {row.kind for plan in new_plans for row in plan.rows} == (
        {"packed"} if over_budget == "error" else {"packed", "walked"}
    )
    new = _step(model, new_plans, dfs)
    assert relative_error(new[0], old[0]) <= 1e-10
    assert max(gradient_errors(old[1], new[1]).values()) <= 1e-10


def _gloo_rank(rank: int, groups: list[list[Trajectory]], port: int, out: str) -> None:
    """A rank of a 2-process gloo group plans with the torch exchange; its items equal plan_step's for it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    trajectories = [t for group in groups for t in group]
    kinds = []
    for settings in [s for s in settings_for(groups) if s.sequence_parallel_size == 2]:
        plan = plan_rank(GroupUnits(groups), settings, 2, rank, all_gather_exchange)
        expected = plan_step(trajectories, settings, 2).for_rank(rank)
        for row, reference in zip(plan.rows, expected.rows, strict=True):
            assert_same_item(row, reference)
        kinds.append(sorted({row.kind for row in plan.rows}))
    dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(kinds))


@pytest.mark.distributed
def test_the_exchange_runs_over_torch_distributed(tmp_path):
    """Sequence-parallel kinds (shards, walked shards, walked shards beside packed rows) with S = 2 over a
    real gloo group (plain torch.distributed: no DeepSpeed op to build)."""
    groups = random_groups(6, seed=4)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = str(tmp_path / "kinds")
    torch.multiprocessing.start_processes(_gloo_rank, args=(groups, port, out), nprocs=2, start_method="fork")
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    assert reports[0] == reports[1] == [["packed", "shard"], ["walked_shard"], ["packed", "walked_shard"]]


HOST_KEYS = {
    "step",
    "world_size",
    "groups",
    "trajectories",
    "flat_tokens",
    "tree_tokens",
    "parts",
    "repeat",
    "clock",
    "per_rank_seconds_max",
    "per_rank_seconds_mean",
    "summarise_seconds_max",
    "materialise_seconds_max",
    "global_seconds",
    "speedup",
    "balance",
    "global_balance",
    "exchange_bytes",
    "dataset_bytes_per_rank",
    "global_dataset_bytes_per_rank",
    "bytes_per_rank_max",
    "rollout_bytes_per_rank_max",
    "rollout_all_gather_bytes_per_rank",
}


@pytest.mark.parametrize("source", ["jsonl", "converted"])
def test_the_scale_simulator_prints_the_host_figures(tmp_path, capsys, source):
    """``ds-tree plan CONFIG --world-size W --host --json``: each simulated rank's host work beside the
    whole-step plan, on tokens JSONL (loaded whole) and on a converted dataset (read lazily)."""
    from ds_tree.cli.plan import main as plan_main
    from ds_tree.data.tree_dataset import save_tree_dataset

    groups = random_groups(24, seed=6)
    trajectories = [t for group in groups for t in group]
    data = tmp_path / "data.jsonl"
    with data.open("w") as handle:
        for t in trajectories:
            record = {"group_id": t.group_id, "input_ids": t.input_ids.tolist(), "loss_mask": t.loss_mask.tolist()}
            handle.write(json.dumps(record) + "\n")
    if source == "converted":
        save_tree_dataset(trajectories, tmp_path / "converted", {})
        data = tmp_path / "converted"
    overrides = [f"data.path={data}", "data.groups_per_step=24", "packing.budget=64", "packing.over_budget=dfs"]
    argv = ["configs/tiny_cpu.yaml", *overrides, "--world-size", "4", "--memory-gib", "0.05", "--repeat", "1"]
    assert plan_main([*argv, "--host", "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    assert set(host) == HOST_KEYS
    assert (host["world_size"], host["groups"], host["trajectories"]) == (4, 24, len(trajectories))
    assert host["flat_tokens"] == sum(len(t) for t in trajectories)
    assert host["balance"] == pytest.approx(host["global_balance"], rel=1e-12) and host["balance"] >= 1
    assert host["bytes_per_rank_max"] == host["exchange_bytes"] + host["dataset_bytes_per_rank"]
    assert 0 < host["dataset_bytes_per_rank"] < host["global_dataset_bytes_per_rank"]
    assert host["exchange_bytes"] < host["rollout_bytes_per_rank_max"] < host["rollout_all_gather_bytes_per_rank"]
    assert 0 < host["per_rank_seconds_max"] and 0 < host["global_seconds"]
    assert plan_main([*argv, "--host", "0"]) == 0
    assert "host work of step 0 over 4 simulated ranks" in capsys.readouterr().out
    assert plan_main(["configs/online_parity_cpu.yaml", "--memory-gib", "0.05", "--host"]) == 2
    assert "--host needs data.path" in capsys.readouterr().err
