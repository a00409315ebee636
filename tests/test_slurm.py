"""launch/slurm.sbatch on a real SLURM cluster: one machine, two nodes (tools/slurm_cluster.sh).

One session-scoped cluster serves every test here; it is stopped (jobs, stray job processes,
daemons) when the session ends, on success, failure or interrupt. Without the binaries (``apt-get
install slurmd slurmctld slurm-client munge``, which ``.ci/run`` does) or root, the tests skip
with the reason.

The jobs, kept few (each spends most of its time starting Python):
- the DeepSpeed launcher path on one node x 2 ranks, uninterrupted: the reference losses;
- the torchrun path on 2 nodes x 1 rank (ZeRO-3), sent SIGUSR1 mid-run as ``--signal=B:USR1@GRACE``
  sends it (to the batch shell): every rank saves its step, the job requeues itself, resumes, and
  finishes with each step's loss equal to the reference's, bit for bit (2 ranks sum the same two
  numbers in either launcher);
- the DeepSpeed launcher on 2 nodes: refused with the reason (it needs pdsh and ssh between the
  nodes, absent here).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import environment, free_port

CLUSTER = ROOT / "tools" / "slurm_cluster.sh"
SBATCH = ROOT / "launch" / "slurm.sbatch"
JOB_TIMEOUT_S = 600

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running two-node cluster: the environment to submit jobs with (SLURM_CONF set)."""
    check = subprocess.run(["bash", str(CLUSTER), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        pytest.skip(check.stderr.strip() or "SLURM is not usable here")
    directory = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(directory)], capture_output=True, text=True)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        env = environment()
        env["SLURM_CONF"] = str(directory / "slurm.conf")
        env["PATH"] = f"{env.get('PATH', '')}:/usr/sbin"
        for name in [name for name in env if name.startswith("SLURM_") and name != "SLURM_CONF"]:
            del env[name]
        yield env
    finally:  # also on a failure or Ctrl-C: no daemon, job or job process outlives the session
        subprocess.run(["bash", str(CLUSTER), "stop", str(directory)], capture_output=True, text=True)


def scontrol_job(env: dict, job: str) -> dict[str, str]:
    result = subprocess.run(["scontrol", "show", "job", job, "-o"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)


PORTS: list[int] = []
"""The MASTER_PORTs of this module's jobs."""


def submit(env: dict, nodes: int, output: Path, *args: str, **variables: str) -> str:
    variables.setdefault("MASTER_PORT", str(free_port()))
    PORTS.append(int(variables["MASTER_PORT"]))
    command = [
        "sbatch",
        "--parsable",
        f"--nodes={nodes}",
        "--gpus-per-node=0",
        f"--output={output}",
        "--time=30",
        str(SBATCH),
        *args,
    ]
    result = subprocess.run(command, cwd=ROOT, env={**env, **variables}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def wait_for_job(env: dict, job: str, output: Path, requeue_now: bool = False) -> dict[str, str]:
    """The job's final record. A requeued job waits ~2 min (SLURM's requeue delay): ``requeue_now`` starts it
    sooner, once its nodes are idle again and a few seconds after the requeue.

    Not at once: slurmd refuses to launch a job whose credential is not newer than the time the job was
    last killed, at one-second resolution ("Job N already killed, do not launch batch job"), and then
    ends the requeued job. SLURM's own requeue delay keeps real clusters clear of that; a test that cuts
    the delay to nothing ran into it.
    """
    deadline = time.monotonic() + JOB_TIMEOUT_S
    requeued_at = None
    while time.monotonic() < deadline:
        record = scontrol_job(env, job)
        state = record["JobState"]
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return record
        if requeue_now and state == "PENDING" and record.get("Reason") == "BeginTime":
            requeued_at = requeued_at or time.monotonic()
            if time.monotonic() - requeued_at >= REQUEUE_SETTLE_S and nodes_idle(env):
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job} did not finish within {JOB_TIMEOUT_S} s:\n{tail(output)}")


REQUEUE_SETTLE_S = 3
"""Seconds between a requeue and starting the job again (over slurmd's one-second credential clock)."""


def nodes_idle(env: dict) -> bool:
    """No node is still allocated or completing a job."""
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
    states = result.stdout.split()
    return result.returncode == 0 and bool(states) and all(state == "idle" for state in states)


def job_report(env: dict, record: dict[str, str], output: Path) -> str:
    """What a failed job assertion shows: the job's record, its output, and the daemons' last log lines."""
    fields = ("JobState", "Reason", "ExitCode", "Restarts", "NodeList")
    lines = [" ".join(f"{name}={record.get(name)}" for name in fields), tail(output)]
    for log in sorted((Path(env["SLURM_CONF"]).parent / "log").glob("slurm*.log")):
        lines.append(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(lines)


def tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


def step_losses(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss/train"] for record in map(json.loads, filter(None, lines))}


@pytest.fixture(scope="module")
def run_config(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("slurm_run")
    data = write_forest(directory / "forest.jsonl", groups=8)
    return write_config(
        directory,
        data,
        max_steps=8,
        checkpoint={"every": 0, "keep_last": 2, "export_hf": False},
        optimizer={"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine"},
    )


@pytest.fixture(scope="module")
def reference(slurm, run_config) -> dict[int, float]:
    """The DeepSpeed launcher path (one node, 2 ranks), uninterrupted: its per-step losses."""
    output_dir = run_config.parent / "reference"
    log = run_config.parent / "reference.out"
    variables = {"LAUNCHER": "deepspeed", "GPUS_PER_NODE": "2"}
    job = submit(slurm, 1, log, str(run_config), f"output_dir={output_dir}", **variables)
    record = wait_for_job(slurm, job, log)
    assert record["JobState"] == "COMPLETED", tail(log)
    assert "slurm.sbatch: deepspeed on 1 node(s) x 2 = 2 ranks" in log.read_text()
    losses = step_losses(output_dir)
    assert sorted(losses) == list(range(1, 9))
    return losses


def test_torchrun_two_nodes_preempted_requeued_resumes_to_the_same_losses(slurm, run_config, reference) -> None:
    output_dir = run_config.parent / "preempted"
    log = run_config.parent / "preempted.out"
    job = submit(slurm, 2, log, str(run_config), f"output_dir={output_dir}", GPUS_PER_NODE="1")
    metrics = output_dir / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # mid-run: step 2 is done
        assert time.monotonic() < deadline, tail(log)
        assert scontrol_job(slurm, job)["JobState"] in ("PENDING", "RUNNING"), tail(log)
        time.sleep(0.05)
    # What --signal=B:USR1@GRACE does GRACE seconds before the time limit: USR1 to the batch shell only.
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    record = wait_for_job(slurm, job, log, requeue_now=True)
    text = log.read_text()
    assert record["JobState"] == "COMPLETED", job_report(slurm, record, log)
    assert record["Restarts"] == "1", job_report(slurm, record, log)
    assert "slurm.sbatch: torchrun on 2 node(s) x 1 = 2 ranks: n1 n2" in text
    stopped = [line for line in text.splitlines() if "stopped by SIGUSR1 after step" in line]
    assert len(stopped) == 1, tail(log)
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert 2 <= step < 8, stopped
    assert f"checkpoint step_{step:07d} saved" in stopped[0]
    assert f"requeueing job {job}" in text
    assert f"resumed from {output_dir / 'checkpoints' / f'step_{step:07d}'} at step {step}" in text
    # Every step once (the resumed run replaced nothing the first one logged), each equal to the reference.
    assert step_losses(output_dir) == reference
    assert (output_dir / "checkpoints" / "latest").read_text().strip() == "step_0000008"
    ds_config = json.loads((output_dir / "checkpoints" / "step_0000008" / "ds_tree_checkpoint.json").read_text())
    assert ds_config["world_size"] == 2


def test_deepspeed_launcher_on_two_nodes_needs_pdsh(slurm, run_config) -> None:
    if shutil.which("pdsh"):
        pytest.skip("pdsh is installed: the DeepSpeed launcher's multi-node path would try ssh")
    log = run_config.parent / "pdsh.out"
    job = submit(slurm, 2, log, str(run_config), LAUNCHER="deepspeed", GPUS_PER_NODE="1")
    record = wait_for_job(slurm, job, log)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "2:0", tail(log)
    assert "LAUNCHER=deepspeed on 2 nodes needs pdsh" in log.read_text()


def test_no_job_process_left(slurm) -> None:
    """Runs last in this module: the jobs above ended, and so did every process they started."""
    queue = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=slurm, capture_output=True, text=True)
    assert queue.stdout.strip() == "", queue.stdout
    conf = f"SLURM_CONF={slurm['SLURM_CONF']}"
    left = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            entries = environ.read_bytes().split(b"\0")
        except OSError:
            continue
        if conf.encode() in entries and any(e.startswith(b"SLURM_JOB_ID=") for e in entries):
            left.append(environ.parent.name)
    assert not left, f"processes of finished jobs still run: {left}"
    # DeepSpeed's CPU all-reduce buffers (named by the master port) are unlinked by the trainer.
    for port in PORTS:
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")), port
