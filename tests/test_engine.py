"""The DeepSpeed engine: exact distributed gradients, resume after SIGKILL, config errors, export.

Multi-rank tests start real processes (torchrun / the deepspeed launcher, gloo on the CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ds_tree.config import ConfigError, load_config
from ds_tree.losses.sft import Normalisers
from ds_tree.models.loading import load_model
from ds_tree.objectives.sft import run_rows
from ds_tree.packing.modes import pack_trajectories
from tests.helpers import ROOT
from tests.helpers.configs import write_accumulating_ds_config, write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import PYTHON, environment, free_port, launch_training, torchrun
from tests.helpers.runs import prepare


# ------------------------------------------------------------------ exactness
@pytest.mark.distributed
@pytest.mark.parametrize(
    "stage, mode, normalisation",
    [(3, "tree", "token_mean"), (2, "tree", "token_mean"), (3, "tree", "sequence_mean"), (3, "flat", "token_mean")],
)
def test_two_ranks_match_single_process_flat(tmp_path: Path, stage: int, mode: str, normalisation: str) -> None:
    data = write_forest(tmp_path / "forest.jsonl")
    ds_path = write_accumulating_ds_config(tmp_path / "ds.json", stage)
    # budget 200 < a tree: trees are split into parts, several micro-batches per rank.
    config = write_config(
        tmp_path,
        data,
        deepspeed=str(ds_path),
        packing={"budget": 200, "mode": mode},
        objective={"normalisation": normalisation},
    )
    out = tmp_path / "report.json"
    torchrun("tests/distributed/grad_check.py", "--config", str(config), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["zero_stage"] == stage and report["world_size"] == 2
    assert report["min_micro_batches_per_rank"] >= 2  # real gradient accumulation happened
    # float32 round-off: measured ~7e-7 (gradients) and ~2e-6 (parameters after AdamW).
    assert report["max_rel_grad_err"] < 1e-5, report
    assert report["max_rel_param_err"] < 1e-5, report


# --------------------------------------------------------------------- resume
def losses(output_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {record["step"]: record["loss/train"] for record in records}


@pytest.mark.distributed
def test_resume_after_sigkill_repeats_the_same_losses(tmp_path: Path) -> None:
    data = write_forest(tmp_path / "forest.jsonl", groups=8)
    config = write_config(
        tmp_path,
        data,
        max_steps=6,
        checkpoint={"every": 1, "keep_last": 2, "export_hf": False},
        optimizer={"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
    )
    reference_dir = tmp_path / "reference"
    process = launch_training(config, f"output_dir={reference_dir}")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    expected = losses(reference_dir)
    assert sorted(expected) == list(range(1, 7))

    killed_dir = tmp_path / "killed"
    killed_port = free_port()
    process = launch_training(config, f"output_dir={killed_dir}", port=killed_port)
    deadline = time.time() + 300
    latest = killed_dir / "checkpoints" / "latest"
    while time.time() < deadline:  # kill once step 3's checkpoint is complete
        if latest.exists() and latest.read_text().strip() >= "step_0000003":
            break
        assert process.poll() is None, "training ended before it could be killed"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    resumed_from = int(latest.read_text().strip().removeprefix("step_"))
    assert 3 <= resumed_from < 6

    process = launch_training(config, f"output_dir={killed_dir}")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    assert "resumed from" in output
    resumed = losses(killed_dir)
    assert sorted(resumed) == list(range(1, 7))
    for step in range(resumed_from + 1, 7):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=0), (step, resumed, expected)
    kept = sorted(p.name for p in (killed_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_0000005", "step_0000006"]
    # The deepspeed launcher gives DeepSpeed's CPU all-reduce its /dev/shm buffers (69 MB a rank);
    # the trainer unlinks them once mapped, so not even the killed run leaves them behind.
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{killed_port}_*"))


# --------------------------------------------------------------------- export
@pytest.mark.distributed
def test_export_loads_in_plain_transformers_with_the_engines_logits(tmp_path: Path) -> None:
    data = write_forest(tmp_path / "forest.jsonl")
    config = write_config(tmp_path, data, max_steps=2, checkpoint={"export_hf": True})
    out = tmp_path / "export.json"
    torchrun("tests/distributed/export_check.py", "--config", str(config), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["attn_implementation"] != "tree_torch"
    assert report["max_abs_logit_err"] <= 1e-5 * max(1.0, report["logit_scale"]), report
    assert (tmp_path / "run" / "hf" / "model.safetensors").is_file()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))

    # ZeRO-3 init (weights partitioned while they are read) of the export gives the step-1 loss
    # that a plain single-process model with the exported weights computes on the same data.
    hf = tmp_path / "run" / "hf"
    second = tmp_path / "second"
    process = launch_training(config, f"output_dir={second}", f"model.source={hf}", "model.zero_init=true")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    trainer = prepare(config, f"model.source={hf}", f"output_dir={tmp_path / 'plan'}")  # no resume to plan
    trajectories = [t for g in trainer.sampler.groups_for_step(0) for t in trainer.groups[g]]
    rows = pack_trajectories(trajectories, "flat", 4096)
    model = load_model(hf, attention="reference")
    expected = run_rows(model, rows, Normalisers.from_rows(rows)).loss
    assert losses(second)[1] == pytest.approx(expected, rel=1e-5)


# --------------------------------------------------------------- config errors
def test_unknown_key_is_named(tmp_path: Path) -> None:
    data = write_forest(tmp_path / "f.jsonl")
    config = write_config(tmp_path, data, optimizer={"lr": 1e-3, "learning_rate": 2})
    with pytest.raises(ConfigError, match=r"config.yaml: unknown key 'optimizer\.learning_rate'"):
        load_config(config)
    config = write_config(tmp_path, data)
    with pytest.raises(ConfigError, match=r"unknown key 'packing\.bugdet'"):
        load_config(config, ["packing.bugdet=3"])
    with pytest.raises(ConfigError, match=r"max_steps must be int, got 'many'"):
        load_config(config, ["max_steps=many"])


def test_missing_data_path_is_named(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "absent.jsonl")
    with pytest.raises(ConfigError, match="absent.jsonl"):
        prepare(config)


def test_budget_below_longest_path(tmp_path: Path) -> None:
    config = write_config(tmp_path, write_forest(tmp_path / "f.jsonl"), packing={"budget": 50})
    with pytest.raises(ConfigError, match=r"packing.budget \(50\) is below the longest trajectory .*f.jsonl:\d+"):
        prepare(config)


def test_batch_sizes_that_do_not_multiply_out(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 6, "gradient_accumulation_steps": 2, "zero_optimization": {}}))
    config = write_config(tmp_path, write_forest(tmp_path / "f.jsonl"), deepspeed=str(ds))
    with pytest.raises(ConfigError, match=r"train_batch_size \(6\).*world size \(2\)"):
        prepare(config, world_size=2)
    assert prepare(config, world_size=3).ds_config["train_batch_size"] == 6


def test_auto_values_resolved_from_training_config(tmp_path: Path) -> None:
    config = write_config(tmp_path, write_forest(tmp_path / "f.jsonl"), optimizer={"lr": 1e-3, "grad_clip": 0.5})
    ds = prepare(config, world_size=4).ds_config
    assert ds["train_batch_size"] == 4 and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is False
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64  # tiny_llama hidden_size 64


def test_cli_reports_config_errors_before_starting(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "absent.jsonl")
    result = subprocess.run(
        [PYTHON, "-m", "ds_tree.train", "--config", str(config)],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "config error" in result.stderr and "absent.jsonl" in result.stderr


@pytest.mark.distributed
def test_bf16_training_step_matches_float32_flat_loss(tmp_path: Path) -> None:
    data = write_forest(tmp_path / "forest.jsonl")
    config = write_config(tmp_path, data, model={"dtype": "bfloat16"})
    process = launch_training(config)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    trainer = prepare(config, f"output_dir={tmp_path / 'plan'}")  # not the 2-rank run's checkpoints
    trajectories = [t for g in trainer.sampler.groups_for_step(0) for t in trainer.groups[g]]
    rows = pack_trajectories(trajectories, "flat", 4096)
    model = load_model(trainer.config.model.source, attention="reference", seed=trainer.config.model.seed)
    expected = run_rows(model, rows, Normalisers.from_rows(rows)).loss
    # bf16 weights and activations: ~3 significant digits (the log-softmax itself runs in float32)
    assert losses(tmp_path / "run")[1] == pytest.approx(expected, rel=1e-2)
