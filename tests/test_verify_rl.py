"""``ds-tree verify --objective grpo|ppo``: the RL objective, tree vs flat, through the command line.

The data is a tokens JSONL with rewards: groups sharing a stem and forking at random depths, so
shared tokens carry advantages of both signs; a budget of 64 tokens splits every tree into parts.
float64, tolerance 1e-10 (the report's own). The trained policy is moved off the old one, so each
case must clip ratios on both sides (else the clipping branches went untested).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ds_tree.cli.verify import main
from ds_tree.data.convert import ConvertOptions, convert
from ds_tree.data.jsonl import slice_groups, write_jsonl
from ds_tree.objectives import rl_rows
from tests.helpers.rollouts import RolloutShape, rl_records
from tests.helpers.shared_data import SHARED_DATA, absent

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "configs/models/tiny_llama.json")
GAME24 = SHARED_DATA / "tot-game24" / "samples.jsonl"


VERIFY_SHAPE = RolloutShape(stem=24, fork=(2, 24), min_tail=4, longest=54, vocab=1000, untrained=6)
"""A 24-token stem per group, a fork at a random depth, the first 6 tokens untrained."""


def records(seed: int = 0, groups: int = 3, per_group: int = 4, rewards: bool = True) -> list[dict]:
    """Tokens records of :data:`VERIFY_SHAPE` (0/1 and real rewards, or none)."""
    return rl_records(seed, groups, per_group, replace(VERIFY_SHAPE, rewards="mixed" if rewards else "none"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return str(write_jsonl(tmp_path_factory.mktemp("verify_rl") / "rl.jsonl", records()))


def run(argv: list[str], capsys) -> tuple[int, dict | None, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else None, captured.err


CASES = {
    "grpo": ["--estimator", "grpo"],
    "rloo": ["--estimator", "rloo", "--eps-high", "0.28", "--dual-clip", "1.3"],
    "treepo": [
        "--estimator",
        "treepo",
        "--normalise-advantages",
        "--aggregation",
        "seq_mean_token_sum",
        "--kl-coef",
        "0.05",
        "--kl-estimator",
        "k2",
        "--entropy-coef",
        "0.01",
    ],
    "tempo": ["--estimator", "tempo", "--normalise-advantages", "--tempo-coef", "0.7", "--kl-coef", "0.05"],
    "sibling": ["--estimator", "sibling", "--normalise-advantages"],
}


@pytest.mark.parametrize("estimator", sorted(CASES))
def test_rl_objective_tree_equals_flat_on_split_trees(data, capsys, estimator):
    code, report, _ = run(
        ["--data", data, "--model", MODEL, "--objective", "grpo", "--budget", "64", *CASES[estimator]], capsys
    )
    assert code == 0, report
    assert report["passed"] and report["objective"] == "grpo" and report["estimator"] == estimator
    assert report["rows_tree"] > 3  # three groups: more rows means the trees were split into parts
    for error in ("loss_rel_err", "max_rel_grad_err", "max_abs_old_logprob_err", "max_rel_metric_err"):
        assert report[error] < 1e-10, (error, report[error])
    metrics = report["metrics_flat"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0, metrics
    # the options reached the objective: dual-clipped tokens only with --dual-clip, a KL term only with --kl-coef
    assert (metrics["clip_dual"] > 0) == ("--dual-clip" in CASES[estimator]), metrics
    assert (metrics["kl_ref"] > 0) == ("--kl-coef" in CASES[estimator]), metrics
    assert report["aggregation"] == ("seq_mean_token_sum" if estimator == "treepo" else "token_mean")


GAE = ["--objective", "ppo", "--estimator", "gae", "--gamma", "0.97", "--lam", "0.9", "--budget", "64"]
CRITIC_ERRORS = (
    "critic_loss_rel_err",
    "critic_max_rel_grad_err",
    "critic_max_abs_value_err",
    "critic_max_rel_metric_err",
)


QWEN3 = str(ROOT / "configs/models/tiny_qwen3.json")
CRITICS = {
    "policy": ["--critic", "policy", "--value-clip", "0.05", "--dfs-chunk", "16"],
    # whitened advantages (the step's per-token mean and std) for the policy, the critic's returns from the raw ones
    "model": ["--critic", QWEN3, "--value-clip", "0.05", "--dfs-chunk", "16", "--normalise-advantages"],
    # a critic of its own beside a LoRA policy: on these values a pair inside the clip range once counted as
    # clipped in one layout and not in the other (round-off), failing the metric comparison
    "model-lora": ["--critic", MODEL, "--lora", "4"],
}


@pytest.mark.parametrize("critic", sorted(CRITICS))
def test_ppo_with_a_learned_critic_tree_equals_flat_packed_and_walked(data, capsys, critic):
    """``--estimator gae``: each layout's GAE from its own old critic's values; the policy's and the trained critic's
    loss, metrics and every gradient against flat, on split trees and walked (``--dfs-chunk``). ``policy``: a value
    head on the policy's trunk (its weight and bias the critic's parameters); ``model``: a critic of its own."""
    code, report, _ = run(["--data", data, "--model", MODEL, *GAE, *CRITICS[critic]], capsys)
    assert code == 0, report
    source = CRITICS[critic][1]
    assert report["passed"] and report["estimator"] == "gae" and report["critic"] == source and report["rows_tree"] > 3
    clip = 0.05 if "--value-clip" in CRITICS[critic] else 0.2
    assert (report["gamma"], report["lam"], report["value_clip"]) == (0.97, 0.9, clip)
    walked = "--dfs-chunk" in CRITICS[critic]
    errors = ("loss_rel_err", "max_rel_grad_err", *CRITIC_ERRORS)
    errors += ("dfs_loss_rel_err", "dfs_max_rel_grad_err", *(f"dfs_{name}" for name in CRITIC_ERRORS)) if walked else ()
    for error in errors:
        assert report[error] < 1e-10, (error, report[error])
    assert (report["critic_parameters"] == 2) == (critic == "policy"), report["critic_parameters"]
    assert report["critic_loss_flat"] > 0 and report["metrics_flat"]["clip_low"] > 0
    value_metrics = report["critic_metrics_flat"]  # the trained critic moved: some values leave their clip range
    assert 0 < value_metrics["value_clipped"] < value_metrics["value_pairs"] == report["metrics_flat"]["tokens"]


def test_a_wrong_tree_value_loss_exits_1(data, capsys, monkeypatch):
    """Mutation of the critic's side alone: its (path, token) pairs drop the paths whose leaf a part does not hold."""
    from ds_tree.objectives import critic

    original = critic.trajectory_copies
    monkeypatch.setattr(critic, "trajectory_copies", lambda row: [c for c in original(row) if c[1][-1] >= 0])
    code, report, _ = run(["--data", data, "--model", MODEL, *GAE, "--critic", "policy"], capsys)
    assert code == 1 and not report["passed"]
    assert report["max_rel_grad_err"] < 1e-10 and report["critic_loss_rel_err"] > 1e-3, report


def test_a_wrong_tree_objective_exits_1(data, capsys, monkeypatch):
    """Mutation: listing only the trajectories whose leaf a part holds drops advantage sums on split trees."""
    original = rl_rows.trajectory_copies
    monkeypatch.setattr(rl_rows, "trajectory_copies", lambda row: [c for c in original(row) if c[1][-1] >= 0])
    code, report, _ = run(["--data", data, "--model", MODEL, "--objective", "grpo", "--budget", "64"], capsys)
    assert code == 1 and not report["passed"]


@pytest.mark.parametrize(("objective", "needs"), [("grpo", "finite reward"), ("ppo", "per-token advantages")])
def test_data_without_what_the_estimator_needs_exits_2(tmp_path, capsys, objective, needs):
    path = write_jsonl(tmp_path / "plain.jsonl", records(rewards=False))
    code, report, err = run(["--data", str(path), "--model", MODEL, "--objective", objective], capsys)
    assert code == 2 and report is None
    assert f"{path}:1" in err and needs in err, err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--eps-low", "0.1"], "--eps-low: only with --objective grpo or ppo"),
        (["--perturbation", "0.3"], "--perturbation: only with --objective grpo or ppo"),
        (["--objective", "grpo", "--policy", "dedup"], "--policy: only with --objective sft"),
        (["--objective", "grpo", "--dual-clip", "0.5"], "dual_clip must be > 1"),
        (["--objective", "ppo", "--normalise-advantages"], "does not apply to the given estimator"),
        (["--objective", "grpo", "--tempo-coef", "0.5"], "applies to estimator tempo only (estimator is grpo)"),
        (["--critic", "policy"], "--critic: only with --objective grpo or ppo"),
        (["--objective", "ppo", "--estimator", "gae"], "estimator gae needs a learned critic"),
        (["--objective", "grpo", "--lam", "0.5"], "objective.lam: only with objective.estimator gae"),
        (["--objective", "ppo", "--estimator", "gae", "--critic", "policy", "--value-clip", "-1"], "value_clip >= 0"),
        (["--cppo"], "--cppo-*: only with --objective grpo or ppo"),
        (["--objective", "grpo", "--cppo-delta", "0.1"], "objective.cppo.delta: only with objective.cppo.enabled"),
        (["--objective", "grpo", "--cppo", "--eps-high", "0.28"], "CPPO's mask replaces the ratio clip"),
        (["--objective", "grpo", "--cppo", "--cppo-w-min", "0"], "objective.cppo.w_min must be in (0, 1]"),
    ],
)
def test_contradictory_options_are_usage_errors(data, capsys, options, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", data, "--model", MODEL, *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_grpo_on_a_converted_tot_game24_slice(tmp_path, tokenizer_dir, capsys):
    """One puzzle's first 24 samples (4 correct): a 5-shot prompt shared by all, 0/1 rewards."""
    if not GAME24.is_file():
        pytest.skip(absent(GAME24))
    sliced = slice_groups(GAME24, tmp_path / "slice.jsonl", groups=1, per_group=24)
    dataset = tmp_path / "dataset"
    convert([sliced], dataset, tokenizer_dir, ConvertOptions(format="chat"))
    argv = ["--data", str(dataset), "--model", str(ROOT / "configs/models/tiny_qwen3.json"), "--objective", "grpo"]
    code, report, _ = run([*argv, "--dtype", "float64", "--budget", "4096"], capsys)
    assert code == 0, report
    assert report["passed"] and report["n_trajectories"] == 24 and report["singleton_trajectories"] == 0
    assert report["ideal_speedup"] > 2.5  # the prompt is shared, not a degenerate slice
    assert report["metrics_flat"]["clip_low"] > 0 and report["metrics_flat"]["clip_high"] > 0


CPPO = ["--objective", "grpo", "--cppo", "--cppo-delta", "4e-4", "--cppo-budget", "1e-4", "--cppo-w-min", "0.3"]
CPPO += ["--budget", "64"]
"""Thresholds at the scale of a random 1000-token model's divergences (its probabilities are ~1e-3), where the mask
keeps some pairs and the budget decides others (measured: 103 of 352 masked)."""


@pytest.mark.parametrize(
    ("divergence", "walk"), [("tv", ["--dfs-chunk", "16"]), ("kl", ["--dfs-chunk", "16", "--dfs-recompute"])]
)
def test_cppo_tree_and_dfs_equal_flat_on_split_trees(data, capsys, divergence, walk):
    """CPPO's mask on split trees and on walked ones (its no-grad walk first, then the update's, with or without
    recompute): some pairs masked, some not, and the loss, gradients and masked count are flat's."""
    scale = ["--cppo-delta", "2e-7", "--cppo-budget", "2e-8"] if divergence == "kl" else []  # KL ~ (pi - mu)^2 / mu
    argv = ["--data", data, "--model", MODEL, *CPPO, "--cppo-divergence", divergence, *scale, *walk]
    code, report, _ = run(argv, capsys)
    assert code == 0, report
    assert report["rows_tree"] > 3  # the trees were split into parts: prefix copies carry the budget's prefix
    for error in ("loss_rel_err", "max_rel_grad_err", "max_rel_metric_err", "dfs_loss_rel_err"):
        assert report[error] < 1e-10, (error, report[error])
    assert report["dfs_max_rel_grad_err"] < 1e-10 and report["dfs_max_rel_metric_err"] < 1e-10, report
    metrics = report["metrics_flat"]
    assert 0 < metrics["cppo_masked"] < metrics["tokens"], metrics
    assert metrics["clip_low"] == metrics["clip_high"] == 0  # the mask replaces the clip
    assert report["metrics_tree"]["cppo_masked"] == metrics["cppo_masked"]


def test_cppo_with_a_part_s_own_length_exits_1(data, capsys, monkeypatch):
    """Mutation: a part holding a path's prefix takes the prefix's trained tokens for the path's length T (the
    position weights then differ from flat's, which sees whole paths): the check fails."""
    original = rl_rows.row_pairs

    def prefix_length(*columns):
        pairs = original(*columns)
        pairs.trained = np.array([tokens.size for tokens in pairs.tokens], dtype=np.int64)
        return pairs

    monkeypatch.setattr(rl_rows, "row_pairs", prefix_length)
    code, report, _ = run(["--data", data, "--model", MODEL, *CPPO], capsys)
    assert code == 1 and not report["passed"]
