"""Checkpoint bookkeeping without processes: completeness, ``latest``, resume policies, pruning, the
description of a failed write, metrics truncation on resume (a torn last line), line-atomic metrics
appends, the atomic-write helpers and the run directory (writability, config history, what a resume
may change, a killed run's leftovers, output directories nested where another run deletes).

Checkpoint directories are laid out here as ``checkpoint.save`` leaves them (DeepSpeed's files
are stand-ins, listed with their sizes and sha256 in the record).
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
from ds_tree.run import checkpoint, run_dir
from ds_tree.run.checkpoint import CheckpointError
from ds_tree.run.metrics import MetricsLogger
from tests.helpers.processes import one_rank_group

ROOT = Path(__file__).resolve().parents[1]


def complete(directory: Path, step: int, world_size: int = 2, config: dict | None = None) -> Path:
    path = directory / checkpoint.tag_for(step)
    path.mkdir(parents=True)
    for rank in range(world_size):
        (path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"weights %d" % rank)
    files = checkpoint.describe_files(path, checkpoint.listing(path))
    record = {"step": step, "world_size": world_size, "config": config or {}, "files": files}
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
    MetricsLogger(tmp_path, enabled=False, resume_step=3).close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5  # only rank 0 touches it
    logger = MetricsLogger(tmp_path, enabled=True, resume_step=3)
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


class _Engine:
    """``engine.save_checkpoint`` as DeepSpeed does it: its files under ``<dir>/<tag>``, then its
    recovery scripts copied beside the checkpoints (DeepSpeed's own ``_copy_recovery_script``)."""

    def save_checkpoint(self, save_dir: str, tag: str, **_) -> None:
        import torch
        from deepspeed.runtime.engine import DeepSpeedEngine

        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.ones(2)}, Path(save_dir) / tag / "mp_rank_00_model_states.pt")
        DeepSpeedEngine._copy_recovery_script(self, save_dir)

    def _change_recovery_script_permissions(self, dst: str) -> None:
        pass


def test_a_save_never_writes_through_a_link_out_of_the_run(tmp_path: Path) -> None:
    """Issue 42 #3: with ``checkpoints/zero_to_fp32.py`` a link to a file elsewhere, a save overwrote
    that file. Links planted under every name a save, the metrics or the lock write are removed or
    refused, never followed: the files outside stay as they were, and the save completes."""
    from ds_tree.run import run_lock

    outside = tmp_path / "outside"
    outside.mkdir()
    victims = {name: outside / name for name in ("script.py", "torch.py", "latest.tmp", "metrics", "lock")}
    for victim in victims.values():
        victim.write_text("precious\n")
    (outside / "folder").mkdir()
    run = tmp_path / "run"
    directory = run / "checkpoints"
    directory.mkdir(parents=True)
    (directory / "zero_to_fp32.py").symlink_to(victims["script.py"])
    (directory / "zero_to_torch.py").symlink_to(victims["torch.py"])
    (directory / f".latest.tmp-{os.getpid()}").symlink_to(victims["latest.tmp"])
    (directory / ".partial-step_0000001").symlink_to(outside / "folder")
    (run / "metrics.jsonl").symlink_to(victims["metrics"])
    (run / run_lock.LOCK_FILE).symlink_to(victims["lock"])
    with one_rank_group():
        tag = checkpoint.save(_Engine(), directory, 1, {}, {"world_size": 1}, keep_last=2)
    logger = MetricsLogger(run, enabled=True, resume_step=0)
    logger.log(1, {"loss/train": 0.5})
    with pytest.raises(ConfigError, match=rf"{run_lock.LOCK_FILE}: a symbolic link .*remove it"):
        run_lock.acquire(run)
    assert all(victim.read_text() == "precious\n" for victim in victims.values())
    assert list((outside / "folder").iterdir()) == []
    assert checkpoint.read_latest(directory) == tag == "step_0000001"
    script = directory / "zero_to_fp32.py"
    assert not script.is_symlink() and "weights_only=True" in script.read_text()
    assert not (run / "metrics.jsonl").is_symlink()


def test_the_atomic_writers_never_write_through_a_link_planted_at_their_temporary_name(tmp_path: Path) -> None:
    """Issue 42 #3, the other writers: a link planted under the temporary name of ``latest``, a JSONL
    file (rollouts, samples) or a step's rollouts is replaced by a new file, its target untouched."""
    from ds_tree.data.jsonl import write_jsonl
    from ds_tree.rollout.episodes.records import save_rollouts

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    planted = [
        run / f".latest.tmp-{os.getpid()}",
        run / f".out.jsonl.partial-{os.getpid()}",
        run / f".out.jsonl.gz.partial-{os.getpid()}",
        run / "rollouts" / "step_000001.jsonl.partial",
    ]
    for link in planted:
        link.symlink_to(victim)
    write_text_atomically(run / "latest", "step_0000001")
    write_jsonl(run / "out.jsonl", [{"a": 1}])
    write_jsonl(run / "out.jsonl.gz", [{"a": 1}])
    save_rollouts(run, 1, [])
    assert victim.read_text() == "precious\n"
    assert not any(link.is_symlink() for link in planted)
    assert (run / "latest").read_text() == "step_0000001" and (run / "out.jsonl").read_text() == '{"a":1}\n'


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


def test_a_checkpoint_is_complete_only_with_every_listed_file_at_its_recorded_size(checkpoints: Path) -> None:
    step = checkpoints / "step_0000006"
    rank1 = step / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    record = json.loads((step / checkpoint.RECORD).read_text())
    assert sorted(record["files"]) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    assert record["files"][rank1.name]["sha256"] == checkpoint.sha256_of(rank1)
    content = rank1.read_bytes()
    rank1.unlink()  # only rank 0's files: not complete, not latest's to name
    assert checkpoint.complete_tags(checkpoints) == ["step_0000002", "step_0000004"]
    with pytest.raises(CheckpointError, match="names 'step_0000006', which is not a complete checkpoint"):
        checkpoint.resume_tag(checkpoints, "auto")
    rank1.write_bytes(content[:-1])  # cut short
    assert checkpoint.read_record(checkpoints, "step_0000006") is None
    rank1.write_bytes(content)
    assert checkpoint.read_record(checkpoints, "step_0000006") == record
    for files in ({}, None, {"../step_0000004/zero_pp_rank_0_mp_rank_00_model_states.pt": {"size": 9}}):
        (step / checkpoint.RECORD).write_text(json.dumps({**record, "files": files}))
        assert checkpoint.read_record(checkpoints, "step_0000006") is None, files


def test_checkpoint_files_are_checked_against_their_sha256(checkpoints: Path) -> None:
    step = checkpoints / "step_0000004"
    record = checkpoint.read_record(checkpoints, "step_0000004")
    names = sorted(record["files"])
    assert checkpoint.verify_files(step, record, names) == [] and checkpoint.unlisted_files(step, record) == []
    (step / names[1]).write_bytes(b"weights 7")  # same size, other content: still "complete", never loaded
    assert checkpoint.read_record(checkpoints, "step_0000004") == record
    assert checkpoint.verify_files(step, record, names) == [
        f"{step / names[1]}: its content differs from the sha256 recorded in {step / checkpoint.RECORD}"
    ]
    (step / "zero_pp_rank_2_mp_rank_00_model_states.pt").write_bytes(b"extra")
    assert checkpoint.unlisted_files(step, record) == [
        f"{step / 'zero_pp_rank_2_mp_rank_00_model_states.pt'}: not listed in {step / checkpoint.RECORD}"
    ]


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_naming_the_file(tmp_path: Path, caplog) -> None:
    lines = [json.dumps({"step": step, "loss/train": 1.0 / step}) for step in range(1, 5)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][:17])  # killed while appending step 4
    with caplog.at_level("WARNING"):
        logger = MetricsLogger(tmp_path, enabled=True, resume_step=3)
    assert f"{path}:4: dropped a half-written last line (17 bytes" in caplog.text
    logger.log(4, {"loss/train": 0.25})
    logger.close()
    assert path.read_text() == "\n".join(lines[:3]) + "\n" + json.dumps({"step": 4, "loss/train": 0.25}) + "\n"
    # A whole last line without its newline is kept; a damaged line before the last is an error naming it.
    path.write_text("\n".join(lines))
    MetricsLogger(tmp_path, enabled=True, resume_step=4).close()
    assert path.read_text() == "\n".join(lines) + "\n"
    path.write_text(lines[0] + "\n" + lines[1][:10] + "\n" + lines[2] + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: not a metrics record"):
        MetricsLogger(tmp_path, enabled=True, resume_step=3)


def test_a_metrics_record_is_appended_in_one_write_of_the_whole_line(tmp_path: Path, monkeypatch) -> None:
    writes = []
    real_write = os.write

    def recorded(descriptor: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real_write(descriptor, data)

    logger = MetricsLogger(tmp_path, enabled=True, resume_step=0)
    monkeypatch.setattr(os, "write", recorded)
    logger.log(1, {"loss/train": 0.5, "optim/lr": 1e-3})
    logger.log(2, {"loss/train": 0.25, "optim/lr": 1e-3})
    monkeypatch.undo()
    assert writes == [
        (json.dumps({"step": step, "loss/train": loss, "optim/lr": 1e-3}) + "\n").encode()
        for step, loss in ((1, 0.5), (2, 0.25))
    ]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_leftovers_of_a_killed_run_are_removed_and_reported(tmp_path: Path, caplog) -> None:
    out = tmp_path / "run"
    directory = out / "checkpoints"
    complete(directory, 2)
    incomplete(directory, f"{checkpoint.PARTIAL}step_0000004")
    (directory / "zero_to_fp32.py").write_text("")  # DeepSpeed's copy, cut to 0 bytes by a kill
    (directory / ".latest.tmp-4242").write_text("step_00")
    (out / "hf").mkdir()
    (out / ".hf.replaced-4242").mkdir()  # a whole previous export
    (out / ".hf.replaced-4242" / "model.safetensors").write_bytes(b"x" * 100)
    (out / "hf.partial").mkdir()
    # Killed between replace_directory's two renames: step 3 only exists under its aside name.
    aside = complete(directory, 3).rename(directory / ".step_0000003.replaced-4242")
    with caplog.at_level("WARNING"):
        done = run_dir.remove_leftovers(out)
    assert sorted(p.name for p in directory.iterdir()) == ["step_0000002", "step_0000003"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "hf"]
    assert checkpoint.complete_tags(directory) == ["step_0000002", "step_0000003"]
    assert not aside.exists()
    assert len(done) == 6
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith(f"output_dir {out}: leftovers of an earlier run that was killed: removed 5 (")
    assert ".hf.replaced-4242 (1 file, 100 bytes)" in line and "checkpoints/zero_to_fp32.py (1 file, 0 bytes)" in line
    assert "checkpoints/.partial-step_0000004 (1 file, 4 bytes)" in line
    assert "put back checkpoints/.step_0000003.replaced-4242 -> step_0000003" in line
    caplog.clear()
    assert run_dir.remove_leftovers(out) == [] and not caplog.records


def test_output_dirs_that_another_run_deletes_are_refused(tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    complete(outer / "checkpoints", 5)
    (outer / "checkpoints" / "latest").write_text("step_0000005")
    for inner in (outer / "checkpoints" / "step_0000005" / "run", outer / "checkpoints", outer / "hf" / "x"):
        with pytest.raises(ConfigError, match=rf"output_dir: {inner} lies inside {outer}/(checkpoints|hf), which the"):
            run_dir.check_not_nested(inner)
    run_dir.check_not_nested(outer)
    run_dir.check_not_nested(tmp_path / "checkpoints" / "run")  # no run in tmp_path
    run_dir.check_not_nested(outer / "logs" / "run")
    # A run that started inside another's checkpoints earlier: the outer one is refused in turn.
    from ds_tree.run import run_lock

    nested = outer / "checkpoints" / "step_0000005" / "old_run"
    nested.mkdir()
    (nested / run_lock.LOCK_FILE).write_text("")
    with pytest.raises(ConfigError, match=rf"output_dir: {nested}, the output_dir of another run, lies inside"):
        run_dir.check_not_nested(outer)


def test_deepspeeds_copy_of_zero_to_fp32_is_rewritten_to_load_weights_only(tmp_path: Path) -> None:
    import deepspeed

    original = Path(deepspeed.__file__).parent / "utils" / "zero_to_fp32.py"
    assert "weights_only=False" in original.read_text()
    directory = tmp_path / "run" / "checkpoints"
    directory.mkdir(parents=True)
    script = directory / "zero_to_fp32.py"
    script.write_text(original.read_text())  # as DeepSpeed leaves it when a kill follows its save
    assert run_dir.remove_leftovers(tmp_path / "run") == []
    text = script.read_text()
    assert "weights_only=False" not in text and text.count("weights_only=True") >= 3
    assert "torch.serialization.add_safe_globals([ZeroStageEnum, LossScaler])" in text
    compile(text, str(script), "exec")
    checkpoint.harden_recovery_scripts(directory)  # once only
    assert script.read_text() == text
