"""Experiment trackers (``logging.report_to``): each gets the run's config once and every step's
metrics that ``metrics.jsonl`` gets, under the same names (``loss/train``, ``tree/por``, ...), from
rank 0 only.

A tracker is a class registered by name in :data:`ds_tree.registries.TRACKERS` (the built-ins below as
lazy entries there, a project's own with :func:`register_tracker`), whose names the config's ``Tracker``
choices read. Each but TensorBoard is an optional extra of the package
(``pip install -e '.[wandb]'``); a name whose package is missing is refused at the dry run
(:func:`check_installed`). Where the data goes is each library's own setting: TensorBoard
``<output_dir>/tensorboard``; W&B ``<output_dir>/wandb`` (``WANDB_MODE=offline`` keeps it local,
``wandb sync`` uploads it later); MLflow its tracking URI (``MLFLOW_TRACKING_URI``, e.g.
``file:/path/mlruns``, a server, ``sqlite:///mlflow.db``); trackio its local store (``TRACKIO_DIR``)
or a Space (``TRACKIO_SPACE_ID``).

Resuming: ``<output_dir>/trackers.json`` keeps what identifies each tracker's run (the W&B run id,
the MLflow run id, the trackio run name and id). A run resumed from a checkpoint continues those
runs; a run that starts from step 0 starts new ones and rewrites the file. Steps that a resumed run
trains again (those after its checkpoint that the killed run had logged) are logged again: TensorBoard
purges them first, W&B keeps the first values it got (it ignores a step below its last), MLflow and
trackio keep both values.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ds_tree.atomic import write_text_atomically
from ds_tree.config import ConfigError
from ds_tree.registries import TRACKERS
from ds_tree.registry import UnknownName

logger = logging.getLogger(__name__)

STATE_FILE = "trackers.json"
"""In ``output_dir``: each tracker's run identity, read back by a resumed run."""


@dataclass(frozen=True)
class TrackerRun:
    """What every tracker is opened with."""

    output_dir: Path
    project: str
    """``logging.project``: W&B project, MLflow experiment, trackio project."""
    name: str
    """The run's display name (``logging.run_name``, else ``output_dir``)."""
    config: dict
    """The run's config as plain types (:func:`ds_tree.config.config_to_dict`)."""
    resume_step: int
    """The checkpoint's step a resumed run starts after; 0 for a run that starts anew."""


class Tracker:
    """One tracker's run. Subclasses set the class attributes and implement the three methods."""

    name: ClassVar[str]
    """The name in ``logging.report_to``."""
    package: ClassVar[str]
    """The module it imports (checked at the dry run)."""
    requirement: ClassVar[str]
    """What pip installs for it (the extra of the same name in pyproject.toml)."""

    def __init__(self, run: TrackerRun, previous: dict | None) -> None:
        """Open (``previous`` None) or continue (``previous``: this tracker's :attr:`state` as saved) a run."""
        raise NotImplementedError

    @property
    def state(self) -> dict:
        """What a resumed run needs to continue this tracker's run (JSON types); ``{}``: nothing."""
        return {}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def register_tracker(cls: type[Tracker]) -> type[Tracker]:
    """Register ``cls`` under ``cls.name`` in :data:`TRACKERS` (a name registered twice is an error); usable
    as a class decorator."""
    return TRACKERS.register(cls.name, cls)


def tracker_class(name: str) -> type[Tracker]:
    try:
        return TRACKERS.get(name)
    except UnknownName:
        raise ConfigError(f"logging.report_to: unknown tracker {name!r} (known: {', '.join(TRACKERS)})") from None


def check_installed(report_to: Iterable[str]) -> None:
    """A :class:`ConfigError` naming the first tracker whose package is not installed, and how to install it."""
    for name in report_to:
        tracker = tracker_class(name)
        if importlib.util.find_spec(tracker.package) is None:
            raise ConfigError(
                f"logging.report_to: {name} needs the {tracker.requirement} package, which is not installed; "
                f"install it with `.venv/bin/python -m pip install -e '.[{name}]'` (or `pip install "
                f"{tracker.requirement}`), or remove {name} from logging.report_to"
            )


def open_trackers(report_to: Iterable[str], run: TrackerRun) -> list[Tracker]:
    """The trackers of ``report_to``, each opened or continued (:data:`STATE_FILE`), and the file updated."""
    path = run.output_dir / STATE_FILE
    previous = read_state(path) if run.resume_step else {}
    opened: list[Tracker] = []
    try:
        for name in report_to:
            opened.append(tracker_class(name)(run, previous.get(name)))
    except BaseException:
        close_all(opened)
        raise
    state = {**previous, **{tracker.name: tracker.state for tracker in opened if tracker.state}}
    if path.is_dir() and not path.is_symlink():
        logger.warning("%s is a directory: the trackers' runs are not recorded (a resume starts new ones)", path)
    elif state or path.exists() or path.is_symlink():
        write_text_atomically(path, json.dumps(state, indent=1, sort_keys=True) + "\n")  # a link replaced
    return opened


RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
"""What a tracker's run id (an entry's ``run_id``) may be: W&B's and MLflow's ids are such; a path (``../x``)
would name a folder outside the run."""


def read_state(path: Path) -> dict:
    """The trackers' runs a resumed run continues: :data:`STATE_FILE`'s entries that are well formed. A damaged
    file (not a file, not JSON, not an object) or entry (not an object of strings, a run id that is no id) is a
    warning, and the trackers concerned start new runs."""
    if not path.exists() and not path.is_symlink():
        return {}
    if path.is_symlink() or not path.is_file():
        logger.warning("%s: not a file: the trackers start new runs", path)
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("%s: unreadable (%s): the trackers start new runs", path, error)
        return {}
    if not isinstance(state, dict):
        logger.warning("%s: not a JSON object: the trackers start new runs", path)
        return {}
    kept = {}
    for name, entry in state.items():
        problem = entry_problem(entry)
        if problem:
            logger.warning("%s: %s: %s: its tracker starts a new run", path, name, problem)
        else:
            kept[name] = entry
    return kept


def entry_problem(entry: object) -> str | None:
    """Why one tracker's saved state cannot be continued (:func:`read_state`), or None."""
    if not isinstance(entry, dict):
        return f"{json.dumps(entry)[:80]} is not an object"
    for key, value in entry.items():
        if not isinstance(value, str) or not value:
            return f"{key} is {json.dumps(value)[:80]}, not a string"
        if key == "run_id" and not RUN_ID.fullmatch(value):
            return f"run_id {value[:80]!r} is not a run id (letters, digits, - and _)"
    return None


def close_all(trackers: Iterable[Tracker]) -> None:
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as error:  # noqa: BLE001 - one tracker's failure must not lose the others' data
            logger.warning("closing the %s tracker failed: %s", tracker.name, error)


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for trackers whose parameters are flat)."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class TensorBoardTracker(Tracker):
    """Event files in ``<output_dir>/tensorboard``; a resumed run purges the steps after its checkpoint."""

    name = "tensorboard"
    package = "tensorboard"
    requirement = "tensorboard"

    def __init__(self, run: TrackerRun, previous: dict | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run.output_dir / "tensorboard"), purge_step=run.resume_step + 1)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run in ``<output_dir>/wandb``, continued by id after a resume. The console
    stays the trainer's (``console="off"``: W&B does not wrap stdout and stderr)."""

    name = "wandb"
    package = "wandb"
    requirement = "wandb"

    def __init__(self, run: TrackerRun, previous: dict | None) -> None:
        import wandb

        run_id = (previous or {}).get("run_id")
        self.hooks = (sys.exit, sys.excepthook)
        """What wandb.init replaces with its exit hooks (an exit without a code then reads as ``sys.exit(0)``): put
        back by :meth:`close`, so the process after the run (a test, an in-process caller) gets its own."""
        self.run = wandb.init(
            project=run.project,
            name=run.name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=str(run.output_dir),
            config=run.config,
            settings=wandb.Settings(console="off"),
        )
        if run_id:
            self.run.config.update(run.config, allow_val_change=True)  # a resumed run's config may differ

    @property
    def state(self) -> dict:
        return {"run_id": self.run.id}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
        sys.exit, sys.excepthook = self.hooks


MLFLOW_BATCH = 100
"""MLflow takes at most 100 parameters in one ``log_batch``."""
MLFLOW_PARAM_CHARS = 6000
"""MLflow's longest parameter value."""


class MlflowTracker(Tracker):
    """An MLflow run in experiment ``logging.project`` at the tracking URI MLflow is configured with
    (``MLFLOW_TRACKING_URI``). The config goes in as flat parameters (``optimizer.lr``) and as the
    artifact ``config.yaml``; a resumed run adds ``config.step_<N>.yaml`` (MLflow refuses to change a
    parameter's value)."""

    name = "mlflow"
    package = "mlflow"
    requirement = "mlflow-skinny"

    def __init__(self, run: TrackerRun, previous: dict | None) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        self.run_id = self._continued((previous or {}).get("run_id"))
        if self.run_id is not None:
            self.client.log_dict(self.run_id, run.config, f"config.step_{run.resume_step}.yaml")
            return
        experiment = self.client.get_experiment_by_name(run.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(run.project)
        self.run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
        params = [Param(key, str(value)[:MLFLOW_PARAM_CHARS]) for key, value in flatten(run.config).items()]
        for start in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + MLFLOW_BATCH])
        self.client.log_dict(self.run_id, run.config, "config.yaml")

    def _continued(self, run_id: str | None) -> str | None:
        """``run_id`` reopened, or None where there is none or this tracking URI does not hold it."""
        if not run_id:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException as error:
            logger.warning("MLflow run %s cannot be continued (%s): a new run starts", run_id, error)
            return None
        return run_id

    @property
    def state(self) -> dict:
        return {"run_id": self.run_id}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(key), float(value), now, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_key(key: str) -> str:
    """``key`` as MLflow takes a metric name (alphanumerics, ``_ - . : /`` and spaces): ``eval/pass@4`` is
    ``eval/pass_at_4``."""
    return re.sub(r"[^\w\-.: /]", "_", key.replace("@", "_at_"))


class TrackioTracker(Tracker):
    """A trackio run (local store ``TRACKIO_DIR``, or a Space with ``TRACKIO_SPACE_ID``), continued by
    name after a resume. Its own CPU and GPU sampling threads stay off."""

    name = "trackio"
    package = "trackio"
    requirement = "trackio"

    def __init__(self, run: TrackerRun, previous: dict | None) -> None:
        import trackio

        resumed = (previous or {}).get("name")
        self.run = trackio.init(
            project=run.project,
            name=resumed or run.name,
            config=run.config,
            resume="must" if resumed else "never",
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    @property
    def state(self) -> dict:
        return {"name": self.run.name, "run_id": self.run.id}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
