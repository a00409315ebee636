"""Hybrid models under sequence parallelism (docs/MODELS.md, "Hybrid models"): each rank scans the whole row
for its heads of every Gated DeltaNet / Mamba2 layer (:mod:`ds_tree.models.head_parallel`).

- head layouts: which conv channels and heads each rank reads, and head counts that do not split refused
  naming the field;
- ``ds-tree verify --sequence-parallel 2`` in float64 (2 spawned ranks) on Qwen3.5, Bamba and Qwen3-Next,
  rows over the budget sharded, and the dfs walk sharded: loss and every gradient equal the
  single-process flat result;
- 2 ranks, ZeRO-3, S = 2, the self-check on: the trainer's updates equal the single-process flat step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from ds_tree.errors import ConfigError
from ds_tree.models.head_parallel import channels_of, check_recurrent_heads, head_block, shared_block
from ds_tree.models.ulysses import check_heads
from tests.helpers.configs import write_accumulating_ds_config, write_config
from tests.helpers.launch import environment, torchrun
from tests.helpers.processes import run_group
from tests.test_hybrid_models import BAMBA, QWEN3_5, SMALLER, _forest_records
from tests.test_sequence_parallel import write_cases

ROOT = Path(__file__).resolve().parents[1]
QWEN3_NEXT = str(ROOT / "configs/models/tiny_qwen3_next.json")


def small_model(tmp_path: Path, name: str, source: str, **fields) -> str:
    """The configs/models entry cut to one recurrent and one attention layer (``SMALLER``; Qwen3-Next as
    Qwen3.5), with ``fields``."""
    path = tmp_path / f"{name}.json"
    smaller = SMALLER["qwen3_5" if name == "qwen3_next" else name]
    path.write_text(json.dumps({**json.loads(Path(source).read_text()), **smaller, **fields}))
    return str(path)


def test_each_rank_reads_its_heads_and_the_key_heads_or_groups_they_share() -> None:
    # 4 heads over 2 ranks: heads 0-1 and 2-3; 2 groups: one each; 1 group: both ranks read it
    assert [head_block(4, 2, q) for q in range(2)] == [range(0, 2), range(2, 4)]
    assert [shared_block(2, 4, 2, q) for q in range(2)] == [range(0, 1), range(1, 2)]
    assert [shared_block(1, 4, 2, q) for q in range(2)] == [range(0, 1), range(0, 1)]
    # 8 heads in 2 groups over 4 ranks: ranks 0-1 read group 0, ranks 2-3 group 1
    assert [shared_block(2, 8, 4, q) for q in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    # a Mamba2 pre-conv row [x: 4 heads x 2 | B: 2 groups x 1 | C: 2 groups x 1], rank 1 of 2
    assert channels_of([(0, 2, range(2, 4)), (8, 1, range(1, 2)), (10, 1, range(1, 2))]) == [4, 5, 6, 7, 9, 11]


@pytest.mark.parametrize(
    "source, fields, message",
    [
        (QWEN3_5, {"linear_num_value_heads": 3, "linear_num_key_heads": 3}, "linear_num_value_heads=3"),
        (QWEN3_5, {"linear_num_value_heads": 4, "linear_num_key_heads": 3}, "linear_num_key_heads=3"),
        (BAMBA, {"hidden_size": 48, "mamba_n_heads": 3, "mamba_n_groups": 1}, "mamba_n_heads=3"),
        (BAMBA, {"hidden_size": 48, "mamba_n_heads": 12, "mamba_d_head": 8, "mamba_n_groups": 3}, "mamba_n_groups=3"),
        (BAMBA, {"mamba_n_heads": 4, "mamba_n_groups": 1}, None),  # one group: every rank reads it
    ],
)
def test_recurrent_heads_that_do_not_split_over_the_group_are_config_errors(source, fields, message) -> None:
    fields = {**json.loads(Path(source).read_text()), **fields}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    size = 4 if fields.get("mamba_n_heads") == 12 else 2
    if message is None:
        check_heads(config, size, source)
        return
    with pytest.raises(ConfigError, match=f"parallel.sequence_parallel_size={size}: .*{message}"):
        check_recurrent_heads(config, size, source)
    with pytest.raises(ConfigError, match=message):
        check_heads(config, size, source)  # what the dry run and verify call


def verify_hybrid(tmp_path: Path, model: str, *options: str) -> dict:
    """``tools/verify.py --sequence-parallel 2`` on the hybrid forest of tests/test_hybrid_models.py (paths of
    156-281 tokens in trees of depth 4): its JSON report, after asserting that it passed."""
    data = tmp_path / "forest.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in _forest_records(4)))
    command = [sys.executable, str(ROOT / "tools/verify.py"), "--data", str(data), "--model", model]
    command += ["--sequence-parallel", "2", *options]
    result = run_group(command, 300, env=environment())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["passed"], report
    return report


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name, source, objective, fields",
    [
        ("qwen3_5", QWEN3_5, "sft", {"linear_num_key_heads": 1}),  # both ranks read the one key head
        ("bamba", BAMBA, "grpo", {"mamba_n_groups": 1}),  # both ranks read the one group's B and C
        ("qwen3_next", QWEN3_NEXT, "sft", {}),  # a key head per rank
        ("qwen3_next", QWEN3_NEXT, "grpo", {"router_aux_loss_coef": 0.5}),  # and its MoE router loss
    ],
)
def test_verify_sequence_parallel_on_hybrids_equals_flat_in_float64(tmp_path, name, source, objective, fields) -> None:
    """2 spawned ranks, every tree with a path over the budget sharded (rows of up to 2 x 200 tokens); the
    other objective of each model, and the other head layouts, were run by hand (docs/MODELS.md)."""
    options = ["--budget", "200"] + (["--objective", "grpo", "--estimator", "grpo"] if objective == "grpo" else [])
    report = verify_hybrid(tmp_path, small_model(tmp_path, name, source, **fields), *options)
    assert report["sharded_rows"] >= 2 and report["longest_trajectory"] > 200, report
    # float64: measured <= 1e-14 (gradients) and 2e-15 (loss)
    assert report["max_rel_grad_err"] <= 1e-10 and report["loss_rel_err"] <= 1e-10, report
    if fields.get("router_aux_loss_coef"):
        assert report["router_aux_rel_err"] <= 1e-10, report


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name, source, objective", [("bamba", BAMBA, "sft"), ("qwen3_next", QWEN3_NEXT, "grpo")])
def test_verify_sharded_walk_on_hybrids_equals_flat_in_float64(tmp_path, name, source, objective) -> None:
    """The dfs walk sharded over 2 ranks (chunks of 64 tokens): every chunk's recurrent layers exchanged to
    heads, each rank's chain chunks caching its heads' final states and its channels' conv taps. (A chain
    chunk that scans its padding too fails the Bamba case at 0.18 relative.)"""
    options = ["--dfs-chunk", "64", "--limit", "4"]  # the first tree (4 paths of 196-281 tokens)
    options += ["--objective", "grpo", "--estimator", "grpo"] if objective == "grpo" else []
    # Qwen3-Next with its MoE router loss: each chunk's top-k counts summed over the group
    fields = {"router_aux_loss_coef": 0.5} if name == "qwen3_next" else {}
    report = verify_hybrid(tmp_path, small_model(tmp_path, name, source, **fields), *options)
    assert report["sequence_parallel_size"] == 2 and report.get("walked_trees", 1) >= 1, report
    assert report["max_rel_grad_err"] <= 1e-10 and report["loss_rel_err"] <= 1e-10, report
    if fields:
        assert report["router_aux_rel_err"] <= 1e-10, report


@pytest.mark.distributed
def test_two_ranks_zero3_sequence_parallel_hybrid_matches_single_process_flat(tmp_path) -> None:
    """The trainer on 2 ranks, ZeRO-3, S = 2 (the mixers' projections, conv and norms gathered by their
    module hooks, the conv weight and the decay parameters sliced to each rank's heads): rows over the
    budget sharded (tree and flat layouts), every tree walked with its chunks sharded (mode dfs, in
    ZeRO-3's lockstep), every decoder layer checkpointed, then a train step with the self-check on."""
    data = write_cases(tmp_path / "cases.jsonl")
    model = small_model(tmp_path, "qwen3_5", QWEN3_5)
    zero3 = write_accumulating_ds_config(tmp_path / "zero3.json", 3)
    config = write_config(
        tmp_path,
        data,
        model={"source": model, "activation_checkpointing": True},  # the recompute runs the all-to-alls again
        packing={"budget": 256, "block": 16},
        parallel={"sequence_parallel_size": 2},
        objective={"self_check": "first"},
    )
    out = tmp_path / "report.json"
    torchrun(
        "tests/distributed/sp_grad_check.py", "--config", str(config), "--out", str(out),
        "--deepspeed", str(zero3), "--dfs-chunk", "48", timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert [(run["case"], run["mode"]) for run in report["runs"]] == [
        ("forest", "tree"),
        ("forest", "flat"),
        ("forest", "dfs"),
        ("path", "tree"),
        ("path", "dfs"),
    ]
    for run in report["runs"]:
        assert run["stage"] == 3 and run["sharded_rows"] >= 1, run
        # float32 round-off against a float64 reference, measured as verify does (the decay parameters'
        # gradients are ~1e-7 of the total at random init: tests/test_hybrid_models.py)
        assert run["loss_rel_err"] < 1e-6 and run["max_floored_grad_err"] < 1e-5, run
    check = report["train_step_selfcheck"]
    assert check["selfcheck/tokens"] > 0 and check["selfcheck/max_grad_rel_err"] < 1e-5, check
    assert check["selfcheck/loss_rel_err"] < 1e-5, check
