"""Sequence parallelism (Ulysses, S = 2): planning and sharding, start-up checks, and the 2-rank gradient parity."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_tree.config import ConfigError, load_config
from ds_tree.engine.trainer import Trainer
from ds_tree.losses.sft import Normalisers
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.ulysses import check_heads
from ds_tree.packing.balance import rows_per_rank
from ds_tree.packing.modes import pack_trajectories
from ds_tree.packing.parts import split_tree
from ds_tree.packing.sequence_parallel import RowShard, plan_sequence_parallel_rows, shard_row
from ds_tree.trees.random_trees import TreeShape, random_forest
from ds_tree.trees.trie import build_forest
from tests.helpers import ROOT
from tests.helpers.configs import write_accumulating_ds_config, write_config
from tests.helpers.launch import environment, torchrun
from tests.helpers.processes import run_group
from tests.helpers.runs import dry_run_in_process

BUDGET, BLOCK, SIZE = 256, 16, 2
DFS_CHUNK = 48
"""packing.dfs_chunk of mode dfs: chain and packed chunks, odd-sized ones padded to a multiple of SIZE."""


def write_cases(path: Path, seed: int = 0) -> Path:
    """Groups ``forest/<n>`` (three with paths over ``BUDGET``, two short) and ``path/0`` (one 500-token path)."""
    rng = np.random.default_rng(seed)
    records = []
    for group, (stem_length, longest) in enumerate([(150, 330), (120, 300), (200, 280), (60, 150), (40, 120)]):
        stem = rng.integers(3, 1024, stem_length).tolist()
        for branch in range(3):
            cut = int(rng.integers(stem_length // 3, stem_length))
            length = longest if branch == 0 else int(rng.integers(cut + 20, longest))
            ids = stem[:cut] + rng.integers(3, 1024, length - cut).tolist()
            mask = [0] * min(cut, 25) + [1] * (length - min(cut, 25))
            records.append({"group_id": f"forest/{group}", "input_ids": ids, "loss_mask": mask})
    ids = rng.integers(3, 1024, 500).tolist()
    records.append({"group_id": "path/0", "input_ids": ids, "loss_mask": [0] * 50 + [1] * 450})
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def one_kv_head_model(path: Path) -> Path:
    """The tiny Llama with 4 attention heads and 1 key/value head (fewer than S: Ulysses replicates it)."""
    fields = json.loads((ROOT / "configs/models/tiny_llama.json").read_text())
    fields["num_key_value_heads"] = 1
    path.write_text(json.dumps(fields))
    return path


def random_trees(seed: int):
    rng = random.Random(seed)
    shape = TreeShape(depth=3, children=(1, 3), node_tokens=(1, 170), prefixes=0.2, duplicates=0.1)
    trajectories = [t for g in range(6) for t in random_forest(rng, shape, group_id=f"g{g}")]
    return trajectories, build_forest(trajectories)


@pytest.mark.parametrize("seed", range(4))
def test_plan_places_long_trees_on_sharded_rows_and_shards_count_each_term_once(seed: int) -> None:
    trajectories, trees = random_trees(seed)
    world = 4
    plan = plan_sequence_parallel_rows(trees, world, SIZE, BUDGET, BLOCK, pad_id=0)
    assert len({len(rows) for rows in plan.sharded}) == 1 and len({len(rows) for rows in plan.own}) == 1
    assert plan.sharded[0] and plan.own[0]
    for rows in plan.sharded:
        for row in rows:
            assert row.n_real <= SIZE * BUDGET and row.n_tokens % (SIZE * BLOCK) == 0
            assert all(max(len(t) for t in part.tree.trajectories) > BUDGET for part in row.parts)
    for rows in plan.own:
        assert all(row.n_real <= BUDGET and row.n_tokens % BLOCK == 0 for row in rows)
        assert all(max(len(t) for t in part.tree.trajectories) <= BUDGET for row in rows for part in row.parts)
    # Over all ranks the shards hold each loss term once: the step's normalisers are those of the
    # whole rows, and each shard's targets are predicted from inside the shard.
    rows = [row for rank in range(world) for row in plan.rank_rows(rank, SIZE)]
    whole = pack_trajectories(trajectories, "tree", SIZE * BUDGET)
    assert Normalisers.from_rows(rows).as_tensor().tolist() == pytest.approx(
        Normalisers.from_rows(whole).as_tensor().tolist(), rel=1e-12
    )
    for whole in (row for rows in plan.sharded for row in rows):
        shards = [shard_row(whole, SIZE, position) for position in range(SIZE)]
        np.testing.assert_array_equal(sum(shard.mask_sum for shard in shards), whole.mask_sum)
        for shard in shards:
            length = shard.end - shard.start
            assert np.all(shard.pred_pos[shard.mask_sum > 0] < length)
            inputs = shard.tensors()
            assert inputs["input_ids"].shape[1] == length and inputs["kv_end"].shape[1] == whole.n_tokens


def test_without_long_trees_the_plan_is_the_plain_one() -> None:
    trajectories, _ = random_trees(7)
    short = [t for t in trajectories if len(t) <= BUDGET]
    trees = build_forest(short)
    plan = plan_sequence_parallel_rows(trees, 4, SIZE, BUDGET, BLOCK)
    assert plan.sharded == [[], []] and not any(isinstance(r, RowShard) for r in plan.rank_rows(3, SIZE))
    plain = rows_per_rank([part for tree in trees for part in split_tree(tree, BUDGET)], 4, BUDGET, BLOCK)
    assert [[row.input_ids.tolist() for row in rows] for rows in plan.own] == [
        [row.input_ids.tolist() for row in rows] for rows in plain
    ]


def test_heads_that_ulysses_cannot_split_are_config_errors() -> None:
    config = load_model_config(ROOT / "configs/models/tiny_llama.json")  # 4 heads, 2 key/value heads
    check_heads(config, 2, "tiny")
    check_heads(config, 4, "tiny")
    with pytest.raises(ConfigError, match="parallel.sequence_parallel_size=8: model.source tiny has 4 attention heads"):
        check_heads(config, 8, "tiny")
    config.num_attention_heads, config.num_key_value_heads = 6, 3
    with pytest.raises(ConfigError, match="3 key/value heads, which neither divide 2"):
        check_heads(config, 2, "tiny")


def test_a_path_over_the_budget_needs_sequence_parallelism(tmp_path: Path, monkeypatch) -> None:
    data = write_cases(tmp_path / "cases.jsonl")
    config_path = write_config(tmp_path, data, packing={"budget": BUDGET})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"packing.budget \(256\) is below the longest trajectory \(500 tokens"):
        Trainer(load_config(config_path)).prepare()
    Trainer(load_config(config_path, ["parallel.sequence_parallel_size=2"])).prepare()
    Trainer(
        load_config(config_path, ["parallel.sequence_parallel_size=2", "packing.over_budget=sequence_parallel"])
    ).prepare()
    with pytest.raises(ConfigError, match="over_budget=sequence_parallel .* set that size > 1"):
        Trainer(load_config(config_path, ["packing.over_budget=sequence_parallel"])).prepare()
    with pytest.raises(ConfigError, match=r"packing.budget x parallel.sequence_parallel_size \(200 x 2\)"):
        Trainer(load_config(config_path, ["parallel.sequence_parallel_size=2", "packing.budget=200"])).prepare()
    # the trees over the budget walked by the group, the others packed (tests/test_walked_over_budget.py)
    Trainer(load_config(config_path, ["parallel.sequence_parallel_size=2", "packing.over_budget=dfs"])).prepare()
    Trainer(load_config(config_path, ["parallel.sequence_parallel_size=2", "packing.mode=dfs"])).prepare()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"sequence_parallel_size \(2\) does not divide the world size \(3\)"):
        Trainer(load_config(config_path, ["parallel.sequence_parallel_size=2"])).prepare()


@pytest.mark.distributed
def test_two_ranks_sequence_parallel_match_single_process_flat(tmp_path: Path) -> None:
    data = write_cases(tmp_path / "cases.jsonl")
    model = one_kv_head_model(tmp_path / "model.json")
    zero2 = write_accumulating_ds_config(tmp_path / "zero2.json", 2)
    zero3 = write_accumulating_ds_config(tmp_path / "zero3.json", 3)
    config = write_config(
        tmp_path,
        data,
        model={"source": str(model)},
        packing={"budget": BUDGET, "block": BLOCK},
        parallel={"sequence_parallel_size": SIZE},
    )
    out = tmp_path / "report.json"
    torchrun(
        "tests/distributed/sp_grad_check.py", "--config", str(config), "--out", str(out),
        "--deepspeed", str(zero2), str(zero3), "--dfs-chunk", str(DFS_CHUNK), timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert [(run["stage"], run["case"], run["mode"]) for run in report["runs"]] == [
        (stage, case, mode)
        for stage in (2, 3)
        for case, mode in [("forest", "tree"), ("forest", "flat"), ("forest", "dfs"), ("path", "tree"), ("path", "dfs")]
    ]
    for run in report["runs"]:
        assert run["sharded_rows"] >= 1, run
        if run["case"] == "forest" and run["mode"] != "dfs":
            assert run["sharded_rows"] >= 2 and run["own_rows"] >= 1, run  # accumulation over both kinds of row
        # float32 round-off against a float64 reference: measured <= 6e-8 (loss), 9e-7 (gradients), 5e-8 (norm);
        # dfs with its chunks sharded over the 2 ranks (ZeRO-2 and ZeRO-3): 3e-8, 6.6e-7, 2.5e-8.
        assert run["loss_rel_err"] < 1e-6, run
        assert run["max_rel_grad_err"] < 1e-5, run
        assert run["grad_norm_rel_err"] < 1e-5, run
    assert np.isfinite(report["train_step_loss"])
    # the self-check of that step: its sample planned as the step is, over the group (its trees fit a row:
    # packed, each on one rank of the group, as the run packs them), losses and gradients summed over it
    check = report["train_step_selfcheck"]
    assert check["selfcheck/packed_items"] >= 1 and "selfcheck/shard_items" not in check, check
    assert check["selfcheck/tokens"] > 0 and check["selfcheck/max_grad_rel_err"] < 1e-5, check
    assert check["selfcheck/loss_rel_err"] < 1e-5 and check["selfcheck/max_abs_logprob_err"] < 1e-5, check


@pytest.mark.distributed
def test_verify_spawns_a_sequence_parallel_group_and_is_exact_in_float64(tmp_path: Path) -> None:
    """``tools/verify.py --sequence-parallel 2``: Ulysses on 2 spawned ranks vs the single-process flat result."""
    data = write_cases(tmp_path / "cases.jsonl")
    model = one_kv_head_model(tmp_path / "model.json")
    command = [
        sys.executable, str(ROOT / "tools/verify.py"), "--data", str(data), "--model", str(model),
        "--budget", str(BUDGET), "--block", str(BLOCK), "--sequence-parallel", "2",
    ]  # fmt: skip
    result = run_group(command, 300, env=environment())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)  # stdout is the report alone: the ranks' logs and warnings go to stderr
    assert report["passed"] and report["sharded_rows"] >= 2 and report["longest_trajectory"] > BUDGET
    # float64: measured ~2e-15 (gradients) and ~1e-16 (loss).
    assert report["max_rel_grad_err"] < 1e-12 and report["loss_rel_err"] < 1e-12, report
    memory = report["activation_bytes_per_rank"]
    assert 0 < memory["2"] < memory["1"], memory


def test_long_context_example_dry_runs_and_sp_size_reaches_the_config(tmp_path: Path, monkeypatch, capsys) -> None:
    data = write_cases(tmp_path / "cases.jsonl")
    example = str(ROOT / "configs/examples/long_context_sp.yaml")
    groups = "data.groups_per_step=6"  # the cases are 6 groups
    code, out, err = dry_run_in_process(monkeypatch, capsys, 8, example, f"data.path={data}", groups)
    assert code == 0, err
    assert json.loads(out)["world_size"] == 8
    code, _, err = dry_run_in_process(monkeypatch, capsys, 6, example, f"data.path={data}")
    assert code == 2 and "parallel.sequence_parallel_size (4) does not divide the world size (6)" in err
    # launch/train.sh's SP_SIZE is the last override: 3 does not divide 8 ranks either.
    env = {**environment(), "DRY_RUN": "1", "NGPU": "8", "SP_SIZE": "3"}
    command = ["bash", str(ROOT / "launch/train.sh"), example, f"data.path={data}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "parallel.sequence_parallel_size (3) does not divide" in result.stderr


@pytest.mark.distributed
def test_sliding_window_under_sequence_parallelism_is_exact(tmp_path: Path) -> None:
    """A Mistral-style window (40 tokens, paths up to 500 over 2 shards): ``verify --sequence-parallel 2``
    in float64 equals the single-process flat result, whose loss differs from the windowless model's
    (so the window is in force on both sides: the shards carry the rows' tree depths to the kernel)."""
    data = write_cases(tmp_path / "cases.jsonl")
    losses = {}
    for window in (40, None):
        fields = json.loads((ROOT / "configs/models/tiny_llama.json").read_text())
        fields.update(model_type="mistral", sliding_window=window, max_position_embeddings=4096)
        model = tmp_path / f"mistral_{window}.json"
        model.write_text(json.dumps(fields))
        command = [
            sys.executable, str(ROOT / "tools/verify.py"), "--data", str(data), "--model", str(model),
            "--budget", str(BUDGET), "--block", str(BLOCK), "--sequence-parallel", "2",
        ]  # fmt: skip
        result = run_group(command, 300, env=environment())
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        report = json.loads(result.stdout)
        assert report["max_rel_grad_err"] < 1e-12 and report["loss_rel_err"] < 1e-12, report
        losses[window] = report["loss_flat"]
    assert abs(losses[40] - losses[None]) > 1e-6 * abs(losses[None]), losses
