"""Vision-language models under sequence parallelism (docs/MODELS.md, "Vision-language models"): each rank
of a group encodes the images with placeholders in its shard of a row, gathers its placeholders' features and
backpropagates them into the tower; the tower's gradient summed over the group is the row's.

- ``ds-tree verify --sequence-parallel 2``'s path (2 spawned ranks) in float64 on Qwen2.5-VL and Qwen3-VL,
  SFT and GRPO, rows over the budget sharded with images cut by the shard boundary: loss, log-probs and
  every gradient (the tower's included) equal the single-process flat result;
- the sharded dfs walk stays refused, naming the fields;
- 2 ranks, ZeRO-3, S = 2: the trainer's updates equal the single-process flat step, the self-check on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ds_tree.errors import ConfigError
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.vision import attach_rope_positions, check_vision_settings
from ds_tree.packing.sequence_parallel import plan_sequence_parallel_rows, shard_row
from ds_tree.trees.trie import build_forest
from ds_tree.verify.sequence_parallel import sequence_parallel_report
from ds_tree.verify.sequence_parallel_rl import sequence_parallel_rl_report
from tests.test_vision import CONFIGS, agent_trees

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 12
"""agent_trees' paths are 6-20 tokens: the longer trees go to rows of up to 2 x 12 tokens, sharded."""


def shard_images(row, position: int) -> set[int]:
    """The images (by their pixel arrays' identity) that shard ``position`` of ``row`` encodes."""
    images = shard_row(row, 2, position).tensors().get("row_images")
    return {id(pixels) for pixels in images.pixel_values} if images is not None else set()


def test_shards_encode_the_images_of_their_placeholders_and_an_image_cut_by_the_boundary_on_both(tmp_path):
    trajectories = agent_trees("qwen2_5_vl")
    attach_rope_positions(load_model_config(CONFIGS["qwen2_5_vl"]), trajectories)
    plan = plan_sequence_parallel_rows(build_forest(trajectories), 2, 2, BUDGET)
    rows = [row for row in plan.sharded[0] if np.any(row.image_id >= 0)]
    assert len(rows) >= 2
    for row in rows:
        whole = row.tensors()
        shards = [shard_row(row, 2, position).tensors() for position in range(2)]
        for name in ("input_ids", "position_ids"):  # [1, n] and [4, 1, n]: cut along the tokens
            assert np.array_equal(np.concatenate([s[name] for s in shards], axis=-1), whole[name])
        # every placeholder's feature row once over the shards, in row order
        images = [s["row_images"] for s in shards]  # None: no placeholder in the shard (the blank patch)
        indices = [i.feature_index if i else np.zeros(0, int) for i in images]
        sizes = [[int(np.prod(grid)) // 4 for grid in i.grids] if i else [] for i in images]  # merge 2 x 2
        assert sum(map(len, indices)) == len(whole["row_images"].feature_index)
        assert all(index.max(initial=-1) < sum(size) for index, size in zip(indices, sizes, strict=True))
    cut = [shard_images(row, 0) & shard_images(row, 1) for row in rows]
    assert any(cut), "no image cut by a shard boundary: the test would not see the tower's gradient split"


@pytest.mark.distributed
@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_verify_sequence_parallel_with_images_equals_flat_in_float64(family, objective) -> None:
    """2 spawned ranks (``ds-tree verify --sequence-parallel 2``'s report); every gradient is compared,
    the tower's and Qwen3-VL's deepstack merger's included (float64: measured <= 1.1e-15)."""
    trajectories = agent_trees(family)
    if objective == "sft":
        report = sequence_parallel_report(trajectories, CONFIGS[family], size=2, budget=BUDGET)
    else:
        report = sequence_parallel_rl_report(trajectories, CONFIGS[family], size=2, budget=BUDGET)
        assert report["max_abs_old_logprob_err"] <= 1e-10 and report["max_rel_metric_err"] <= 1e-10, report
    assert report["passed"] and report["sharded_rows"] >= 2, report
    assert report["max_rel_grad_err"] <= 1e-10 and report["loss_rel_err"] <= 1e-10, report


@pytest.mark.parametrize(
    "override", ["packing.mode=dfs", "packing.over_budget=dfs"], ids=["mode_dfs", "over_budget_dfs"]
)
def test_the_sharded_walk_with_images_is_refused_naming_its_fields(tmp_path, override) -> None:
    from ds_tree.config import load_config
    from tests.helpers.configs import write_config

    path = write_config(tmp_path, tmp_path / "data", model={"source": str(ROOT / CONFIGS["qwen2_5_vl"])})
    config = load_config(path, ["parallel.sequence_parallel_size=2"])
    check_vision_settings(config, load_model_config(config.model.source))  # sharded rows: accepted
    config = load_config(path, ["parallel.sequence_parallel_size=2", override])
    with pytest.raises(ConfigError, match=re.escape("parallel.sequence_parallel_size with packing.mode / over_budget")):
        check_vision_settings(config, load_model_config(config.model.source))


@pytest.mark.distributed
def test_two_ranks_zero3_sequence_parallel_with_images_matches_single_process_flat(tmp_path) -> None:
    """The trainer on 2 ranks, ZeRO-3, S = 2: the GUI-like trees (screenshots shared by trials) over the budget
    in sharded rows, a text-only task in rows each rank holds alone (its tower call on the blank patch), tree
    and flat layouts; then a train step with the self-check on."""
    from ds_tree.cli.make_tokenizer import main as make_tokenizer_main
    from ds_tree.data.convert import ConvertOptions, convert
    from tests.helpers.configs import write_accumulating_ds_config, write_config
    from tests.helpers.launch import torchrun
    from tests.test_vision import gui_records, write_jsonl

    processor = tmp_path / "processor"
    assert make_tokenizer_main(["--output", str(processor), "--vision", "qwen2_5_vl"]) == 0
    text_only = [
        {"group_id": "text/0", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": a}]}
        for a in ("Hello.", "Hey")
    ]
    records = [{**record, "group_id": f"gui/{record['group_id']}"} for record in gui_records(tmp_path)]
    write_jsonl(tmp_path / "gui.jsonl", records + text_only)
    convert([tmp_path / "gui.jsonl"], tmp_path / "dataset", processor, ConvertOptions(format="chat"))
    config = write_config(
        tmp_path,
        tmp_path / "dataset",
        model={"source": str(ROOT / CONFIGS["qwen2_5_vl"]), "seed": 3},
        packing={"budget": 48, "block": 8},
        parallel={"sequence_parallel_size": 2},
        objective={"self_check": "first"},
    )
    config.write_text(config.read_text().replace("groups_per_step: 4", "groups_per_step: 3"))  # the 3 tasks
    zero3 = write_accumulating_ds_config(tmp_path / "zero3.json", 3)
    out = tmp_path / "report.json"
    torchrun(
        "tests/distributed/sp_grad_check.py", "--config", str(config), "--out", str(out),
        "--deepspeed", str(zero3), "--modes", "tree", "flat", timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert [(run["case"], run["mode"]) for run in report["runs"]] == [
        ("gui", "tree"),
        ("gui", "flat"),
        ("text", "tree"),
        ("text", "flat"),
    ]
    for run in report["runs"]:
        assert run["stage"] == 3, run
        # float32 round-off against a float64 reference (as tests/test_vision.py's ZeRO-3 test)
        assert run["loss_rel_err"] < 1e-6 and run["max_rel_grad_err"] < 1e-5, run
    assert all(run["sharded_rows"] >= 1 for run in report["runs"] if run["case"] == "gui"), report
    check = report["train_step_selfcheck"]
    assert check["selfcheck/tokens"] > 0 and check["selfcheck/max_grad_rel_err"] < 1e-5, check


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_verify_refuses_the_sharded_walk_with_images(objective) -> None:
    from ds_tree.engine.dfs import DfsSettings
    from ds_tree.verify.dfs_sequence_parallel import dfs_sequence_parallel_report

    trajectories, dfs = agent_trees("qwen2_5_vl"), DfsSettings(8, False)
    with pytest.raises(ValueError, match="--dfs-chunk with --sequence-parallel: the trajectories have images"):
        if objective == "sft":
            dfs_sequence_parallel_report(trajectories, CONFIGS["qwen2_5_vl"], dfs, size=2)
        else:
            sequence_parallel_rl_report(trajectories, CONFIGS["qwen2_5_vl"], size=2, dfs=dfs)
