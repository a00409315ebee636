"""ds-tree bench and bench-attention on a small synthetic set: the report's contract.

Timings are not asserted (they are machine-dependent); the token counts the ratios are built on
are, against packing done here (and, for RL steps, the LM-head targets against a count of the
trained tokens: every trajectory's in flat mode, each distinct trained prefix once in the tree).
"""

import json

import pytest
import torch

from ds_tree.bench.steps import fit_token_pair_cost
from ds_tree.cli.bench import main as bench_main
from ds_tree.cli.bench_attention import main as attention_main
from ds_tree.data.jsonl import write_jsonl
from ds_tree.data.synthetic import SyntheticConfig, generate
from ds_tree.packing.modes import pack_trajectories


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    trajectories = list(generate(SyntheticConfig(groups=2, por=0.7, max_tokens=128, vocab_size=1024)))
    lines = [
        {
            "group_id": t.group_id,
            "input_ids": t.input_ids.tolist(),
            "loss_mask": t.loss_mask.astype(int).tolist(),
            "reward": t.reward,
        }
        for t in trajectories
    ]
    return write_jsonl(tmp_path_factory.mktemp("bench") / "tokens.jsonl", lines), trajectories


def packed_tokens(trajectories, mode, budget):
    return sum(row.n_tokens for row in pack_trajectories(trajectories, mode, budget, 1))


def trained_targets(trajectories, mode) -> int:
    """Tokens an RL pass scores: trained tokens of every trajectory (flat), or of every distinct prefix (tree)."""
    if mode == "flat":
        return sum(int((t.loss_mask[1:] != 0).sum()) for t in trajectories)
    return len({(t.group_id, *t.input_ids[: k + 1]) for t in trajectories for k in range(1, len(t)) if t.loss_mask[k]})


@pytest.mark.parametrize(
    "objective",
    [[], ["--activation-checkpointing"], ["--objective", "grpo", "--ppo-epochs", "2"]],
    ids=["sft", "sft-checkpointing", "grpo"],
)
def test_bench_report(synthetic, tmp_path, objective):
    path, trajectories = synthetic
    out = tmp_path / "bench.json"
    argv = ["--data", str(path), "--model", "configs/models/tiny_llama.json", "--steps", "1", "--warmup", "0"]
    assert bench_main([*argv, *objective, "--budget", "512", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    flat, tree = packed_tokens(trajectories, "flat", 512), packed_tokens(trajectories, "tree", 512)
    assert report["ideal_speedup"] == pytest.approx(flat / tree)
    modes = report["modes"]
    assert (modes["flat"]["packed_tokens_per_step"], modes["tree"]["packed_tokens_per_step"]) == (flat, tree)
    assert report["speedup"] == pytest.approx(modes["flat"]["step_time_s"] / modes["tree"]["step_time_s"])
    assert report["efficiency"] == pytest.approx(report["speedup"] / report["ideal_speedup"])
    assert report["device"] == "cpu"
    for mode in ("flat", "tree"):
        assert report["modes"][mode]["step_time_s"] > 0
        assert report["modes"][mode]["peak_memory_bytes"] > 0
        assert report["modes"][mode]["page_faults_per_step"] >= 0
    if "--objective" not in objective:
        assert "objective" not in report and "old_forward_time_s" not in modes["tree"]
        assert "patch_weight" not in report and "tower_calls_per_step" not in modes["tree"]  # text only
        a, b = report["cost_per_token_s"], report["cost_per_pair_s"]
        assert a >= 0 and b >= 0 and a + b > 0
        cost = {m: a * modes[m]["packed_tokens_per_step"] + b * modes[m]["visible_pairs_per_step"] for m in modes}
        assert report["ideal_cost"] == pytest.approx(cost["flat"] / cost["tree"])
        assert report["efficiency_cost"] == pytest.approx(report["speedup"] / report["ideal_cost"])
        checkpointing = bool(objective)
        assert report["checkpoint_every"] == (1 if checkpointing else 0)
        peaks = [modes[m]["activation_peak_bytes"] for m in ("flat", "tree")]
        if not checkpointing:
            assert peaks == [None, None] and "activation_peak_ratio_tree_over_flat" not in report
            return
        assert all(peak > 0 for peak in peaks)
        assert report["activation_peak_ratio_tree_over_flat"] == pytest.approx(peaks[1] / peaks[0])
        return
    assert (report["objective"], report["estimator"], report["ppo_epochs"]) == ("grpo", "grpo", 2)
    for mode in ("flat", "tree"):
        assert modes[mode]["targets_per_step"] == trained_targets(trajectories, mode)
        timed = modes[mode]["old_forward_time_s"] + modes[mode]["updates_time_s"] + modes[mode]["pack_time_s"]
        assert timed == pytest.approx(modes[mode]["step_time_s"])  # one step: medians are its times
        assert 0 < modes[mode]["old_forward_share"] < 1
    assert report["target_ratio"] == pytest.approx(
        trained_targets(trajectories, "flat") / trained_targets(trajectories, "tree")
    )


def test_cost_fit_recovers_its_coefficients():
    shapes = [(4096, 10**6), (1000, 4 * 10**6), (300, 9000)]
    rows = [(tokens, pairs, 2e-6 * tokens + 3e-9 * pairs) for tokens, pairs in shapes]
    assert fit_token_pair_cost(rows) == pytest.approx((2e-6, 3e-9))
    # pairs that predict negative cost: the best fit with non-negative coefficients is tokens alone
    rows = [(100, 10, 1.0), (200, 1000, 2.0), (400, 10, 4.0), (50, 5000, 0.4)]
    a, b = fit_token_pair_cost(rows)
    assert b == 0 and a == pytest.approx(0.01, rel=0.1)


def test_bench_on_a_gpu_times_flat_and_tree_only(synthetic, capsys, monkeypatch):
    argv = ["--data", str(synthetic[0]), "--model", "configs/models/tiny_llama.json", "--device", "cuda"]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as raised:
            bench_main(argv)
        assert raised.value.code == 2 and "sees no CUDA GPU" in capsys.readouterr().err
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the refusals below come before any GPU work
    assert bench_main([*argv, "--modes", "flat,tree,dfs"]) == 2
    assert "--device cuda times modes flat and tree only" in capsys.readouterr().err
    assert bench_main([*argv, "--modes", "flat,tree", "--peak-memory"]) == 2
    with pytest.raises(SystemExit) as raised:
        bench_main([*argv[:4], "--flat-attention", "varlen"])
    assert raised.value.code == 2 and "--flat-attention varlen needs a CUDA GPU" in capsys.readouterr().err


def test_bench_rl_needs_rewards(tmp_path, capsys):
    path = write_jsonl(tmp_path / "plain.jsonl", [{"group_id": "g", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    assert bench_main(["--data", str(path), "--model", "configs/models/tiny_llama.json", "--objective", "grpo"]) == 2
    assert f"{path}:1" in capsys.readouterr().err


@pytest.mark.parametrize("hub_min_keys", [1, 10**9])  # hubs everywhere a chain has descendants; none
def test_bench_attention_report(synthetic, tmp_path, hub_min_keys):
    path, trajectories = synthetic
    out = tmp_path / "attention.json"
    argv = ["--data", str(path), "--budget", "512", "--repeats", "2", "--heads", "2", "--head-dim", "8"]
    argv += ["--hub-min-keys", str(hub_min_keys), "--hub-min-queries", "1", "--json", str(out)]
    assert attention_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["hub_min_keys"] == hub_min_keys
    for mode in ("flat", "tree"):
        assert report["modes"][mode]["tokens"] == packed_tokens(trajectories, mode, 512)
        assert report["modes"][mode]["min_ms"] > 0
        assert 0 < report["modes"][mode]["visible_pairs"] <= report["modes"][mode]["computed_scores"]


def test_bench_attention_needs_two_repeats(synthetic):
    with pytest.raises(SystemExit):
        attention_main(["--data", str(synthetic[0]), "--repeats", "1"])


def test_bench_kernel_lays_out_one_forest_twice(tmp_path):
    """On a CPU a smoke run under the Triton interpreter; the token counts are the forest's either way."""
    import random

    from ds_tree.cli.bench_kernel import main as kernel_main
    from ds_tree.trees.random_trees import TreeShape, random_forest
    from ds_tree.trees.stats import token_counts

    out = tmp_path / "kernel.json"
    argv = ["--trees", "2", "--depth", "2", "--branching", "2", "--node-len", "4", "--heads", "2", "--kv-heads", "1"]
    assert kernel_main([*argv, "--head-dim", "16", "--dtype", "float32", "--seed", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    shape = TreeShape(trees=2, depth=2, children=(1, 2), node_tokens=(1, 7))
    counts = token_counts(random_forest(random.Random(3), shape))
    assert (report["tree"]["tokens"], report["flat"]["tokens"]) == (counts.tree_tokens, counts.flat_tokens)
    assert report["tree"]["block_stats"]["useful_elements"] < report["flat"]["block_stats"]["useful_elements"]
    assert report["flat_over_tree_time"] == pytest.approx(report["flat"]["ms"] / report["tree"]["ms"])


@pytest.mark.parametrize(
    "objective",
    [["--objective", "distill", "--teacher", "configs/models/tiny_qwen2.json", "--distill-loss", "kl"],
     ["--objective", "dpo", "--dpo-beta", "0.2"]],
    ids=["distill", "dpo"],
)  # fmt: skip
def test_bench_times_objectives_with_a_frozen_model(synthetic, tmp_path, objective):
    """Distillation's teacher and DPO's reference: the no-grad pass is old_forward; DPO packs its paired
    sequences only (the synthetic groups' rewards make sibling pairs), and the token counts are theirs."""
    from ds_tree.losses.dpo import DPOLoss
    from ds_tree.objectives.dpo import Pairs

    path, trajectories = synthetic
    out = tmp_path / "bench.json"
    argv = ["--data", str(path), "--model", "configs/models/tiny_llama.json", "--steps", "1", "--warmup", "0"]
    assert bench_main([*argv, *objective, "--budget", "512", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    kind = objective[1]
    trained = trajectories if kind == "distill" else Pairs.of(trajectories, "group", DPOLoss(0.2)).sequences
    assert 0 < len(trained) <= len(trajectories)
    flat, tree = packed_tokens(trained, "flat", 512), packed_tokens(trained, "tree", 512)
    modes = report["modes"]
    assert (modes["flat"]["packed_tokens_per_step"], modes["tree"]["packed_tokens_per_step"]) == (flat, tree)
    assert report["flat_tokens_per_step"] == sum(len(t) for t in trained)
    assert report["ideal_speedup"] == pytest.approx(flat / tree) and report["objective"] == kind
    settings = report["objective_settings"]
    assert settings["distill"]["loss"] == "kl" if kind == "distill" else settings["dpo"]["beta"] == 0.2
    for mode in ("flat", "tree"):
        assert modes[mode]["targets_per_step"] > 0
        timed = modes[mode]["old_forward_time_s"] + modes[mode]["updates_time_s"] + modes[mode]["pack_time_s"]
        assert timed == pytest.approx(modes[mode]["step_time_s"])
    assert modes["flat"]["targets_per_step"] > modes["tree"]["targets_per_step"]


def test_bench_dpo_needs_pairs(tmp_path, capsys):
    path = write_jsonl(tmp_path / "plain.jsonl", [{"group_id": "g", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    argv = ["--data", str(path), "--model", "configs/models/tiny_llama.json", "--objective", "dpo"]
    assert bench_main(argv) == 2
    assert "--objective dpo: no preference pairs in 1 trajectories (0 with a reward)" in capsys.readouterr().err
    assert bench_main([*argv, "--peak-memory"]) == 2
    assert "--objective dpo has no activation meters" in capsys.readouterr().err
