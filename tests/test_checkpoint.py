"""Checkpoint bookkeeping without processes: completeness, ``latest``, resume policies, pruning, the
description of a failed write, metrics truncation on resume, the atomic-write helpers and the run
directory (writability, config history, what a resume may change).

Checkpoint directories are laid out here as ``checkpoint.save`` leaves them (DeepSpeed's files
are stand-ins: the functions under test only read names and the record).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import yaml

from ds_tree.atomic import replace_directory, write_text_atomically
from ds_tree.config import ConfigError, config_to_dict, load_config
from ds_tree.engine import checkpoint, run_dir
from ds_tree.engine.checkpoint import CheckpointError
from ds_tree.engine.metrics import MetricsLogger

ROOT = Path(__file__).resolve().parents[1]


def complete(directory: Path, step: int, world_size: int = 2, config: dict | None = None) -> Path:
    path = directory / checkpoint.tag_for(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    record = {"step": step, "world_size": world_size, "config": config or {}}
    (path / checkpoint.RECORD).write_text(json.dumps(record))
    return path


def incomplete(directory: Path, name: str) -> Path:
    path = directory / name
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"half")
    return path


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    """Complete steps 2, 4, 6; ``latest`` names step 6; a half-written step 8 and a partial save."""
    directory = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        complete(directory, step)
    incomplete(directory, "step_0000008")
    incomplete(directory, f"{checkpoint.PARTIAL}step_0000010")
    (directory / "latest").write_text("step_0000006")
    return directory


def test_completeness_needs_the_record_of_that_step(checkpoints: Path) -> None:
    assert checkpoint.complete_tags(checkpoints) == ["step_0000002", "step_0000004", "step_0000006"]
    wrong = complete(checkpoints, 12)
    (wrong / checkpoint.RECORD).write_text(json.dumps({"step": 11}))
    (checkpoints / "step_0000014").symlink_to(checkpoints / "step_0000006")
    assert checkpoint.complete_tags(checkpoints) == ["step_0000002", "step_0000004", "step_0000006"]
    assert checkpoint.complete_tags(checkpoints / "absent") == []


def test_latest_names_a_complete_checkpoint(checkpoints: Path) -> None:
    assert checkpoint.read_latest(checkpoints) == "step_0000006"
    assert checkpoint.resume_tag(checkpoints, "auto") == "step_0000006"
    (checkpoints / "latest").unlink()
    assert checkpoint.read_latest(checkpoints) is None


@pytest.mark.parametrize(
    "content",
    ["step_00000x6", "", "\n", "step_0000008", "step_0000009", "..", "../..", ".", "/tmp", "step_0000006/..", "link"],
)
def test_damaged_latest_is_an_error_naming_the_file_and_the_complete_checkpoints(
    checkpoints: Path, content: str
) -> None:
    if content == "link":  # a link named like a checkpoint, to a complete one outside the directory
        outside = complete(checkpoints.parent / "elsewhere", 7)
        (checkpoints / "step_0000007").symlink_to(outside)
        content = "step_0000007"
    (checkpoints / "latest").write_text(content)
    for policy in ("auto", "latest"):
        with pytest.raises(CheckpointError) as raised:
            checkpoint.resume_tag(checkpoints, policy)
        message = str(raised.value)
        assert str(checkpoints / "latest") in message
        assert "step_0000002, step_0000004, step_0000006" in message
        assert "checkpoint.resume=newest_complete" in message
    assert checkpoint.resume_tag(checkpoints, "newest_complete") == "step_0000006"


def test_unreadable_latest_is_an_error(checkpoints: Path) -> None:
    (checkpoints / "latest").unlink()
    (checkpoints / "latest").mkdir()
    with pytest.raises(CheckpointError, match="latest: unreadable"):
        checkpoint.resume_tag(checkpoints, "auto")


def test_resume_policies(tmp_path: Path, checkpoints: Path) -> None:
    empty = tmp_path / "fresh" / "checkpoints"
    assert checkpoint.resume_tag(empty, "auto") is None
    assert checkpoint.resume_tag(empty, "newest_complete") is None
    assert checkpoint.resume_tag(empty, "never") is None
    with pytest.raises(CheckpointError, match="resume=latest, but there is no checkpoint"):
        checkpoint.resume_tag(empty, "latest")

    (checkpoints / "latest").write_text("step_0000004")
    assert checkpoint.resume_tag(checkpoints, "auto") == "step_0000004"
    assert checkpoint.resume_tag(checkpoints, "newest_complete") == "step_0000006"
    with pytest.raises(CheckpointError, match=r"resume=never, but .* \(step_0000002, step_0000004, step_0000006\)"):
        checkpoint.resume_tag(checkpoints, "never")
    (checkpoints / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"latest: missing, but .* holds complete checkpoints"):
        checkpoint.resume_tag(checkpoints, "auto")


def test_prune_keeps_the_newest_and_never_touches_newer_checkpoints(checkpoints: Path) -> None:
    complete(checkpoints, 9)  # written by an earlier run that got further
    checkpoint.prune(checkpoints, keep_last=1, newest_step=4)
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == [
        f"{checkpoint.PARTIAL}step_0000010",
        "latest",
        "step_0000004",
        "step_0000006",
        "step_0000008",
        "step_0000009",
    ]
    checkpoint.prune(checkpoints, keep_last=2, newest_step=9)
    assert checkpoint.complete_tags(checkpoints) == ["step_0000006", "step_0000009"]
    assert (checkpoints / "step_0000008").is_dir()  # not a checkpoint: never pruned, replaced by a save of step 8


def test_write_failure_names_a_full_disk(checkpoints: Path) -> None:
    full = checkpoint.write_failure(checkpoints, "step_0000008", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert full.startswith(f"checkpoint step_0000008 could not be written to {checkpoints}: no space left on device")
    assert "the last complete checkpoint, step_0000006, is kept" in full
    other = checkpoint.write_failure(checkpoints, "step_0000008", OSError(errno.EACCES, "Permission denied"))
    assert "the write failed" in other and "Permission denied" in other


def test_metrics_of_steps_after_the_resume_point_are_dropped(tmp_path: Path) -> None:
    lines = [json.dumps({"step": step, "loss/train": 1.0 / step}) for step in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    MetricsLogger(tmp_path, enabled=False, tensorboard=False, resume_step=3).close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5  # only rank 0 touches it
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, resume_step=3)
    logger.log(4, {"loss/train": 0.5})
    logger.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_write_text_atomically(tmp_path: Path) -> None:
    path = tmp_path / "latest"
    write_text_atomically(path, "step_0000001")
    write_text_atomically(path, "step_0000002")
    assert path.read_text() == "step_0000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_replace_directory(tmp_path: Path) -> None:
    def finished(name: str, content: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "model.safetensors").write_text(content)
        return path

    target = tmp_path / "hf"
    replace_directory(finished(".hf.partial", "first"), target)
    replace_directory(finished(".hf.partial", "second"), target)
    assert (target / "model.safetensors").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    # A failed move in leaves the previous directory in place.
    with pytest.raises(OSError):
        replace_directory(tmp_path / "never-written", target)
    assert (target / "model.safetensors").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    # A file at the target is replaced too.
    plain = tmp_path / "plain"
    plain.write_text("not a directory")
    replace_directory(finished(".plain.partial", "third"), plain)
    assert (plain / "model.safetensors").read_text() == "third"


def test_output_dir_must_be_a_writable_directory(tmp_path: Path) -> None:
    run_dir.check_writable(tmp_path / "new" / "run")  # created later, by rank 0
    assert not (tmp_path / "new").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        run_dir.check_writable(afile)
    with pytest.raises(ConfigError, match="is not a directory"):
        run_dir.check_writable(afile / "run")
    with pytest.raises(ConfigError, match="cannot be written"):
        run_dir.check_writable("/proc/ds_tree_run")  # read-only even for root


def test_config_history_is_appended_never_overwritten(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("")
    first = load_config(ROOT / "configs/tiny_cpu.yaml", [f"data.path={data}"])
    second = load_config(ROOT / "configs/tiny_cpu.yaml", [f"data.path={data}", "max_steps=80"])
    assert run_dir.record_config(tmp_path, first, 0).name == "config.yaml"
    assert run_dir.record_config(tmp_path, first, 40) is None  # unchanged: nothing new to record
    assert run_dir.record_config(tmp_path, second, 40).name == "config.1.yaml"
    assert run_dir.record_config(tmp_path, first, 80).name == "config.2.yaml"
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["max_steps"] == 40
    assert yaml.safe_load((tmp_path / "config.1.yaml").read_text())["max_steps"] == 80
    assert (tmp_path / "config.1.yaml").read_text().startswith("# run 2: started at step 40")


def test_resume_changes_are_listed_or_refused(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("")
    config = load_config(ROOT / "configs/tiny_cpu.yaml", [f"data.path={data}"])
    record = {"step": 40, "world_size": 2, "config": json.loads(json.dumps(config_to_dict(config)))}
    where = tmp_path / "step_0000040"
    assert run_dir.resume_changes(record, config, 2, where) == []
    overrides = [f"data.path={data}.new", "max_steps=80", "optimizer.lr=1e-3"]
    changed = load_config(ROOT / "configs/tiny_cpu.yaml", overrides)
    changes = run_dir.resume_changes(record, changed, 2, where)
    assert changes[0] == f"data.path: '{data}' -> '{data}.new'"
    assert changes[1] == "max_steps: 40 -> 80"
    assert changes[2].startswith("optimizer.lr: 0.002 -> 0.001 (not used")
    with pytest.raises(ConfigError, match=r"written by 2 ranks, this run has 4"):
        run_dir.resume_changes(record, config, 4, where)
    shorter = load_config(ROOT / "configs/tiny_cpu.yaml", [f"data.path={data}", "max_steps=30"])
    with pytest.raises(ConfigError, match=r"max_steps \(30\) is below the step of .*step_0000040 \(40\)"):
        run_dir.resume_changes(record, shorter, 2, where)
