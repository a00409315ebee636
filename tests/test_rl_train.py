"""GRPO training end to end: the deepspeed launcher, 2 ranks, ZeRO-3, metrics, checkpoint, resume.

The gradient itself is checked against the flat baseline in tests/test_rl_engine.py; here the
trainer runs as a user starts it (``deepspeed --module ds_tree.train``) and its outputs are read:
the ``rl/`` metrics, the console line, the checkpoint, a resumed run and the learning-rate schedule
across it. PPO with a learned critic (``estimator: gae``) trains its critic's own engine and resumes
it to the uninterrupted run's figures, bit for bit. Config errors of RL runs stop the dry run before
any model exists.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ds_tree.data.jsonl import slice_groups
from ds_tree.run import checkpoint
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import environment, find_shellcheck, launch_training, resumed_runs
from tests.helpers.runs import dry_run
from tests.helpers.shared_data import SHARED_DATA, absent
from tests.test_rl_engine import write_rollouts

SHARED_GAME24 = SHARED_DATA / "tot-game24" / "samples.jsonl"
RL_KEYS = {
    "rl/reward_mean",
    "rl/reward_std",
    "rl/advantage_mean",
    "rl/advantage_std",
    "rl/clip_frac_low",
    "rl/clip_frac_high",
    "rl/clip_frac_dual",
    "rl/ratio_mean",
    "rl/ratio_max",
    "rl/approx_kl",
    "rl/kl_ref",
    "rl/entropy",
    "rl/singleton_trajectories",
}
GRPO = {
    "kind": "grpo",
    "ppo_epochs": 2,
    "mini_batches": 2,
    "eps_high": 0.28,
    "dual_clip": 3.0,
    "kl_coef": 0.05,
    "entropy_coef": 0.01,
}


def records(output_dir: Path) -> dict[int, dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, filter(None, lines))}


def train(config: Path, *overrides: str) -> str:
    process = launch_training(config, *overrides)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.mark.distributed
def test_grpo_two_ranks_metrics_checkpoint_and_resume(tmp_path: Path) -> None:
    data = write_rollouts(tmp_path / "rollouts.jsonl")
    # Warmup over 4 steps: the learning rate of a resumed step shows whether the schedule, which
    # counts ppo_epochs x mini_batches = 4 updates per step, was restored with the checkpoint.
    config = write_config(
        tmp_path,
        data,
        max_steps=2,
        packing={"budget": 200},
        objective=GRPO,
        optimizer={"lr": 2e-2, "warmup_steps": 4, "schedule": "constant"},
        checkpoint={"every": 1, "keep_last": 3, "export_hf": False},
    )
    run = tmp_path / "run"
    output = train(config)
    first = records(run)
    assert sorted(first) == [1, 2]
    for step, record in first.items():
        assert RL_KEYS <= set(record), sorted(RL_KEYS - set(record))
        assert all(math.isfinite(record[key]) for key in RL_KEYS), record
        for side in ("low", "high", "dual"):
            assert 0 <= record[f"rl/clip_frac_{side}"] <= 1, record
        assert record["rl/entropy"] > 0 and record["rl/kl_ref"] >= 0 and record["rl/ratio_max"] > 0
        assert record["rl/singleton_trajectories"] == 0  # 4 samples a group
        assert record["tree/micro_batches"] >= 2 * 2  # 2 mini-batches, each at least a row per rank
        assert record["optim/lr"] == pytest.approx(2e-2 * step / 4, rel=1e-12)
    # The weights move within a step (2 epochs x 2 mini-batches): ratios leave 1 and get clipped, the
    # policy leaves the reference.
    assert first[2]["rl/clip_frac_low"] + first[2]["rl/clip_frac_high"] > 0, first[2]
    assert first[2]["rl/kl_ref"] > 0 and first[2]["rl/approx_kl"] > 0, first[2]
    assert re.search(r"step 2/2 loss \S+ .* reward [0-9.-]+ clip [0-9.]+/[0-9.]+ kl \S+ entropy [0-9.]+", output)

    checkpoints = run / "checkpoints"
    assert checkpoint.complete_tags(checkpoints) == ["step_0000001", "step_0000002"]
    assert (checkpoints / "latest").read_text().strip() == "step_0000002"
    record = checkpoint.read_record(checkpoints, "step_0000002")
    assert record["world_size"] == 2 and record["config"]["objective"]["kind"] == "grpo"

    output = train(config, "max_steps=3")
    assert "resumed from" in output and "step 3/3" in output and "step 1/3" not in output
    resumed = records(run)
    assert sorted(resumed) == [1, 2, 3]
    assert resumed[1] == first[1] and resumed[2] == first[2]  # records up to the checkpoint kept
    assert resumed[3]["optim/lr"] == pytest.approx(2e-2 * 3 / 4, rel=1e-12)
    assert all(math.isfinite(resumed[3][key]) for key in RL_KEYS), resumed[3]
    assert checkpoint.complete_tags(checkpoints)[-1] == "step_0000003"


TIMED = ("time/", "throughput/", "memory/")
"""Metrics of the machine, not of the run: a resumed step's may differ."""


@pytest.mark.distributed
@pytest.mark.slow
def test_gae_trains_its_critic_and_resumes_to_the_uninterrupted_run(tmp_path: Path) -> None:
    """2 ranks, ZeRO-3, offline data (each step planned ahead on the planning thread): the critic, a model of its
    own in its own DeepSpeed engine, moves every step, is saved with each
    checkpoint, and a run resumed from step 1's checkpoint gives step 2's figures of the uninterrupted run to the
    bit: the policy's loss, the critic's value loss and statistics (tests/distributed/resume_check.py)."""
    source = str(ROOT / "configs/models/tiny_qwen3.json")  # a value head is built and saved the same way
    gae = {"kind": "ppo", "estimator": "gae", "gamma": 0.97, "lam": 0.9, "critic": {"source": source, "lr": 0.01}}
    gae["normalise_advantages"] = True  # whitened over the step: mean 0, std 1
    config = write_config(
        tmp_path,
        write_rollouts(tmp_path / "rollouts.jsonl", groups=4),
        max_steps=2,
        packing={"budget": 200},  # trees split into parts
        objective=gae,
        optimizer={"lr": 2e-2, "schedule": "constant"},
        checkpoint={"every": 1, "keep_last": 3, "export_hf": False},
    )
    first, resumed = resumed_runs(config, 1)
    assert first["start_step"] == 0 and resumed["start_step"] == 1
    records = {record["step"]: record for record in first["metrics"]}
    assert sorted(records) == [1, 2] and [record["step"] for record in resumed["metrics"]] == [2]
    for record in records.values():
        assert {"critic/loss", "critic/value_mean", "critic/explained_variance", "critic/grad_norm"} <= set(record)
        assert all(math.isfinite(record[key]) for key in record if key.startswith("critic/")), record
        assert abs(record["rl/advantage_mean"]) < 1e-12 and abs(record["rl/advantage_std"] - 1) < 1e-12, record
    assert sorted(first["critic_changes"]) == ["1", "2"] and min(first["critic_changes"].values()) > 0
    assert records[2]["critic/value_mean"] != records[1]["critic/value_mean"]
    again = resumed["metrics"][0]
    figures = [key for key in records[2] if not key.startswith(TIMED)]
    assert {"loss/train", "critic/loss", "critic/value_mean", "critic/explained_variance"} <= set(figures)
    assert {key: again[key] for key in figures} == {key: records[2][key] for key in figures}
    assert resumed["critic_changes"] == {"2": first["critic_changes"]["2"]}
    for step in ("step_0000001", "step_0000002"):
        assert (tmp_path / "run" / "checkpoints" / step / "critic").is_dir(), step


def test_grpo_without_rewards_is_a_config_error_naming_the_trajectory(monkeypatch, capsys, tmp_path):
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"), objective={"kind": "grpo"})
    code, err = dry_run(monkeypatch, capsys, config)
    assert code == 2
    assert re.search(r"config error: data\.path: .*forest\.jsonl:\d+.*needs a finite reward", err), err


def test_more_mini_batches_than_groups_is_a_config_error(monkeypatch, capsys, tmp_path):
    data = write_rollouts(tmp_path / "rollouts.jsonl")
    config = write_config(tmp_path, data, objective={"kind": "grpo", "mini_batches": 5}, packing={"budget": 200})
    code, err = dry_run(monkeypatch, capsys, config)
    assert code == 2
    assert "objective.mini_batches (5) is more than data.groups_per_step (4)" in err, err
    assert dry_run(monkeypatch, capsys, config, "objective.mini_batches=4")[0] == 0


@pytest.mark.distributed
@pytest.mark.skipif(not SHARED_GAME24.is_file(), reason=absent(SHARED_GAME24))
def test_game24_config_trains_on_a_converted_slice(tmp_path: Path, tokenizer_dir) -> None:
    sliced = slice_groups(SHARED_GAME24, tmp_path / "slice.jsonl", groups=4, per_group=8)
    dataset = tmp_path / "dataset"
    convert = [sys.executable, str(ROOT / "tools/convert.py"), "--format", "chat", "--input", str(sliced)]
    convert += ["--output", str(dataset), "--tokenizer", str(tokenizer_dir)]
    subprocess.run(convert, check=True, capture_output=True, text=True, timeout=300)
    run = tmp_path / "run"
    output = train(
        ROOT / "configs/grpo_game24_cpu.yaml",
        f"data.path={dataset}",
        f"model.tokenizer={tokenizer_dir}",
        f"output_dir={run}",
        "max_steps=1",
        "logging.progress_bar=false",
        "checkpoint.export_hf=false",
    )
    record = records(run)[1]
    assert "step 1/1" in output and "reward" in output
    assert all(math.isfinite(record[key]) for key in RL_KEYS), record
    assert record["tree/por"] > 0.8  # the 5-shot prompt is shared by every sample of a puzzle
    rewards = [json.loads(line)["reward"] for line in sliced.read_text().splitlines()]
    assert record["rl/reward_mean"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-12)


def test_game24_script_is_shellcheck_clean_and_names_missing_samples(tmp_path: Path) -> None:
    script = ROOT / "launch" / "grpo_game24.sh"
    shellcheck = find_shellcheck()
    if shellcheck is not None:
        lint = subprocess.run([shellcheck, str(script)], capture_output=True, text=True, timeout=60)
        assert lint.returncode == 0, lint.stdout
    absent = tmp_path / "absent.jsonl"
    result = subprocess.run(
        ["bash", str(script)],
        env={**environment(), "SAMPLES": str(absent), "RUN": str(tmp_path / "run")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and f"{absent}: no such file" in result.stderr, result.stderr
    assert "tools/get_shared_data.py" in result.stderr and "docs/DATA.md" in result.stderr  # how to get it
    assert not (tmp_path / "run").exists()  # nothing built before the check
