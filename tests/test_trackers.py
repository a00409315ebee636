"""Experiment trackers (``logging.report_to``): a short single-process run writes TensorBoard, W&B
(offline), MLflow (a ``file:`` store) and trackio (a local store) with the metric names of
``metrics.jsonl``, and a resumed run continues the same tracker runs. A tracker whose package is
missing is refused at the dry run with the command that installs it."""

from __future__ import annotations

import json
import sqlite3
import struct
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from ds_tree import config as config_module
from ds_tree.config import ConfigError, load_config
from ds_tree.registry import RegistryError
from ds_tree.run.trackers import STATE_FILE, TRACKERS, Tracker, register_tracker, tracker_class
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import PYTHON, environment
from tests.helpers.runs import dry_run

ALL = ["tensorboard", "wandb", "mlflow", "trackio"]


def test_choices_are_the_registry() -> None:
    assert typing.get_args(config_module.Tracker)[1].names() == tuple(TRACKERS)


def test_a_project_tracker_registers_in_the_one_registry() -> None:
    """register_tracker adds to ds_tree.registries.TRACKERS (the config then offers it), refuses a second class
    under one name; an unknown name is a ConfigError naming logging.report_to and the known trackers."""
    mine = type("MineTracker", (Tracker,), {"name": "mine", "package": "json", "requirement": "json"})
    try:
        assert register_tracker(mine) is mine and tracker_class("mine") is mine
        assert "mine" in typing.get_args(config_module.Tracker)[1].names()
        with pytest.raises(RegistryError, match="tracker 'mine' is already registered"):
            register_tracker(type("OtherTracker", (Tracker,), {"name": "mine"}))
    finally:
        TRACKERS.unregister("mine")
    known = r"\(known: tensorboard, wandb, mlflow, trackio\)"
    with pytest.raises(ConfigError, match=rf"logging.report_to: unknown tracker 'mine' {known}"):
        tracker_class("mine")


@pytest.mark.parametrize(
    "override, message",
    [
        ("logging.report_to=[wandb, wandb]", "logging.report_to names wandb twice"),
        ("logging.report_to=[comet]", r"logging.report_to\[0\] must be one of tensorboard, wandb, mlflow, trackio"),
        ("logging.project=mine", "logging.project: only W&B, MLflow and trackio runs have names"),
        ("logging.run_name=x", "logging.run_name: only W&B, MLflow and trackio runs have names"),
        (
            "logging.tensorboard=false",
            r"logging.tensorboard was replaced by logging.report_to .*`\[tensorboard\]` for true, `\[\]` for false",
        ),
    ],
)
def test_report_to_values_are_checked(tmp_path: Path, override: str, message: str) -> None:
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"))
    with pytest.raises(ConfigError, match=message):
        load_config(config, [override])


@pytest.mark.parametrize("name, requirement", [("wandb", "wandb"), ("mlflow", "mlflow-skinny"), ("trackio", "trackio")])
def test_a_tracker_not_installed_is_refused_at_the_dry_run(tmp_path, monkeypatch, capsys, name, requirement) -> None:
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"))
    assert dry_run(monkeypatch, capsys, config, f"logging.report_to=[tensorboard, {name}]")[0] == 0
    monkeypatch.setitem(sys.modules, name, None)  # what Python does for a package that cannot be imported
    code, err = dry_run(monkeypatch, capsys, config, f"logging.report_to=[tensorboard, {name}]")
    assert code == 2, err
    assert f"logging.report_to: {name} needs the {requirement} package, which is not installed" in err, err
    assert f"pip install -e '.[{name}]'" in err, err


# ------------------------------------------------------------------ reading back what each tracker holds
def tensorboard_scalars(output_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def wandb_records(path: Path) -> list:
    """The records of one W&B ``run-<id>.wandb`` file: a 7-byte header, then LevelDB-style blocks of
    32 KiB holding chunks (crc32, length, kind: 1 whole, 2 first, 3 middle, 4 last) of protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    records, chunks, position = [], [], 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            break
        chunks.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def wandb_run(output_dir: Path, run_id: str) -> tuple[list[str], dict[int, dict[str, float]], dict]:
    """The offline run directories holding run ``run_id``, its history by step and its config."""
    directories = sorted(p.name for p in (output_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    history, config = {}, {}
    for name in directories:
        for record in wandb_records(output_dir / "wandb" / name / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                items = {name: json.loads(value) for name, value in items.items()}
                history.setdefault(int(items["_step"]), {}).update(items)
            elif kind == "run" and not config:  # the first process's config
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return directories, history, config


def mlflow_metrics(store: Path, run_id: str) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{store}")
    names = client.get_run(run_id).data.metrics
    return {name: {m.step: m.value for m in client.get_metric_history(run_id, name)} for name in names}


def trackio_metrics(store: Path, project: str, run_id: str) -> dict[str, dict[int, float]]:
    found: dict[str, dict[int, float]] = {}
    with sqlite3.connect(store / f"{project}.db") as db:
        for step, metrics in db.execute("select step, metrics from metrics where run_id = ?", (run_id,)):
            for name, value in json.loads(metrics).items():
                found.setdefault(name, {})[step] = value
    return found


def train(config: Path, env: dict, *overrides: str) -> None:
    command = [PYTHON, "-m", "ds_tree.train", "--config", str(config), *overrides]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
def test_every_tracker_gets_the_metrics_and_a_resume_continues_its_run(tmp_path: Path, monkeypatch) -> None:
    """One process, two steps with a checkpoint each, then a resume that trains a third."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store for those who ask
    output = tmp_path / "run"
    config = write_config(
        tmp_path,
        write_forest(tmp_path / "forest.jsonl"),
        max_steps=2,
        checkpoint={"every": 1, "export_hf": False},
        logging={"progress_bar": False, "report_to": ALL, "project": "trees"},
    )
    env = environment()
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        MLFLOW_TRACKING_URI=f"file:{tmp_path / 'mlruns'}",
        MLFLOW_ALLOW_FILE_STORE="true",
        TRACKIO_DIR=str(tmp_path / "trackio"),
    )
    train(config, env)
    first = json.loads((output / STATE_FILE).read_text())
    train(config, env, "max_steps=3")  # resumes from step 2's checkpoint
    state = json.loads((output / STATE_FILE).read_text())
    assert state == first, (first, state)  # the same runs continued

    jsonl = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in jsonl] == [1, 2, 3]
    names = set().union(*jsonl) - {"step"}  # the self-check's scalars on the steps it checks only
    assert {"loss/train", "optim/lr", "tree/por", "throughput/flat_tokens_per_s", "selfcheck/loss_rel_err"} <= names
    expected = {name: {r["step"]: r[name] for r in jsonl if name in r} for name in names}

    def same(found: dict[str, dict[int, float]], tolerance: float) -> None:
        assert set(found) == names, sorted(set(found) ^ names)
        for name in names:
            assert found[name].keys() == expected[name].keys(), name
            for step, value in expected[name].items():
                assert found[name][step] == pytest.approx(value, rel=tolerance, abs=tolerance), (name, step)

    same(tensorboard_scalars(output), 1e-6)  # event files hold float32
    directories, history, wandb_config = wandb_run(output, state["wandb"]["run_id"])
    assert len(directories) == 2  # one offline directory per process, both of the one run id
    same({name: {step: items[name] for step, items in history.items() if name in items} for name in names}, 0.0)
    assert wandb_config["output_dir"] == str(output) and wandb_config["max_steps"] == 2
    same(mlflow_metrics(tmp_path / "mlruns", state["mlflow"]["run_id"]), 0.0)
    same(trackio_metrics(tmp_path / "trackio", "trees", state["trackio"]["run_id"]), 0.0)

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}").get_run(state["mlflow"]["run_id"])
    assert run.info.run_name == str(output) and run.data.params["optimizer.lr"] == "0.001"
    assert run.info.status == "FINISHED"
    artifacts = tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts"
    assert yaml.safe_load((artifacts / "config.step_2.yaml").read_text())["max_steps"] == 3


@pytest.mark.parametrize(
    "damage, warning",
    [
        ("directory", "trackers.json: not a file: the trackers start new runs"),
        ({"wandb": 5}, "trackers.json: wandb: 5 is not an object: its tracker starts a new run"),
        ({"wandb": {"run_id": "../x"}}, "wandb: run_id '../x' is not a run id (letters, digits, - and _)"),
        ({"wandb": {"run_id": ["a"]}}, 'wandb: run_id is ["a"], not a string'),
    ],
    ids=["directory", "not-an-object", "a-path", "not-a-string"],
)
def test_a_damaged_state_file_is_a_warning_and_fresh_tracker_runs(tmp_path, monkeypatch, caplog, damage, warning):
    """Issue 55 #11: a directory (IsADirectoryError), ``{"wandb": 5}`` (AttributeError) or a run id ``../x``
    (W&B's UsageError) crashed the resume; only invalid JSON was a warning. Nothing is written outside the run."""
    from ds_tree.run.trackers import TrackerRun, close_all, open_trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    output = tmp_path / "run"
    output.mkdir()
    state = output / STATE_FILE
    if damage == "directory":
        state.mkdir()
    else:
        state.write_text(json.dumps(damage))
    run = TrackerRun(output, "trees", "run", {"max_steps": 2}, resume_step=2)
    with caplog.at_level("WARNING", logger="ds_tree.run.trackers"):
        trackers = open_trackers(["tensorboard", "wandb"], run)
    close_all(trackers)
    assert warning in caplog.text, caplog.text
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]  # nothing beside the run
    if damage != "directory":
        run_id = json.loads(state.read_text())["wandb"]["run_id"]
        assert run_id != "../x" and (output / "wandb" / "latest-run").is_symlink()  # a new run, in the run's folder


def test_a_closed_wandb_run_gives_the_process_its_own_exit_back(tmp_path, monkeypatch):
    """wandb.init replaces sys.exit and sys.excepthook with its hooks, whose exit reads a bare ``sys.exit()`` as
    code 0: after the run is closed the process has its own again (a reward calling ``sys.exit()`` in a later test
    of the same worker was reported as ``sys.exit(0)``)."""
    from ds_tree.run.trackers import TrackerRun, close_all, open_trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    before = (sys.exit, sys.excepthook)
    trackers = open_trackers(["wandb"], TrackerRun(tmp_path, "trees", "run", {}, resume_step=0))
    close_all(trackers)
    assert (sys.exit, sys.excepthook) == before
    with pytest.raises(SystemExit) as exited:
        sys.exit()
    assert exited.value.code is None
