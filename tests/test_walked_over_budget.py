"""Tree mode with ``packing.over_budget: dfs`` under sequence parallelism (S = 2): the trees with a path over
the budget walked by the sequence-parallel group (each rank one shard of every chunk), the others packed into
rows each rank computes alone, in one step plan; SFT and GRPO equal the single-process flat baseline in
float64 (tiny Qwen3-MoE with its router load-balancing loss, so the sharded walk's router term is in both)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ds_tree.comparison import gradient_errors, relative_error
from ds_tree.data import load_trajectories
from ds_tree.engine.dfs import DfsSettings
from ds_tree.losses.rl import RLSettings
from ds_tree.models.moe import RouterAuxLoss
from ds_tree.models.ulysses import enable_sequence_parallel
from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows, run_rl_rows
from ds_tree.objectives.sft import global_normalisers, run_rows
from ds_tree.packing.plan import PlanSettings, plan_step
from ds_tree.verify.sequence_parallel import group_gradients, spawn_group
from ds_tree.verify.tree_vs_flat import checked_advantages, rl_policies, run_mode, run_rl_mode
from tests.helpers import ROOT
from tests.test_sequence_parallel_rl import write_rl_cases

MODEL = str(ROOT / "configs/models/tiny_qwen3_moe.json")
BUDGET = 290
"""The first 10 cases make trees with longest paths of 330, 300, 280 and 150 tokens: two walked, two packed."""
CHUNK = 48
SIZE = 2


def _plan() -> PlanSettings:
    return PlanSettings(mode="tree", over_budget="dfs", budget=BUDGET, sequence_parallel_size=SIZE, dfs_chunk=CHUNK)


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    return load_trajectories(write_rl_cases(tmp_path_factory.mktemp("walked_over_budget") / "rl.jsonl"))[:10]


def test_the_plan_walks_the_long_trees_over_their_group_and_packs_the_others(trajectories):
    """Four ranks, two groups: every rank runs its group's walked shards first (the same trees, its own
    shard position), then its own packed rows; every tree is walked by one group or packed, never both."""
    plan = plan_step(trajectories, _plan(), world_size=4)
    walked_trees, packed_trees = set(), set()
    for rank, items in enumerate(plan.ranks):
        kinds = [row.kind for row in items]
        walks = kinds.count("walked_shard")
        assert kinds == ["walked_shard"] * walks + ["packed"] * (len(kinds) - walks), kinds
        assert all(row.position == rank % SIZE and row.chunk == CHUNK for row in items[:walks])
        partner = plan.ranks[rank ^ 1][:walks]  # the other rank of its group walks the same trees
        assert [id(row.row_parts[0].tree) for row in items[:walks]] == [id(row.row_parts[0].tree) for row in partner]
        walked_trees |= {id(part.tree) for row in items[:walks] for part in row.row_parts}
        packed_trees |= {id(part.tree) for row in items[walks:] for part in row.parts}
    longest = {id(part.tree): part.tree.max_path_tokens for items in plan.ranks for row in items for part in row.parts}
    assert walked_trees.isdisjoint(packed_trees) and walked_trees | packed_trees == set(longest)
    assert {tree for tree, tokens in longest.items() if tokens > BUDGET} == walked_trees and len(walked_trees) == 2
    assert "(over_budget: dfs), its chunks sharded over 2 ranks" in plan.explain()
    # the flat layout walks nothing (over_budget applies to tree mode): long trajectories go to sharded rows
    flat = plan_step(trajectories, replace(_plan(), mode="flat", budget=256), world_size=2)
    assert {row.kind for items in flat.ranks for row in items} == {"shard", "packed"}


def _rank(rank: int, trajectories, options: dict) -> dict | None:
    """One rank of the group: the plan's items run by their runners (the step functions), the loss and
    gradients summed over the group; rank 0 compares them with the flat baseline from the same weights."""
    rl = options["objective"] == "grpo"
    old, model = rl_policies(MODEL, "torch", torch.float64, 0, 0.5)
    for policy in (old, model):
        enable_sequence_parallel(policy, SIZE)
    rows = plan_step(trajectories, _plan(), SIZE).for_rank(rank).rows
    router_aux = RouterAuxLoss.of_model(model, 0.5, sum(len(t) for t in trajectories))
    dfs = DfsSettings(CHUNK)
    settings, advantages = RLSettings(), None
    if rl:
        advantages = checked_advantages(trajectories, "grpo", False).by_trajectory()
        prepared = prepare_rl_rows(old, rows, advantages, settings, StepNormalisers.of(trajectories), dfs=dfs)
        output = run_rl_rows(model, prepared, settings, backward=torch.Tensor.backward, dfs=dfs, router_aux=router_aux)
    else:
        output = run_rows(
            model, rows, global_normalisers(rows), backward=torch.Tensor.backward, dfs=dfs, router_aux=router_aux
        )
    losses = torch.tensor([output.loss, output.router_aux], dtype=torch.float64)
    dist.all_reduce(losses)
    gradients = group_gradients(model)
    if rank != 0:
        return None
    old, single = rl_policies(MODEL, "torch", torch.float64, 0, 0.5)
    if rl:
        flat = run_rl_mode(
            single, old, None, trajectories, "flat", 4096, 1, advantages, settings, router_aux=router_aux
        )
    else:
        flat = run_mode(single, trajectories, "flat", 4096, 1, "token_mean", "exact", router_aux=router_aux)
    errors = gradient_errors(flat.gradients, gradients)
    return {
        "kinds": sorted({row.kind for row in rows}),
        "loss_rel_err": relative_error(float(losses[0]), flat.loss),
        "router_aux_rel_err": relative_error(float(losses[1]), flat.router_aux),
        "max_rel_grad_err": max(errors.values()),
        "gradients": len(errors),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_walked_and_packed_trees_in_one_step_equal_flat_in_float64(trajectories, objective):
    report = spawn_group(_rank, trajectories, {"size": SIZE, "threads": 1, "objective": objective})
    assert report["kinds"] == ["packed", "walked_shard"], report  # rank 0 ran both kinds
    assert report["gradients"] == len(list(rl_policies(MODEL, "torch", torch.float64, 0, 0.5)[1].parameters()))
    # float64: measured 0 (loss, router loss) and 2.2e-15 / 2.5e-15 (gradients, SFT / GRPO)
    for error in ("loss_rel_err", "router_aux_rel_err", "max_rel_grad_err"):
        assert report[error] <= 1e-10, (error, report)
    assert np.isfinite(report["loss_rel_err"])


def test_the_memory_plan_shards_the_walk_of_over_budget_trees(tmp_path: Path) -> None:
    """``ds-tree plan``: with over_budget dfs and S = 2 the walk of a long path is sharded over the group,
    as with packing.mode dfs (it was one rank's walk before the combination was built)."""
    from ds_tree.config import load_config
    from ds_tree.engine.memory import plan_of
    from ds_tree.models.loading import load_config as load_model_config
    from tests.helpers.configs import write_config
    from tests.helpers.data import write_forest

    data = write_forest(tmp_path / "forest.jsonl")
    config = write_config(tmp_path, data, packing={"budget": 200, "over_budget": "dfs", "dfs_chunk": 64})
    walks = {}
    for size in (1, 2):
        loaded = load_config(config, [f"parallel.sequence_parallel_size={size}"])
        model_config = load_model_config(loaded.model.source)
        walks[size] = plan_of(loaded, str(config), model_config, 2, 80.0, path_tokens=4096)["dfs"]
    assert walks[2]["without_recompute"]["peak"] < walks[1]["without_recompute"]["peak"]


@pytest.mark.distributed
def test_two_ranks_zero3_walk_the_long_trees_and_pack_the_others_as_the_flat_step(tmp_path: Path) -> None:
    """The trainer's update on 2 ranks, S = 2, ZeRO-3 (lockstep schedule, gradient accumulation): trees over
    the budget walked by the group and the short ones packed in one update equal the float64 flat step
    (float32 round-off), and a training step with its self-check runs (``tests/distributed/sp_grad_check.py``)."""
    import json

    from tests.helpers.configs import write_config
    from tests.helpers.launch import torchrun
    from tests.test_sequence_parallel import BLOCK as SP_BLOCK
    from tests.test_sequence_parallel import BUDGET as SP_BUDGET
    from tests.test_sequence_parallel import DFS_CHUNK, one_kv_head_model, write_accumulating_ds_config, write_cases

    data = write_cases(tmp_path / "cases.jsonl")
    zero3 = write_accumulating_ds_config(tmp_path / "zero3.json", 3)
    packing = {"budget": SP_BUDGET, "block": SP_BLOCK, "over_budget": "dfs", "dfs_chunk": DFS_CHUNK}
    model = {"source": str(one_kv_head_model(tmp_path / "model.json"))}
    config = write_config(tmp_path, data, model=model, packing=packing, parallel={"sequence_parallel_size": SIZE})
    out = tmp_path / "report.json"
    torchrun(
        "tests/distributed/sp_grad_check.py", "--config", str(config), "--out", str(out),
        "--deepspeed", str(zero3), "--dfs-chunk", str(DFS_CHUNK), timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    mixed = [run for run in report["runs"] if run["mode"] == "tree" and run["case"] == "forest"]
    assert len(mixed) == 1 and mixed[0]["sharded_rows"] >= 1 and mixed[0]["own_rows"] >= 1, report  # both kinds
    for run in report["runs"]:  # float32 against the float64 flat step
        assert run["loss_rel_err"] < 1e-6 and run["max_rel_grad_err"] < 1e-5 and run["grad_norm_rel_err"] < 1e-5, run
    assert (
        np.isfinite(report["train_step_loss"]) and report["train_step_selfcheck"]["selfcheck/max_grad_rel_err"] < 1e-5
    )
