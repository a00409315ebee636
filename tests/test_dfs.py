"""The dfs mode: one chunk at a time on a cache of its ancestors' keys and values, exactly the flat objective.

Float64, one process: loss and every parameter's gradient of the walked trees equal the flat
baseline's (1e-10 relative) on random forests, deep chains of forks walked a token at a time, and
long nodes cut into chunks, with and without recomputation; tree mode with ``over_budget: dfs``
mixes packed rows and walked trees. Memory: on a tree ten times the packed budget, the activations
the walk holds at its peak stay within a small factor of one root-to-leaf path's. Two ranks,
float32, ZeRO-2 (DeepSpeed gradient accumulation over the per-chunk backwards): the trainer's step
gives the single-process flat gradient.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.comparison import gradient_errors
from ds_tree.config import ConfigError, load_config
from ds_tree.engine.dfs import DfsSettings, WalkStats, row_chunks
from ds_tree.engine.trainer import Trainer
from ds_tree.losses.sft import Normalisers
from ds_tree.memory.meters import PeakSavedMeter
from ds_tree.models.loading import enable_activation_checkpointing, load_model
from ds_tree.objectives.sft import run_rows
from ds_tree.packing.dfs_rows import DfsRow, split_over_budget, with_walked_rows
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.random_trees import TreeShape, random_forest
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest
from tests.helpers.configs import write_accumulating_ds_config, write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import torchrun

EXACT = 1e-10
"""Float64 relative error against the flat baseline (measured <= 2e-15)."""


@functools.cache
def _model(name: str, dtype: torch.dtype = torch.float64):
    return load_model(f"configs/models/tiny_{name}.json", attention="reference", dtype=dtype, seed=7)


def _masked(trajectories: list[Trajectory], seed: int) -> list[Trajectory]:
    """The same token sequences with untrained prefixes and fractional coefficients."""
    rng = np.random.default_rng(seed)
    out = []
    for t in trajectories:
        mask = rng.choice([0.0, 0.5, 1.0, 2.0], size=len(t))
        mask[: rng.integers(0, len(t))] = 0.0
        out.append(Trajectory(t.input_ids, mask, group_id=t.group_id, source=t.source))
    return out


def comb(teeth: int, step: int, seed: int) -> list[Trajectory]:
    """A deep chain of forks: a stem of ``teeth * step`` tokens with a short branch every ``step`` tokens."""
    rng = np.random.default_rng(seed)
    stem = rng.integers(3, 1024, teeth * step)
    paths = [stem] + [
        np.concatenate([stem[: i * step], rng.integers(3, 1024, rng.integers(1, 4))]) for i in range(1, teeth)
    ]
    return [Trajectory(ids, np.ones(len(ids)), group_id="comb", source=f"comb/{i}") for i, ids in enumerate(paths)]


def forest(shape: TreeShape, seed: int, groups: int = 2) -> list[Trajectory]:
    return [t for g in range(groups) for t in random_forest(random.Random(seed + g), shape, group_id=f"g{g}")]


def _gradients(model) -> dict[str, torch.Tensor]:
    gradients = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return gradients


def _flat(model, trajectories, normalisation):
    rows = pack_trajectories(trajectories, "flat", 10_000)
    normalisers = Normalisers.from_rows(rows)
    loss = run_rows(model, rows, normalisers, normalisation, backward=torch.Tensor.backward).loss
    return loss, _gradients(model), normalisers


def _walked(model, rows, normalisers, normalisation, settings, stats=None, scale: float = 1.0):
    """Loss and gradient of ``rows``; ``scale`` multiplies what each backward is given, as DeepSpeed does."""
    output = run_rows(
        model,
        rows,
        normalisers,
        normalisation,
        "exact",
        dfs=settings,
        backward_for=lambda n: lambda loss: (loss * scale).backward(),
        stats=stats,
    )
    return output.loss, {name: gradient / scale for name, gradient in _gradients(model).items()}


CASES = {
    "bushy forest, whole nodes": (
        "llama",
        forest(TreeShape(2, 4, (1, 3), (1, 9), prefixes=0.3, duplicates=0.3), 1),
        64,
        "token_mean",
    ),
    "long nodes, chunks of 5": (
        "qwen3",
        forest(TreeShape(1, 3, (1, 2), (12, 24), prefixes=0.3), 2),
        5,
        "sequence_mean",
    ),
    "deep comb, 1-token chunks": ("llama", comb(teeth=16, step=3, seed=3), 1, "sum"),
    "deep comb, chunks across forks": ("qwen2", comb(teeth=12, step=5, seed=4), 4, "token_mean"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dfs_equals_flat_float64(case: str) -> None:
    name, trajectories, chunk, normalisation = CASES[case]
    trajectories = _masked(trajectories, seed=len(case)) if normalisation != "sum" else trajectories
    model = _model(name)
    flat_loss, flat_gradients, normalisers = _flat(model, trajectories, normalisation)
    rows = pack_trajectories(trajectories, "dfs", 10_000)
    assert all(isinstance(row, DfsRow) for row in rows)
    for recompute in (False, True):
        stats = WalkStats()
        loss, gradients = _walked(model, rows, normalisers, normalisation, DfsSettings(chunk, recompute), stats)
        assert stats.chunks == sum(len(row_chunks(row, chunk)) for row in rows)
        assert abs(loss - flat_loss) <= EXACT * abs(flat_loss), (recompute, loss, flat_loss)
        errors = gradient_errors(flat_gradients, gradients)
        assert max(errors.values()) < EXACT, (recompute, max(errors.items(), key=lambda item: item[1]))


@pytest.mark.parametrize("every", [1, 2])
def test_dfs_with_activation_checkpointing_equals_flat_float64(every: int) -> None:
    """Checkpointed layers are recomputed inside the chunks' backward calls, which must attend on the
    cached keys and values as their forward did (the walk's backward runs in the cached attention)."""
    name, trajectories, chunk, normalisation = CASES["deep comb, chunks across forks"]
    reference = _model(name)
    flat_loss, flat_gradients, normalisers = _flat(reference, trajectories, normalisation)
    model = load_model(f"configs/models/tiny_{name}.json", attention="reference", dtype=torch.float64, seed=7)
    enable_activation_checkpointing(model, every)
    rows = pack_trajectories(trajectories, "dfs", 10_000)
    for recompute in (False, True):
        loss, gradients = _walked(model, rows, normalisers, normalisation, DfsSettings(chunk, recompute))
        assert abs(loss - flat_loss) <= EXACT * abs(flat_loss), (recompute, loss, flat_loss)
        errors = gradient_errors(flat_gradients, gradients)
        assert max(errors.values()) < EXACT, (recompute, max(errors.items(), key=lambda item: item[1]))


def test_chunks_follow_the_tree() -> None:
    """Node chains cut every ``chunk`` tokens; a fork's children hang off the chunk of its last token."""
    ids = {"a": [5, 6, 7, 8, 9], "b": [5, 6, 7, 8, 9, 10, 11], "c": [5, 6, 7, 20]}
    trajectories = [Trajectory(np.array(v), np.ones(len(v)), group_id="g", source=k) for k, v in ids.items()]
    (row,) = pack_trajectories(trajectories, "dfs", 100)
    # DFS order: [5 6 7] then child [8 9] (+ its only child [10 11]) then child [20]
    chunks = row_chunks(row, 2)
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 20]
    assert chunks.start.tolist() == [0, 2, 3, 5, 7]
    assert chunks.parent.tolist() == [-1, 0, 1, 2, 1]


def test_over_budget_trees_are_walked_beside_packed_rows() -> None:
    """Tree mode, ``over_budget: dfs``: trees with a path over the budget walked, the rest packed; same gradient."""
    trajectories = forest(TreeShape(1, 3, (1, 3), (3, 12)), seed=5, groups=3) + comb(teeth=8, step=6, seed=6)
    budget = 40
    trees = build_forest(trajectories)
    packed, walked = split_over_budget(trees, "tree", "dfs", budget)
    assert packed and walked and all(tree.max_path_tokens > budget for tree in walked)
    assert split_over_budget(trees, "tree", "error", budget) == (trees, [])
    from ds_tree.packing.balance import rows_per_rank
    from ds_tree.packing.parts import split_tree

    parts = [part for tree in packed for part in split_tree(tree, budget)]
    (rows,) = with_walked_rows(rows_per_rank(parts, 1, budget), walked, 1.0, 0.0)
    assert any(isinstance(row, DfsRow) for row in rows) and not all(isinstance(row, DfsRow) for row in rows)
    model = _model("llama")
    flat_loss, flat_gradients, normalisers = _flat(model, trajectories, "token_mean")
    # each backward scaled by 3 (DeepSpeed multiplies by the world size): the walk takes it out of
    # the cached gradients, else it would compound along the path
    loss, gradients = _walked(model, rows, normalisers, "token_mean", DfsSettings(budget), scale=3.0)
    assert abs(loss - flat_loss) <= EXACT * abs(flat_loss)
    assert max(gradient_errors(flat_gradients, gradients).values()) < EXACT


def test_peak_activation_memory_follows_one_path() -> None:
    """A tree of 310 tokens whose longest path has 30 (the packed budget): more than 10x the budget.

    Bound checked: the bytes autograd holds at the walk's peak plus the cached keys and values
    with their gradients stay within 1.5x the activations of packed tree mode on the longest path
    alone, and within 1x with recomputation; packed tree mode on the whole tree needs more than 8x
    (measured 10.4x), so the bound tells the two apart. The walk holds pieces of one path plus one
    chunk of up to ``chunk`` tokens (whole subtrees packed), so the chunk is half the path here
    (measured 1.07x and 0.41x). Parameters, which linear layers save for backward in every mode, are
    not counted.
    """
    trajectories = random_forest(random.Random(0), TreeShape(1, 3, (5, 5), (10, 10)))
    budget = max(len(t) for t in trajectories)
    tree_rows = pack_trajectories(trajectories, "tree", 10_000)
    assert budget == 30 and tree_rows[0].n_real >= 10 * budget
    model = _model("llama", torch.float32)

    def peak(run) -> int:
        meter = PeakSavedMeter(exclude=list(model.parameters()))
        with meter.context():
            run()
        model.zero_grad(set_to_none=True)
        return meter.peak

    normalisers = Normalisers.from_rows(tree_rows)
    longest = pack_trajectories([max(trajectories, key=len)], "tree", budget)
    path = peak(lambda: run_rows(model, longest, normalisers, "token_mean", backward=torch.Tensor.backward))
    whole = peak(lambda: run_rows(model, tree_rows, normalisers, "token_mean", backward=torch.Tensor.backward))
    assert whole > 8 * path
    rows = pack_trajectories(trajectories, "dfs", budget)
    for recompute, factor in ((False, 1.5), (True, 1.0)):
        stats, settings = WalkStats(), DfsSettings(budget // 2, recompute)
        held = peak(functools.partial(_walked, model, rows, normalisers, "token_mean", settings, stats))
        assert held + stats.peak_cache_bytes <= factor * path, (recompute, held, stats.peak_cache_bytes, path)


def test_dfs_config_errors(tmp_path: Path) -> None:
    data = write_forest(tmp_path / "forest.jsonl", groups=2)
    config = write_config(tmp_path, data, packing={"mode": "dfs", "budget": 40})
    # the default DeepSpeed JSON is ZeRO-3 (its ranks walk in lockstep); a path over the budget is no error
    Trainer(load_config(config, ["data.groups_per_step=2"])).prepare()
    load_config(config, ["objective.kind=grpo"])  # the RL objectives walk too (tests/test_dfs_rl.py)
    with pytest.raises(ConfigError, match="packing.dfs_chunk"):
        load_config(config, ["packing.dfs_chunk=-1"])


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("stage", "packing"),
    [
        (2, {"budget": 150, "over_budget": "dfs", "dfs_chunk": 64}),
        # every tree walked in 16-token chunks: a step starts with held forwards whose backward calls
        # follow one another with no forward between (ZeRO-3 overwrote the first ones' gradients)
        (3, {"budget": 150, "mode": "dfs", "dfs_chunk": 16}),
    ],
    ids=["zero2-over-budget", "zero3-all-walked"],
)
def test_two_ranks_dfs_match_single_process_flat(tmp_path: Path, stage: int, packing: dict) -> None:
    """Trees walked in dfs mode (over-budget ones next to packed rows, or all), ZeRO-2 and ZeRO-3, 2 ranks."""
    data = write_forest(tmp_path / "forest.jsonl")
    ds_path = write_accumulating_ds_config(tmp_path / "ds.json", stage)
    config = write_config(tmp_path, data, deepspeed=str(ds_path), packing=packing)
    out = tmp_path / "report.json"
    torchrun("tests/distributed/dfs_grad_check.py", "--config", str(config), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["zero_stage"] == stage and report["world_size"] == 2
    rows = report["walked_and_packed_rows_per_rank"]
    assert all(walked for walked, _ in rows), report
    if packing.get("mode") != "dfs":
        assert any(packed for _, packed in rows), report
    # float32 round-off against the flat single process in plain PyTorch (test_engine's bound)
    assert report["rel_loss_err"] < 1e-5, report
    assert report["max_rel_grad_err"] < 1e-5, report


def test_bench_reports_dfs_against_tree(tmp_path: Path) -> None:
    from ds_tree.cli.bench import main as bench_main

    data = write_forest(tmp_path / "forest.jsonl", groups=2)
    out = tmp_path / "bench.json"
    argv = ["--data", str(data), "--model", "configs/models/tiny_llama.json", "--steps", "1", "--warmup", "0"]
    assert bench_main([*argv, "--modes", "tree,dfs", "--budget", "400", "--dfs-chunk", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    dfs, tree = report["modes"]["dfs"], report["modes"]["tree"]
    assert dfs["packed_tokens_per_step"] == report["tree_tokens_per_step"]  # each tree once, never split
    assert dfs["step_time_s"] > 0 and 0 < dfs["peak_memory_bytes"] < tree["peak_memory_bytes"]
    assert report["dfs_time_over_tree"] == dfs["step_time_s"] / tree["step_time_s"]
    assert report["dfs_memory_over_tree"] < 1
    assert tree["calls_per_step"] >= 1 and dfs["calls_per_step"] >= 2  # per row; per chunk, a tree one at least


@pytest.mark.parametrize("packing", [{"mode": "dfs"}, {"mode": "tree", "over_budget": "dfs"}])
def test_trainer_plans_walked_rows(tmp_path: Path, packing: dict) -> None:
    """The trainer's plan: dfs mode walks every tree whole; over_budget dfs only the trees over the budget."""
    data = write_forest(tmp_path / "forest.jsonl")
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}))
    config = write_config(tmp_path, data, deepspeed=str(ds_path), packing={"budget": 150, **packing})
    trainer = Trainer(load_config(config))
    trainer.prepare()  # paths over the budget are no error here
    trajectories = trainer.sampler.trajectories_for_step(trainer.groups, 0)
    plan = trainer.layout.plan(trajectories, rank=0)
    walked = [row for row in plan.rows if isinstance(row, DfsRow)]
    trees = build_forest(trajectories)
    over = [tree for tree in trees if tree.max_path_tokens > 150]
    expected = trees if packing["mode"] == "dfs" else over
    assert sorted(row.n_real for row in walked) == sorted(tree.n_tokens for tree in expected)
    assert all(row.n_real for row in plan.rows)  # no empty padding rows: the walk evens out backward calls
    if packing["mode"] == "dfs":
        assert plan.packed_tokens == plan.tree_tokens  # nothing split, nothing duplicated
    else:
        assert len(walked) < len(plan.rows) and all(
            row.n_real <= 150 for row in plan.rows if not isinstance(row, DfsRow)
        )
