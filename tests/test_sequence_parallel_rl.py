"""The RL objective under Ulysses sequence parallelism (S = 2): per-token terms formed on the shards,
``verify --objective grpo --sequence-parallel 2`` against the flat baseline, the config checks."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_tree.config import ConfigError, load_config
from ds_tree.engine.trainer import Trainer
from ds_tree.losses.advantages import estimate
from ds_tree.losses.rl import RLSettings, TokenSums
from ds_tree.objectives.rl_rows import StepNormalisers, row_sums, trajectory_copies
from ds_tree.packing.sequence_parallel import plan_sequence_parallel_rows, shard_row
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.launch import environment, torchrun
from tests.helpers.processes import run_group
from tests.test_sequence_parallel import BLOCK, BUDGET, SIZE, one_kv_head_model, random_trees, write_cases
from tests.test_verify_rl import CRITIC_ERRORS


def write_rl_cases(path: Path) -> Path:
    """:func:`write_cases` (paths up to 500 tokens, over ``BUDGET``) with rewards of both signs in every group."""
    write_cases(path)
    rng = np.random.default_rng(1)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for index, line in enumerate(lines):
        line["reward"] = float(rng.normal()) if index % 2 else float(rng.integers(0, 2))
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("seed", range(3))
def test_shards_hold_the_whole_rows_rl_sums_at_their_own_targets(seed: int) -> None:
    """Every shard forms the per-token sums of the whole row's trajectories at the targets it predicts:
    added over the shards they are the whole row's sums, and a shard's targets are predicted inside it."""
    trajectories, trees = random_trees(seed)
    for index, trajectory in enumerate(trajectories):
        trajectory.reward = float(index % 3) - 1.0
    advantages = estimate(trajectories, "grpo", False).by_trajectory()
    normalisers = StepNormalisers.of(trajectories)
    plan = plan_sequence_parallel_rows(trees, SIZE, SIZE, BUDGET, BLOCK)
    whole_rows = [row for rows in plan.sharded for row in rows if row.n_real]
    assert whole_rows
    for settings in (RLSettings(), RLSettings(aggregation="seq_mean_token_mean")):
        for row in whole_rows:
            whole = row_sums(row, trajectory_copies(row), advantages, settings, normalisers)
            total = None
            for position in range(SIZE):
                shard = shard_row(row, SIZE, position)
                sums = row_sums(shard, trajectory_copies(shard), advantages, settings, normalisers)
                targets = sums.active()
                assert np.all((shard.pred_pos[targets] >= 0) & (shard.pred_pos[targets] < shard.end - shard.start))
                added = {name: getattr(total, name) + values for name, values in vars(sums).items()} if total else None
                total = sums if total is None else TokenSums(**added)
            for name, values in vars(whole).items():
                np.testing.assert_allclose(getattr(total, name), values, rtol=1e-14, atol=0)
            assert whole.tokens.sum() > 0


def verify(data: Path, model: Path, *options: str) -> dict:
    command = [
        sys.executable, str(ROOT / "tools/verify.py"), "--data", str(data), "--model", str(model),
        "--budget", str(BUDGET), "--block", str(BLOCK), "--sequence-parallel", "2", *options,
    ]  # fmt: skip
    result = run_group(command, 300, env=environment())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout)  # stdout is the report alone: the ranks' logs and warnings go to stderr


# float64 (the estimator, KL, entropy and dual clip all on): measured ~2e-15 (gradients), ~4e-16 (loss),
# ~2e-15 (old log-probs). float32 (docs/RL.md): ~7e-7 (gradients), ~4e-7 (loss), ~1e-6 (old log-probs).
TREEPO = ["--estimator", "treepo", "--normalise-advantages", "--aggregation", "seq_mean_token_sum",
          "--kl-coef", "0.05", "--kl-estimator", "k2", "--entropy-coef", "0.01", "--dual-clip", "1.3"]  # fmt: skip


@pytest.mark.distributed
def test_verify_rl_under_sequence_parallelism_equals_flat_in_float64(tmp_path: Path) -> None:
    """One run (2 spawned ranks, ~20 s); grpo and float32 runs are in docs/RL.md."""
    data = write_rl_cases(tmp_path / "rl.jsonl")
    model = one_kv_head_model(tmp_path / "model.json")
    report = verify(data, model, "--objective", "grpo", *TREEPO)
    tolerance = 1e-10
    assert report["passed"] and report["objective"] == "grpo" and report["estimator"] == "treepo"
    assert report["tolerance"] == tolerance and report["dtype"] == "float64"
    assert report["longest_trajectory"] > BUDGET and report["sharded_rows"] >= 2, report
    for error in ("loss_rel_err", "max_rel_grad_err", "max_abs_old_logprob_err", "max_rel_metric_err"):
        assert report[error] <= tolerance, (error, report[error])
    # every trained token's old log-prob was scored on exactly one shard (or row) and compared
    assert report["old_logprobs_scored"] == report["trained_tokens"] > 0
    metrics = report["metrics_flat"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0, metrics
    assert metrics["kl_ref"] > 0 and metrics["clip_dual"] > 0 and metrics["entropy"] > 0, metrics


@pytest.mark.distributed
@pytest.mark.parametrize("walked", [False, True], ids=["sharded-rows", "sharded-walks"])
def test_verify_cppo_under_sequence_parallelism_equals_flat(tmp_path: Path, walked: bool) -> None:
    """CPPO at S = 2 (2 spawned ranks): a shard scores only the targets predicted inside it, so a path's prefix
    drift crosses the shard boundary; the group sums the row's divergences before each shard's mask (a walk sharded
    over the group: after one more no-grad walk). Thresholds at the scale of the random model's divergences, so
    that the mask keeps some pairs and masks others."""
    data = write_rl_cases(tmp_path / "rl.jsonl")
    model = one_kv_head_model(tmp_path / "model.json")
    cppo = ["--cppo", "--cppo-delta", "4e-4", "--cppo-budget", "1e-4", "--cppo-w-min", "0.3"]
    report = verify(data, model, "--objective", "grpo", *cppo, *(["--dfs-chunk", str(BUDGET)] if walked else []))
    assert report["passed"], report
    assert report["walked_trees"] >= 2 if walked else report["sharded_rows"] >= 2, report
    for error in ("loss_rel_err", "max_rel_grad_err", "max_rel_metric_err"):
        assert report[error] <= 1e-10, (error, report[error])
    metrics = report["metrics_flat"]
    assert 0 < metrics["cppo_masked"] < metrics["tokens"], metrics


GAE = ["--objective", "ppo", "--estimator", "gae", "--gamma", "0.97", "--lam", "0.9", "--value-clip", "0.05"]


@pytest.mark.distributed
@pytest.mark.parametrize("critic", ["policy", "model"])
def test_verify_ppo_with_a_learned_critic_under_sequence_parallelism_equals_flat(tmp_path: Path, critic: str) -> None:
    """``--estimator gae`` at S = 2 (2 spawned ranks each): the old critic's values scored on the shards and merged
    over the group for GAE, the trained critic's value loss, metrics and gradients summed over the group, against
    one process's flat run. ``policy``: a head on the sequence-parallel trunk of a LoRA policy (``--lora 4``, the
    adapters' gradients compared; a plain trunk's head in one process: tests/test_verify_rl.py), sharded rows;
    ``model``: a critic of its own under Ulysses, every tree walked by the group (``--dfs-chunk``)."""
    data = write_rl_cases(tmp_path / "rl.jsonl")
    model = one_kv_head_model(tmp_path / "model.json")
    source = "policy" if critic == "policy" else str(model)
    # a critic of its own: the policy's advantages whitened over the step (the critic's returns from the raw ones)
    options = ["--lora", "4"] if critic == "policy" else ["--dfs-chunk", str(BUDGET), "--normalise-advantages"]
    report = verify(data, model, *GAE, "--critic", source, *options)
    assert report["passed"] and report["estimator"] == "gae" and report["critic"] == source
    if critic == "policy":  # the adapters' gradients (the frozen base has none)
        assert report["lora_rank"] == 4 and ".lora_" in report["worst_parameter"], report["worst_parameter"]
    assert report["longest_trajectory"] > BUDGET, report
    assert report["sharded_rows"] >= 2 if critic == "policy" else report["walked_trees"] >= 2, report
    for error in ("loss_rel_err", "max_rel_grad_err", "max_abs_old_logprob_err", *CRITIC_ERRORS):
        assert report[error] <= 1e-10, (error, report[error])
    assert report["critic_loss_sequence_parallel"] > 0 and report["critic_parameters"] > 0
    value_metrics = report["critic_metrics_flat"]
    assert 0 < value_metrics["value_clipped"] < value_metrics["value_pairs"], value_metrics


def test_rl_under_sequence_parallelism_passes_the_dry_run_with_dfs_too(tmp_path: Path, monkeypatch) -> None:
    data = write_rl_cases(tmp_path / "rl.jsonl")
    config_path = write_config(
        tmp_path, data, packing={"budget": BUDGET}, parallel={"sequence_parallel_size": 2}, objective={"kind": "grpo"}
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    Trainer(load_config(config_path)).prepare()
    Trainer(load_config(config_path, ["objective.kl_coef=0.1", "objective.estimator=treepo"])).prepare()
    Trainer(load_config(config_path, ["packing.over_budget=dfs"])).prepare()  # long trees walked by the group
    cppo = ["objective.cppo.enabled=true"]
    Trainer(load_config(config_path, cppo)).prepare()  # CPPO's mask on sharded rows: the group sums the prefix
    Trainer(load_config(config_path, [*cppo, "packing.over_budget=dfs"])).prepare()  # and walked by the group
    # every tree walked by the group, its chunks sharded (ds-tree verify --dfs-chunk C --sequence-parallel 2)
    Trainer(load_config(config_path, ["packing.mode=dfs", "objective.kl_coef=0.1"])).prepare()
    with pytest.raises(
        ConfigError,
        match=r"reference_offload .* needs objective.kl_coef > 0 \(or objective.kind dpo\) and model.zero_init",
    ):
        load_config(config_path, ["objective.kl_coef=0.1", "objective.reference_offload=true"])
    # a partitioned reference walks in lockstep like the policy (tests/distributed/dfs_rl_check.py)
    partitioned = ["objective.kl_coef=0.1", "model.zero_init=true"]
    walked = [*partitioned, "parallel.sequence_parallel_size=1", "packing.over_budget=dfs"]
    Trainer(load_config(config_path, walked)).prepare()
    Trainer(load_config(config_path, [*partitioned, "packing.mode=dfs"])).prepare()


@pytest.mark.distributed
@pytest.mark.slow
def test_long_tree_rl_example_trains_four_ranks_dp2_sp2_zero3_with_a_partitioned_reference(tmp_path: Path) -> None:
    """configs/examples/long_tree_rl.yaml at tiny scale on 4 CPU ranks (2 data-parallel x 2 sequence-parallel;
    ~60 s on 2 cores): ZeRO-3 built partitioned, the KL reference a ZeRO-3 engine, paths over the budget
    sharded. The first mini-batch's gradient (2 accumulated rows per rank at least) and its metrics, KL
    included, equal the single-process flat ones from the same weights with a whole reference; then the
    update, the same in ``packing.mode: dfs`` (every tree walked by its group, its chunks sharded: old
    policy, reference and loss walks; the two groups walk different trees, so their forwards follow one
    ZeRO-3 lockstep schedule, with dummy calls), and an ordinary step of it (2 mini-batches, its self-check)."""
    data = write_rl_cases(tmp_path / "rl.jsonl")
    model = one_kv_head_model(tmp_path / "model.json")
    out = tmp_path / "report.json"
    overrides = [
        f"model.source={model}", "model.dtype=float32", "model.attention=torch", "model.head_chunk=64",
        f"data.path={data}", "data.groups_per_step=6", f"output_dir={tmp_path / 'run'}",
        f"packing.budget={BUDGET}", f"packing.block={BLOCK}", "objective.kl_coef=0.05",
        "logging.progress_bar=false", "logging.report_to=[]", "checkpoint.export_hf=false",
        "objective.self_check=every:1",
    ]  # fmt: skip
    example = ROOT / "configs/examples/long_tree_rl.yaml"
    torchrun("tests/distributed/rl_grad_check.py", "--config", str(example), "--out", str(out), "--train-step",
             "--dfs-chunk", str(BUDGET), *overrides, ranks=4)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["zero_stage"] == 3 and report["world_size"] == 4 and report["reference"] == "DeepSpeedEngine"
    assert report["min_micro_batches_per_rank"] >= 2 and report["mini_batches"] == 2
    assert report["min_sharded_rows_per_rank"] >= 1  # the first mini-batch has a path over the budget
    assert report["reference_max_abs_diff"] == 0.0  # the partitioned reference is the initial policy
    metrics = report["metrics"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0 and metrics["kl_ref"] > 0, metrics
    # float32 round-off (the SFT sequence-parallel check measures ~9e-7).
    assert report["max_rel_grad_err"] < 1e-5 and report["max_rel_metric_err"] < 1e-5, report
    walked = report["dfs"]  # after an update: the reference is no longer the policy
    assert walked["mode"] == "dfs" and walked["min_sharded_rows_per_rank"] >= 1, walked
    forwards = walked["forwards_per_rank"]  # a group's ranks walk alike; the groups differ (measured 2 and 5)
    assert forwards[0] == forwards[1] and forwards[2] == forwards[3] and forwards[0] != forwards[2], forwards
    assert walked["reference_max_abs_diff"] > 0 and walked["metrics"]["kl_ref"] > 0, walked
    assert walked["max_rel_grad_err"] < 1e-5 and walked["max_rel_metric_err"] < 1e-5, walked
    step = report["train_step"]
    assert np.isfinite(step["loss/train"]) and step["rl/kl_ref"] > 0, step
    # its RL self-check: the sample walked by the group as the step is (walked shards, by their runner),
    # the partitioned reference, gradients summed over the group
    assert step["selfcheck/tokens"] > 0 and step["selfcheck/walked_shard_items"] >= 1, step
    assert not any(key in step for key in ("selfcheck/packed_items", "selfcheck/shard_items")), step
    assert step["selfcheck/max_grad_rel_err"] < 1e-5, step
    assert step["selfcheck/loss_rel_err"] < 1e-5 and step["selfcheck/max_abs_logprob_err"] < 1e-5, step
    # a fault only the sharded walk has (the depths of a chunk's second shard off by one) stops the check
    fault = report["selfcheck_fault"]
    assert fault["items"]["walked_shard"] >= 1 and fault["max_grad_rel_err"] > 1e-3, fault
    assert re.search(r"gradient relative error .* \(parameter model", fault["message"]), fault
    # objective.reference_step: the policy copied into the partitioned reference, its whole state saved
    # and loaded back (after a perturbation) exactly
    assert report["reference_copy"]["copied"] == 0 and report["reference_copy"]["reloaded"] == 0, report
    assert report["reference_copy"]["perturbed"] > 0.5, report


def test_plan_counts_the_reference_whole_partitioned_or_offloaded() -> None:
    """``ds-tree plan`` of the long-tree example on 8 ranks: an 8B reference in bf16 is 1/8 of its bytes
    per rank when partitioned, none on the accelerator when offloaded, all of them when whole."""
    from ds_tree.cli.plan import make_plan

    example = str(ROOT / "configs/examples/long_tree_rl.yaml")
    plans = {
        name: make_plan(example, overrides, 8, 80.0)
        for name, overrides in {
            "partitioned": [],
            "offloaded": ["objective.reference_offload=true"],
            "whole": ["model.zero_init=false"],
            "none": ["objective.kl_coef=0"],
        }.items()
    }
    whole = plans["none"]["parameters"] * 2
    assert [plans[name]["states"]["reference"] for name in plans] == [whole // 8, 0, whole, 0]
    assert plans["offloaded"]["states"]["cpu"] == plans["none"]["states"]["cpu"] + whole // 8
    for name in ("partitioned", "whole"):
        added = plans[name]["peak_bytes"] - plans["none"]["peak_bytes"]
        assert added == plans[name]["states"]["reference"], name


@pytest.mark.distributed
def test_moe_router_loss_under_sequence_parallelism_equals_flat_in_float64(tmp_path: Path) -> None:
    """SFT of a tiny Qwen3-MoE with its router load-balancing loss (per trajectory), paths over the budget
    sharded over 2 ranks: each shard's top-k counts are summed over the group before the loss, so the
    loss, the router loss and every gradient equal the single-process flat ones."""
    data = write_cases(tmp_path / "cases.jsonl")
    command = [
        sys.executable, str(ROOT / "tools/verify.py"), "--data", str(data),
        "--model", str(ROOT / "configs/models/tiny_qwen3_moe.json"), "--budget", str(BUDGET), "--block", str(BLOCK),
        "--sequence-parallel", "2", "--router-aux-loss-coef", "0.5", "--limit", "10",
    ]  # fmt: skip
    result = run_group(command, 300, env=environment())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["sharded_rows"] >= 2 and report["router_aux_loss_coef"] == 0.5, report
    assert report["router_aux_flat"] > 1.0  # E * sum_e f_e P_e: K = 2 when balanced
    # float64: measured ~1e-15 (loss, router loss, gradients)
    for error in ("loss_rel_err", "router_aux_rel_err", "max_rel_grad_err"):
        assert report[error] < 1e-10, (error, report)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "options",
    [["--objective", "grpo"], ["--objective", "grpo", "--dfs-chunk", "24"]],
    ids=["grpo", "grpo-dfs"],
)
def test_moe_router_loss_with_rl_and_sharded_walks_equals_flat_in_float64(tmp_path: Path, options: list[str]) -> None:
    """The router load-balancing loss under sequence parallelism with GRPO (sharded rows, and trees walked by
    the group with each rank forwarding one shard of every chunk): the shards' (chunk shards') top-k counts
    are summed over the group, so loss, router loss, every gradient, the old log-probs and the metrics equal
    the single-process flat ones (SFT in sharded walks: tests/test_walked_over_budget.py)."""
    data = write_rl_cases(tmp_path / "rl.jsonl")
    command = [
        sys.executable, str(ROOT / "tools/verify.py"), "--data", str(data),
        "--model", str(ROOT / "configs/models/tiny_qwen3_moe.json"), "--budget", str(BUDGET), "--block", str(BLOCK),
        "--sequence-parallel", "2", "--router-aux-loss-coef", "0.5", "--limit", "6", *options,
    ]  # fmt: skip
    result = run_group(command, 300, env=environment())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["passed"] and report["router_aux_loss_coef"] == 0.5, report
    assert report.get("sharded_rows", 0) >= 2 or report.get("walked_trees", 0) >= 2, report
    assert report["router_aux_flat"] > 1.0  # E * sum_e f_e P_e: K = 2 when balanced
    # float64: measured ~2e-16 (loss, router loss), ~1.5e-15 (gradients)
    for error in ("loss_rel_err", "router_aux_rel_err", "max_rel_grad_err"):
        assert report[error] < 1e-10, (error, report)


@pytest.mark.distributed
def test_bench_rl_under_sequence_parallelism_times_tree_against_flat(tmp_path: Path) -> None:
    """``bench --objective grpo --sequence-parallel 2``: both modes sharded as the trainer shards them, one
    measured step each from the same weights (their first losses agree to float32 round-off)."""
    data = write_rl_cases(tmp_path / "rl.jsonl")
    model = one_kv_head_model(tmp_path / "model.json")
    command = [
        sys.executable, str(ROOT / "tools/bench.py"), "--data", str(data), "--model", str(model), "--budget",
        str(BUDGET), "--limit", "8", "--sequence-parallel", "2", "--objective", "grpo", "--steps", "1", "--warmup", "0",
        "--json", str(tmp_path / "bench.json"),
    ]  # fmt: skip
    result = run_group(command, 300, env=environment())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["objective"] == "grpo" and report["sequence_parallel_size"] == 2
    assert report["longest_trajectory"] > BUDGET and report["flat_tokens"] > report["tree_tokens"], report
    flat, tree = report["modes"]["flat"], report["modes"]["tree"]
    assert flat["sharded_rows"] >= 1 and tree["sharded_rows"] >= 1, report
    assert flat["packed_tokens"] > tree["packed_tokens"] and tree["activation_bytes_per_rank"] > 0, report
    assert report["loss_rel_err"] < 1e-5, report
    for name in ("speedup", "old_forward_speedup", "updates_speedup", "activation_ratio_tree_over_flat"):
        assert report[name] > 0, (name, report)
