"""The RL objectives in dfs mode: walked trees give the flat baseline's loss, metrics and gradients.

A walked row's RL loss is the sum over its chunks of the clipped objective on the targets each
chunk predicts; the old and reference policies' log-probs of walked rows come from a no-grad walk.
float64, one process, through ``ds-tree verify``'s :func:`compare_rl` (old log-probs, loss, every
metric sum and every gradient, 1e-10 relative), on the RL test forest (shared stems, advantages
of both signs on shared tokens, clipping on both sides) in chunks small enough to cut nodes and
with forks inside chunks; also the SFT report's ``dfs_*`` fields. The lockstep schedule that lets
ZeRO-3 walk different trees on different ranks is checked here as a pure function; the 2-rank
ZeRO-2 and ZeRO-3 steps are in ``tests/distributed/dfs_rl_check.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.comparison import gradient_errors
from ds_tree.data.jsonl import write_jsonl
from ds_tree.engine.calls import BACKWARD, FORWARD, KINDS, NO_GRAD, UPDATE, merge_schedules
from ds_tree.engine.dfs import DfsSettings
from ds_tree.losses.rl import RLSettings
from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows, run_rl_rows
from ds_tree.packing.balance import rows_per_rank
from ds_tree.packing.dfs_rows import DfsRow, split_over_budget, with_walked_rows
from ds_tree.packing.parts import split_tree
from ds_tree.registries import ESTIMATORS
from ds_tree.trees.trie import build_forest
from ds_tree.verify.tree_vs_flat import compare, compare_rl, metric_errors, run_rl_mode
from tests.helpers.configs import write_accumulating_ds_config, write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import torchrun
from tests.helpers.rollouts import reward, rl_trajectories
from tests.test_rl_tree_vs_flat import MODEL, _flat_logprobs, _policies

CASES = [
    ("grpo", False, RLSettings(), DfsSettings(7)),
    ("grpo", True, RLSettings(eps_low=0.1, eps_high=0.28, dual_clip=1.3), DfsSettings(3, recompute=True)),
    (
        "treepo",
        True,
        RLSettings(aggregation="seq_mean_token_sum", kl_coef=0.05, kl_estimator="k2", entropy_coef=0.01),
        DfsSettings(16),
    ),
    ("rloo", False, RLSettings(aggregation="seq_mean_token_mean", kl_coef=0.1, kl_estimator="k1"), DfsSettings(1)),
    ("tempo", True, RLSettings(aggregation="seq_mean_token_sum"), DfsSettings(5)),
]


@pytest.mark.parametrize(("estimator", "normalise", "settings", "dfs"), CASES)
def test_rl_dfs_equals_flat(estimator, normalise, settings, dfs):
    report = compare_rl(
        rl_trajectories(), MODEL, estimator=estimator, normalise_advantages=normalise, settings=settings, dfs=dfs
    )
    assert report["passed"], report
    for name in ("dfs_loss_rel_err", "dfs_max_rel_grad_err", "dfs_max_abs_logprob_err", "dfs_max_rel_metric_err"):
        assert report[name] <= 1e-10, (name, report[name])
    metrics = report["metrics_flat"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0, metrics  # both clipping branches ran


def test_sft_verify_reports_dfs():
    report = compare(rl_trajectories(seed=1), MODEL, normalisation="sequence_mean", dfs=DfsSettings(5))
    assert report["passed"], report
    assert report["dfs_chunk"] == 5 and report["dfs_max_rel_grad_err"] <= 1e-10, report


def _random_sequences(rng, ranks: int) -> list[list[int]]:
    """Each rank's call kinds (codes of ``KINDS``) as a step makes them: walks with recompute (a
    no-grad forward entering a chunk, a forward-and-backward leaving it), walks without (a held
    forward entering, its backward leaving), packed rows' forward-and-backward between walks."""
    no_grad, update, forward, backward = (KINDS.index(k) for k in (NO_GRAD, UPDATE, FORWARD, BACKWARD))
    sequences = []
    for _ in range(ranks):
        kinds = []
        for _ in range(int(rng.integers(0, 4))):
            recompute = rng.random() < 0.5
            enter, leave = (no_grad, update) if recompute else (forward, backward)
            depth = 0
            for _ in range(int(rng.integers(1, 12))):
                if depth and rng.random() < 0.5:
                    kinds.append(leave)
                    depth -= 1
                else:
                    kinds.append(enter)
                    depth += 1
            kinds += [leave] * depth
            kinds += [update] * int(rng.integers(0, 2))
        sequences.append(kinds)
    return sequences


def _dummies(sequence: list[int], schedule: list[int]) -> list[int] | None:
    """The dummy calls a rank makes following ``schedule`` (None if its calls are not a subsequence)."""
    position, dummies = 0, []
    for kind in schedule:
        if position < len(sequence) and sequence[position] == kind:
            position += 1
        else:
            dummies.append(kind)
    return dummies if position == len(sequence) else None


def test_lockstep_schedule_holds_every_ranks_calls():
    """Every rank's calls in order; its dummy backwards each close a dummy forward it holds, and none is
    left open; the schedule no longer than all ranks' calls together."""
    forward, backward = KINDS.index(FORWARD), KINDS.index(BACKWARD)
    rng = np.random.default_rng(0)
    for _ in range(300):
        sequences = _random_sequences(rng, int(rng.integers(1, 5)))
        schedule = merge_schedules(sequences)
        for sequence in sequences:
            dummies = _dummies(sequence, schedule)
            assert dummies is not None, (sequence, schedule)
            held = np.cumsum([(kind == forward) - (kind == backward) for kind in dummies])
            assert held.min(initial=0) >= 0 and held[-1:].sum() == 0, (sequence, schedule)
        assert max(map(len, sequences), default=0) <= len(schedule) <= sum(map(len, sequences))
    # a parent and its child against two leaves (tests/distributed/dfs_zero3_repro.py's ranks): the
    # second rank holds a dummy forward over the first's child, the first one over the second's second leaf
    parent_child, two_leaves = [forward, forward, backward, backward], [forward, backward, forward, backward]
    expected = [forward, forward, backward, forward, backward, backward]
    assert merge_schedules([parent_child, two_leaves]) == expected


def write_rewarded_forest(path: Path, groups: int = 6, seed: int = 0) -> Path:
    """:func:`write_forest`'s trees (deep enough to walk in chunks), each trajectory with a binary reward
    drawn as :mod:`tests.helpers.rollouts` draws them."""
    write_forest(path, groups, seed)
    rng = np.random.default_rng(seed + 1)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    write_jsonl(path, [{**r, "reward": reward(rng, "binary", 0)} for r in records])
    return path


@pytest.mark.distributed
@pytest.mark.parametrize("checkpointing", [False, True], ids=["layers-kept", "layers-checkpointed"])
def test_two_ranks_dfs_zero2_and_zero3_match_single_process_flat(tmp_path: Path, checkpointing: bool) -> None:
    """SFT (walks without recompute: held forwards) and GRPO (with recompute), every tree walked,
    ZeRO-2 then ZeRO-3, 2 ranks; with activation checkpointing, the backward calls recompute the
    layers (on the cached keys and values, under ZeRO-3 gathering in lockstep). Layers kept, also
    GRPO with a KL term against a ZeRO-3 partitioned reference (``kl_coef`` with ``model.zero_init``)."""
    data = write_rewarded_forest(tmp_path / "forest.jsonl")
    stages = [str(write_accumulating_ds_config(tmp_path / f"ds{s}.json", s)) for s in (2, 3)]
    config = write_config(
        tmp_path,
        data,
        model={"activation_checkpointing": checkpointing},
        objective={"kind": "grpo"},
        packing={"mode": "dfs", "budget": 150, "dfs_chunk": 64, "dfs_recompute": True},
        distributed={"timeout_s": 60},  # a schedule that lost step would hang in a collective
    )
    out = tmp_path / "report.json"
    partitioned = [] if checkpointing else ["--partitioned-reference"]
    torchrun(
        "tests/distributed/dfs_rl_check.py", "--config", str(config), "--out", str(out), "--deepspeed", *stages,
        *partitioned,
    )  # fmt: skip
    report = json.loads(out.read_text())
    runs = {(run["stage"], run["objective"]): run for run in report["runs"]}
    assert set(runs) == {(2, "sft"), (2, "grpo"), (3, "sft"), (3, "grpo")}
    for key, run in runs.items():
        kinds = run["kinds_per_rank"]
        assert kinds[0] != kinds[1], key  # different walks: ZeRO-3 needed the lockstep schedule
        # float32 round-off against the flat single process (test_engine's bound)
        assert run["loss_rel_err"] < 1e-5 and run["max_rel_grad_err"] < 1e-5, (key, run)
    assert runs[(3, "sft")]["walked"] > 0
    assert np.isfinite(report["train_step"]["loss"]) and report["train_step"]["grad_norm"] > 0
    if not checkpointing:
        run = report["partitioned_reference"]
        assert run["reference"] == "DeepSpeedEngine" and run["kl_ref"] > 0, run
        # each rank's walks gather the reference's parameters a different number of times: padded on its engine
        forwards = run["forwards_per_rank"]
        assert forwards[0] != forwards[1], run
        assert run["loss_rel_err"] < 1e-5 and run["max_rel_grad_err"] < 1e-5, run


@pytest.mark.distributed
def test_two_ranks_dfs_with_cppo_match_single_process_flat(tmp_path: Path) -> None:
    """CPPO's mask in walks: one more no-grad walk of each walked row per update (its mask), evened out over the
    ranks under ZeRO-3 like the old policy's walks, since the ranks walk different trees; the steps equal the flat
    single process's."""
    data = write_rewarded_forest(tmp_path / "forest.jsonl")
    stages = [str(write_accumulating_ds_config(tmp_path / f"ds{s}.json", s)) for s in (2, 3)]
    config = write_config(
        tmp_path,
        data,
        objective={"kind": "grpo", "cppo": {"enabled": True}},
        packing={"mode": "dfs", "budget": 150, "dfs_chunk": 64, "dfs_recompute": True},
        distributed={"timeout_s": 60},
    )
    out = tmp_path / "report.json"
    torchrun("tests/distributed/dfs_rl_check.py", "--config", str(config), "--out", str(out), "--deepspeed", *stages)
    report = json.loads(out.read_text())
    for run in report["runs"]:
        if run["objective"] == "grpo":
            assert run["kinds_per_rank"][0] != run["kinds_per_rank"][1], run
            assert run["loss_rel_err"] < 1e-5 and run["max_rel_grad_err"] < 1e-5, run
    assert np.isfinite(report["train_step"]["loss"]) and report["train_step"]["grad_norm"] > 0


def test_bench_times_rl_in_dfs_mode(tmp_path: Path) -> None:
    from ds_tree.cli.bench import main as bench_main

    data = write_rewarded_forest(tmp_path / "forest.jsonl", groups=2)
    out = tmp_path / "bench.json"
    argv = ["--data", str(data), "--model", MODEL, "--steps", "1", "--warmup", "0", "--objective", "grpo"]
    assert bench_main([*argv, "--modes", "tree,dfs", "--dfs-chunk", "64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    dfs, tree = report["modes"]["dfs"], report["modes"]["tree"]
    assert dfs["step_time_s"] > 0 and 0 < dfs["peak_memory_bytes"] < tree["peak_memory_bytes"], report


def test_rl_update_mixes_packed_and_walked_rows():
    """Tree mode with ``over_budget: dfs``: the trees with a path over the budget walked, the rest packed
    (split under the budget), one update; old and reference log-probs walked too (KL on), truncated
    importance weights on the walked log-probs; float64 against the flat pass."""
    trajectories = rl_trajectories(seed=0, groups=4)  # longest paths 45, 33, 54, 44 tokens
    budget, dfs = 44, DfsSettings(6)
    packed, walked = split_over_budget(build_forest(trajectories), "tree", "dfs", budget)
    assert packed and walked
    parts = [part for tree in packed for part in split_tree(tree, budget)]
    (rows,) = with_walked_rows(rows_per_rank(parts, 1, budget), walked, 1.0, 0.0)
    assert any(isinstance(row, DfsRow) for row in rows) and not all(isinstance(row, DfsRow) for row in rows)
    old, new = _policies()
    settings = RLSettings(kl_coef=0.1, importance_truncation=2.0, old_logprobs="recompute")
    computed = ESTIMATORS.get("grpo")(trajectories, normalise=False)
    advantages = {id(t): a for t, a in zip(trajectories, computed.values, strict=True)}
    normalisers = StepNormalisers.of(trajectories)
    for t in trajectories:  # the sampler's log-probs, for the truncated importance weights: another policy's
        t.logprobs = np.concatenate([[np.nan], _flat_logprobs(new, [t])[id(t)]])
    prepared = prepare_rl_rows(old, rows, advantages, settings, normalisers, reference=old, dfs=dfs)
    new.zero_grad(set_to_none=True)
    output = run_rl_rows(new, prepared, settings, dfs=dfs, backward_for=lambda _: torch.Tensor.backward)
    gradients = {name: p.grad.clone() for name, p in new.named_parameters()}
    flat = run_rl_mode(new, old, old, trajectories, "flat", 4096, 1, advantages, settings)
    assert abs(output.loss - flat.loss) <= 1e-10 * abs(flat.loss)
    assert max(gradient_errors(flat.gradients, gradients).values()) <= 1e-10
    assert max(metric_errors(flat.metrics, output.metrics).values()) <= 1e-10


def test_agent_grpo_dfs_example_dry_runs(tmp_path: Path, monkeypatch, capsys) -> None:
    """The example config: GRPO, over-budget trees walked under ZeRO-3."""
    from tests.helpers.runs import dry_run_in_process

    data = write_rewarded_forest(tmp_path / "forest.jsonl")
    example = "configs/examples/agent_grpo_dfs.yaml"
    overrides = (f"data.path={data}", "packing.budget=150", "data.groups_per_step=6")  # the forest's 6 groups
    code, out, err = dry_run_in_process(monkeypatch, capsys, 8, example, *overrides)
    assert code == 0, err
    assert json.loads(out)["world_size"] == 8
