"""The step plan (ds_tree/packing/plan.py) and the runner registry (ds_tree/engine/runners.py).

The plan is data: every rank's items, each of one execution kind; the trees of a step are built
once; ``ds-tree plan --explain`` prints it. A new kind is one runner and one registration: a row
class of a kind nobody registered is refused by name, and once registered it runs, with the same
loss and gradients as the runner it delegates to.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import pytest
import torch

from ds_tree.cli.plan import main as plan_main
from ds_tree.engine import runners
from ds_tree.losses.sft import Normalisers
from ds_tree.models.loading import load_model
from ds_tree.objectives.sft import run_rows
from ds_tree.packing import plan as plan_module
from ds_tree.packing.plan import PlanSettings, plan_step
from ds_tree.packing.rows import PackedRow
from ds_tree.registries import RUNNERS
from ds_tree.trees.random_trees import TreeShape, random_token_paths
from ds_tree.trees.trajectory import Trajectory

TINY = "configs/models/tiny_llama.json"


def forest(groups: int = 4, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    shape = TreeShape(trees=1, depth=3, children=(1, 3), node_tokens=(2, 12), alphabet=(3, 200))
    out = []
    for group in range(groups):
        for path in random_token_paths(rng, shape):
            out.append(Trajectory(np.array(path), np.ones(len(path)), group_id=f"g{group}"))
    return out


def kinds(plan) -> list[list[str]]:
    return [[row.kind for row in rows] for rows in plan.ranks]


def test_each_tree_goes_to_one_kind_and_every_trajectory_to_one_rank():
    trajectories = forest(groups=6)
    longest = max(len(t) for t in trajectories)
    budget = longest - 1  # at least one tree is over it
    for settings, expected in (
        (PlanSettings(budget=longest), {"packed"}),
        (PlanSettings(mode="dfs", budget=budget), {"walked"}),
        (PlanSettings(budget=budget, over_budget="dfs"), {"packed", "walked"}),
        (PlanSettings(budget=budget, sequence_parallel_size=2), {"packed", "shard"}),
    ):
        plan = plan_step(trajectories, settings, world_size=2)
        assert {kind for rank in kinds(plan) for kind in rank} == expected, settings
        owners = [
            id(part.tree.trajectories[i])
            for rank, rows in enumerate(plan.ranks)
            for row in rows
            if row.kind != "shard" or rank % 2 == 0  # a shard's trajectories are listed by its first rank
            for part in row.parts
            for i in part.trajectory_ids
        ]
        assert sorted(owners) == sorted(id(t) for t in trajectories), settings
        assert plan.flat_tokens == sum(len(t) for t in trajectories)


def test_a_step_builds_its_trees_once(monkeypatch):
    calls = []
    real = plan_module.build_forest
    monkeypatch.setattr(plan_module, "build_forest", lambda *a, **k: calls.append(k) or real(*a, **k))
    trajectories = forest()
    plan_step(trajectories, PlanSettings(budget=16, over_budget="dfs"), world_size=2)
    plan_step(trajectories, PlanSettings(budget=64, sequence_parallel_size=2), world_size=2)
    assert len(calls) == 2


@pytest.fixture(scope="module")
def model():
    return load_model(TINY, attention="reference", dtype=torch.float64, seed=0)


@dataclass(kw_only=True)
class CountedRow(PackedRow):
    """A row of a new execution kind (its runner counts the items it ran)."""

    kind: ClassVar[str] = "counted"


class CountingRunner(runners.PackedRunner):
    def __init__(self) -> None:
        self.ran = 0

    def task(self, *args, **kwargs):
        self.ran += 1
        return super().task(*args, **kwargs)


def _gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_a_new_kind_is_one_registration(model):
    rows = plan_step(forest(), PlanSettings(budget=4096), world_size=1).ranks[0]
    normalisers = Normalisers.from_rows(rows)
    counted = [CountedRow(**{f.name: getattr(row, f.name) for f in fields(row)}) for row in rows]
    with pytest.raises(ValueError, match="unknown execution kind 'counted'; choose one of packed, shard, walked"):
        run_rows(model, counted, normalisers)
    runner = CountingRunner()
    RUNNERS.register("counted", runner)
    try:
        model.zero_grad(set_to_none=True)
        packed = run_rows(model, rows, normalisers, backward=torch.Tensor.backward)
        expected = _gradients(model)
        new = run_rows(model, counted, normalisers, backward=torch.Tensor.backward)
    finally:
        RUNNERS.unregister("counted")
    assert runner.ran == len(rows) and new.loss == packed.loss
    got = _gradients(model)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_plan_explain_prints_every_ranks_items(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    with data.open("w") as handle:
        for t in forest(groups=6):
            record = {"group_id": t.group_id, "input_ids": t.input_ids.tolist(), "loss_mask": [1] * len(t)}
            handle.write(json.dumps(record) + "\n")
    longest = max(len(t) for t in forest(groups=6))
    overrides = [f"data.path={data}", f"packing.budget={longest - 1}", "packing.over_budget=dfs"]
    overrides.append("data.groups_per_step=6")
    sizes = ["--world-size", "2", "--memory-gib", "0.05"]  # a small memory keeps the dfs path search short
    assert plan_main(["configs/tiny_cpu.yaml", *overrides, *sizes, "--explain", "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["step_plan"]
    items = [item for rank in steps["ranks"] for item in rank]
    assert len(steps["ranks"]) == 2 and {item["kind"] for item in items} == {"packed", "walked"}
    assert all("over packing.budget" in item["why"] for item in items if item["kind"] == "walked")
    assert plan_main(["configs/tiny_cpu.yaml", *overrides, *sizes, "--explain", "0"]) == 0
    table = capsys.readouterr().out
    assert "step plan:" in table and " walked " in table and " packed " in table
    assert plan_main(["configs/online_parity_cpu.yaml", "--memory-gib", "0.05", "--explain"]) == 2
    assert "--explain needs data.path" in capsys.readouterr().err
