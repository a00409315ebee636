"""One run per output directory and checkpoints that cannot run code (issue 26, defects 1, 2, 7, 10).

- the output directory's lock: a second run (or its dry run) is refused with the holder's host and
  pid, exit 2; a dry run leaves no lock and creates nothing; a dead holder leaves no lock; processes
  a holder forked do not keep it;
- rank 0 chooses the resume checkpoint for every rank, and every rank checks its share of the files
  (2 ranks, gloo);
- a crafted pickle in a checkpoint never runs: refused by its sha256, and by ``weights_only=True``
  even where its record was rewritten to match (DeepSpeed's own loader, a real resume, the copied
  ``zero_to_fp32.py``);
- a model directory with ``auto_map`` does not prompt or run its code.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_tree.config import ConfigError
from ds_tree.run import checkpoint, run_lock
from ds_tree.run.checkpoint import CheckpointError
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import PYTHON, environment, torchrun
from tests.helpers.runs import prepare
from tests.test_checkpoint import complete


def test_a_second_run_on_a_locked_output_dir_is_refused_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run_lock.acquire(out)
    record = json.loads((out / run_lock.LOCK_FILE).read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    assert run_lock.acquire(out) and run_lock.held(out)  # the same process again: one more reference
    run_lock.release(out)
    assert run_lock.held(out)
    command = [PYTHON, "-c", f"from ds_tree.run import run_lock; run_lock.acquire({str(out)!r})"]
    result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    expected = f"output_dir: {out} is in use by another run (pid {os.getpid()} on host {socket.gethostname()}"
    assert expected in result.stderr
    assert f"lock file {out / run_lock.LOCK_FILE}" in result.stderr
    run_lock.release(out)
    assert not run_lock.held(out) and run_lock.holder(out) is None
    result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr  # released: the next run takes it


def test_a_dead_holder_leaves_no_lock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    code = f"import os; from ds_tree.run import run_lock; run_lock.acquire({str(out)!r}); os.kill(os.getpid(), 9)"
    killed = subprocess.run([PYTHON, "-c", code], env=environment(), capture_output=True, timeout=120)
    assert killed.returncode == -9
    stale = json.loads((out / run_lock.LOCK_FILE).read_text())
    assert stale["pid"] != os.getpid()  # the killed holder's record stays, its lock does not
    assert run_lock.holder(out) is None
    assert run_lock.acquire(out)
    assert json.loads((out / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    run_lock.release(out)


def test_processes_a_holder_forked_do_not_keep_its_lock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_lock.acquire(out)
    read, write = os.pipe()
    started_read, started_write = os.pipe()
    child = os.fork()
    if child == 0:  # a worker the rank forked: lives on after the rank lets go
        os.close(write)
        os.write(started_write, b"1")  # its fork hooks have run (until then it holds the descriptor)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    os.close(started_write)
    try:
        assert os.read(started_read, 1) == b"1"
        os.close(started_read)
        run_lock.release(out)
        assert run_lock.holder(out) is None
    finally:
        os.close(write)
        os.waitpid(child, 0)


def test_a_lock_held_under_a_dead_pid_is_reported_as_such(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    lock = out / run_lock.LOCK_FILE
    lock.write_text("")
    # Some process holds the lock while the record names a pid that no longer runs on this host.
    code = (
        f"import fcntl, sys; f = open({str(lock)!r}); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
        "sys.stdin.read()"
    )
    holder = subprocess.Popen([PYTHON, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        record = {"host": socket.gethostname(), "pid": int(dead.stdout), "started": "then"}
        lock.write_text(json.dumps(record) + "\n")
        with pytest.raises(ConfigError, match=rf"pid {record['pid']} on host .*that pid is not running .*fuser"):
            run_lock.acquire(out)
        assert not run_lock.held(out)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_a_locked_output_dir_is_a_config_error_exit_2_and_a_dry_run_leaves_no_lock(tmp_path: Path) -> None:
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"))
    out = tmp_path / "run"  # write_config's output_dir
    prepare(config)  # what a dry run checks
    assert not out.exists()  # a dry run creates nothing, so it cannot leave a lock
    holder = hold_in_another_process(out)
    try:
        expected = f"output_dir: {out} is in use by another run (pid {holder.pid} on host {socket.gethostname()}"
        with pytest.raises(ConfigError, match=re.escape(expected)):
            prepare(config)  # the dry run
        command = [PYTHON, "-m", "ds_tree.train", "--config", str(config)]
        result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert result.returncode == 2, result.stderr[-3000:]
        assert f"config error: {expected}" in result.stderr
        assert sorted(p.name for p in out.iterdir()) == [run_lock.LOCK_FILE]  # the refused run wrote nothing
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert run_lock.holder(out) is None


def hold_in_another_process(out: Path) -> subprocess.Popen:
    """A process that holds ``out``'s lock until its stdin closes."""
    code = (
        f"import sys; from ds_tree.run import run_lock; run_lock.acquire({str(out)!r}); "
        "print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [PYTHON, "-c", code], env=environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    return holder


# ----------------------------------------------------------- rank 0 decides
@pytest.mark.distributed
def test_rank_0_chooses_the_checkpoint_for_every_rank_and_all_ranks_check_the_files(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    for step in (2, 4):
        complete(directory, step)
    (directory / "latest").write_text("step_0000004")
    damaged = directory / "step_0000002"
    names = sorted(json.loads((damaged / checkpoint.RECORD).read_text())["files"])
    (damaged / names[1]).write_bytes(b"weights 9")  # rank 1's share (names[1::2]): same size, other bytes
    out = tmp_path / "report"
    args = ("--dir", str(directory), "--damaged", "step_0000002", "--out", str(out))
    torchrun("tests/distributed/agree_check.py", *args)
    reports = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["chosen"] == {"value": "step_0000004"}, (rank, report)
        assert report["verified"] == {"value": None}, (rank, report)
        assert f"refusing to load {damaged}: {damaged / names[1]}: its content differs" in report["damaged"]["error"]
        assert report["failed"]["error"].endswith("rank 0 found no usable checkpoint")


# ------------------------------------------------------- trusted checkpoints
class Payload:
    """A pickle that, once unpickled, creates ``marker`` (a stand-in for any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_deepspeeds_loader_runs_a_crafted_pickle_unless_weights_only(tmp_path: Path) -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker = tmp_path / "ran"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"module": Payload(marker)}, path)
    engine = TorchCheckpointEngine()
    with checkpoint.weights_only_loads():
        with pytest.raises(CheckpointError, match=rf"refusing to load {path}: .*would run pickled code"):
            engine.load(str(path), map_location="cpu")
    assert not marker.exists()
    assert torch.load is not None and "weights_only" not in repr(torch.load)  # restored after the block
    # DeepSpeed's state classes load; plain tensors too.
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state = {"stage": ZeroStageEnum.weights, "scaler": LossScaler(1.0), "w": torch.ones(2)}
    torch.save(state, tmp_path / "state.pt")
    with checkpoint.weights_only_loads():
        loaded = engine.load(str(tmp_path / "state.pt"), map_location="cpu")
    assert loaded["stage"] == ZeroStageEnum.weights and torch.equal(loaded["w"], torch.ones(2))
    engine.load(str(path), map_location="cpu")  # what DeepSpeed 0.19.8 does by itself: the code runs
    assert marker.exists()


def test_a_crafted_reference_policy_is_refused_with_its_path(tmp_path: Path) -> None:
    """Issue 42 #5: a tampered ``reference_policy.pt`` gets the one-line ``refusing to load PATH`` of
    DeepSpeed's files (a :class:`CheckpointError`), not torch's raw ``UnpicklingError``, and runs nothing."""
    from types import SimpleNamespace

    from ds_tree.engine.reference import REFERENCE_FILE
    from ds_tree.objectives.reference import KLReference

    marker = tmp_path / "ran"
    file = tmp_path / REFERENCE_FILE
    torch.save({"weight": Payload(marker)}, file)
    reference = KLReference(SimpleNamespace(objective=SimpleNamespace(reference_step=1)))
    with pytest.raises(CheckpointError, match=rf"^refusing to load {re.escape(str(file))}: .*would run pickled code"):
        reference.load(tmp_path, step=2)
    assert not marker.exists()


def test_every_torch_load_goes_through_trusted_load() -> None:
    """Issue 42 #5: one function loads torch files (``checkpoint.trusted_load``); no other module calls it."""
    calls = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "ds_tree").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"\btorch\.load\(", line) and path.name != "checkpoint.py"
    ]
    assert calls == []


def train_once(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [PYTHON, "-m", "ds_tree.train", "--config", str(config), *overrides]
    return subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.distributed
def test_a_crafted_checkpoint_file_never_runs_on_resume(tmp_path: Path) -> None:
    """One process, ZeRO-3: a run's checkpoint, then a file replaced by a pickle that would run code."""
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"), max_steps=1)
    out = tmp_path / "run"
    first = train_once(config)
    assert first.returncode == 0, first.stderr[-4000:]
    step = out / "checkpoints" / "step_0000001"
    record = json.loads((step / checkpoint.RECORD).read_text())
    assert {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= set(
        record["files"]
    )
    # The copy of zero_to_fp32.py beside the checkpoints loads with weights_only=True, and works.
    script = out / "checkpoints" / "zero_to_fp32.py"
    assert "weights_only=False" not in script.read_text()
    spec = importlib.util.spec_from_file_location("ds_tree_copied_zero_to_fp32", script)
    zero_to_fp32 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zero_to_fp32)
    weights = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step_0000001")
    assert "model.embed_tokens.weight" in weights

    marker = tmp_path / "ran"
    target = step / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"module": Payload(marker)}, target)
    # 1. The record not rewritten: no longer complete (the file's size), so latest names no checkpoint
    # (what the resume's prepare finds: a checkpoint error, exit 2).
    expected = f"which is not a complete checkpoint in {out / 'checkpoints'}: {target} holds"
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        prepare(config, "max_steps=2")
    # 2. The record rewritten to match (whoever can replace a file can): weights_only refuses it.
    record["files"][target.name] = checkpoint.describe_files(step, [target.name])[target.name]
    (step / checkpoint.RECORD).write_text(json.dumps(record))
    resumed = train_once(config, "max_steps=2")
    assert resumed.returncode == 1
    assert f"refusing to load {target}: it holds more than tensors" in resumed.stderr
    with pytest.raises(pickle.UnpicklingError):
        zero_to_fp32.parse_model_states([target])
    assert not marker.exists()


def test_a_model_directory_with_auto_map_does_not_prompt_or_run_its_code(tmp_path: Path, monkeypatch, capsys) -> None:
    from ds_tree.models.loading import load_config

    model = tmp_path / "model"
    model.mkdir()
    marker = tmp_path / "ran"
    (model / "config.json").write_text(
        json.dumps({"model_type": "ds_tree_custom", "auto_map": {"AutoConfig": "custom.CustomConfig"}})
    )
    (model / "custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n\n\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'ds_tree_custom'\n"
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # answers transformers' prompt, were it asked
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_config(model)
    assert "Do you wish to run the custom code" not in "".join(capsys.readouterr())
    assert not marker.exists()
