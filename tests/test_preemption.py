"""Preemption signals (ds_tree/run/preemption.py) and launch/train.sh's forwarding of them.

Issue 26, defects 3 and 4: a SIGTERM killed every rank within milliseconds without a checkpoint;
a SIGTERM to the DeepSpeed launcher (which train.sh exec'd into) ended it while its ranks trained
on, reparented; ``kill -9`` of its per-node launch process made it exit 0 while the ranks went on.

The handler's deadline and second-signal exits are checked on a process whose main thread waits in
a blocking call, as a rank waits in a collective for a rank that never answers. The launch tests
run one 2-rank training three times on one output directory: SIGTERM to train.sh, SIGUSR1 to one
rank only, ``kill -9`` of the DeepSpeed launch process.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from ds_tree.config import ConfigError, load_config
from ds_tree.run.preemption import EXIT_PREEMPTED, REPEAT_WINDOW_S
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import environment, free_port
from tests.helpers.processes import start_group

TRAIN_SH = ROOT / "launch" / "train.sh"

BLOCKED = textwrap.dedent(
    """
    import sys
    from ds_tree.run.preemption import PreemptionHandler
    handler = PreemptionHandler(["SIGTERM", "SIGUSR1"], float(sys.argv[1]))
    with handler:
        handler.saved = sys.argv[2] == "saved"
        print("ready", flush=True)
        sys.stdin.readline()  # blocked in a C call, as in a collective
        print(handler.signal_name(), flush=True)
    """
)


def start_blocked(grace_s: float, saved: bool = False) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", BLOCKED, str(grace_s), "saved" if saved else "not"],
        env=environment(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "ready\n", process.stderr.read()
    return process


def test_preempt_settings_are_checked(tmp_path: Path) -> None:
    config = write_config(tmp_path, tmp_path / "data.jsonl")
    assert load_config(config).checkpoint.preempt_signals == ["SIGTERM", "SIGUSR1"]
    assert load_config(config, ["checkpoint.preempt_signals=[]"]).checkpoint.preempt_signals == []
    with pytest.raises(ConfigError, match=r"checkpoint.preempt_signals\[1\] must be one of SIGTERM, .*got 'SIGKILL'"):
        load_config(config, ["checkpoint.preempt_signals=[SIGUSR1, SIGKILL]"])
    with pytest.raises(ConfigError, match="checkpoint.preempt_signals must be a list, got 'SIGTERM'"):
        load_config(config, ["checkpoint.preempt_signals=SIGTERM"])
    with pytest.raises(ConfigError, match="checkpoint.preempt_grace_s must be > 0, got 0"):
        load_config(config, ["checkpoint.preempt_grace_s=0"])


def test_handler_deadline_second_signal_and_one_delivery() -> None:
    deadline = start_blocked(grace_s=0.5)
    second = start_blocked(grace_s=600)
    twice_at_once = start_blocked(grace_s=600)
    after_save = start_blocked(grace_s=600, saved=True)
    for process in (deadline, second, twice_at_once, after_save):
        process.send_signal(signal.SIGTERM)
    # One signal delivered twice at once (a process group's kill plus a launcher's forwarding) counts once.
    twice_at_once.send_signal(signal.SIGUSR1)
    time.sleep(REPEAT_WINDOW_S + 0.5)  # not a timed assertion: only sets the second signal apart
    second.send_signal(signal.SIGTERM)
    after_save.send_signal(signal.SIGTERM)

    assert deadline.wait(timeout=60) == 128 + signal.SIGTERM
    assert "checkpoint.preempt_grace_s=0.5 s passed since SIGTERM" in deadline.stderr.read()
    assert second.wait(timeout=60) == 128 + signal.SIGTERM
    assert "a second signal (SIGTERM) arrived: exiting at once (143)" in second.stderr.read()
    assert after_save.wait(timeout=60) == EXIT_PREEMPTED
    assert "the preemption checkpoint is complete: exiting (75)" in after_save.stderr.read()
    out, err = twice_at_once.communicate("go\n", timeout=60)
    assert twice_at_once.returncode == 0, err
    assert out in ("SIGTERM\n", "SIGUSR1\n")  # pending together, the lower number is delivered first
    assert err.count(" received: stopping after the current step") == 1, err  # SIGUSR1's or SIGTERM's


# ----------------------------------------------------------------- train.sh
def train_sh(config: Path, port: int) -> subprocess.Popen:
    env = environment()
    env["MASTER_PORT"] = str(port)
    env.pop("NGPU", None)
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return start_group(["bash", str(TRAIN_SH), str(config)], cwd=ROOT, env=env, **output)


def wait_for_steps(process: subprocess.Popen, metrics: Path, steps: int) -> None:
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert process.poll() is None, process.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "training did not reach the step"
        time.sleep(0.05)


def run_processes(process: subprocess.Popen) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(ranks, deepspeed.launcher.launch processes) under a train.sh process."""
    tree = psutil.Process(process.pid).children(recursive=True)
    ranks = [p for p in tree if "ds_tree.train" in p.cmdline() and any("--local_rank=" in a for a in p.cmdline())]
    launches = [p for p in tree if "deepspeed.launcher.launch" in p.cmdline()]
    return ranks, launches


def latest_step(output_dir: Path) -> int:
    return int((output_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))


@pytest.mark.distributed
def test_train_sh_forwards_signals_and_never_reports_an_unfinished_run(tmp_path: Path) -> None:
    data = write_forest(tmp_path / "forest.jsonl", groups=8)
    config = write_config(tmp_path, data, max_steps=60, checkpoint={"every": 0, "export_hf": False})
    output_dir = tmp_path / "run"
    metrics = output_dir / "metrics.jsonl"

    # 1. SIGTERM to train.sh (not exec'd into the launcher any more): forwarded to the ranks, which
    #    finish their step, save it and exit 75; train.sh waits for them and exits 75.
    process = train_sh(config, free_port())
    wait_for_steps(process, metrics, 2)
    ranks, _ = run_processes(process)
    assert len(ranks) == 2
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == EXIT_PREEMPTED, output[-4000:]
    assert "train.sh: SIGTERM: forwarded to the ranks" in output
    first = latest_step(output_dir)
    assert 2 <= first < 60
    assert f"stopped by SIGTERM after step {first}: checkpoint step_{first:07d} saved" in output
    assert not any(rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE for rank in ranks)

    # 2. SIGUSR1 to rank 1 only: the ranks agree at the step boundary, both save and stop.
    process = train_sh(config, free_port())
    wait_for_steps(process, metrics, first + 2)
    ranks, _ = run_processes(process)
    rank1 = next(rank for rank in ranks if "--local_rank=1" in rank.cmdline())
    rank1.send_signal(signal.SIGUSR1)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == EXIT_PREEMPTED, output[-4000:]
    assert f"resumed from {output_dir / 'checkpoints' / f'step_{first:07d}'}" in output
    second = latest_step(output_dir)
    assert second > first + 1
    assert f"stopped by a signal to another rank after step {second}: checkpoint step_{second:07d} saved" in output
    assert "[rank 1] warning: SIGUSR1 received" in output

    # 3. kill -9 of the DeepSpeed launch process: the deepspeed launcher then exits 0 while the
    #    ranks run on. train.sh stops them (SIGTERM: they save) and fails.
    process = train_sh(config, free_port())
    wait_for_steps(process, metrics, second + 2)
    ranks, launches = run_processes(process)
    assert len(ranks) == 2 and len(launches) == 1
    launches[0].kill()
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 1, output[-4000:]
    assert "train.sh: the launcher exited (0) while ranks still ran" in output
    assert "train.sh: failed: the launcher did not see its ranks finish" in output
    assert latest_step(output_dir) > second
    assert not any(rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE for rank in ranks)


RANK_WITH_A_WORKER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    # a child of the rank that ignores SIGTERM and outlives it by a moment, as torch.compile's workers do;
    # it is told its parent's pid: on a loaded machine the rank may be gone before the worker's first line
    worker = "import os, signal, sys, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" \\
        "while os.getppid() == int(sys.argv[1]): time.sleep(0.05)\\ntime.sleep(3)"
    subprocess.Popen([sys.executable, "-c", worker, str(os.getpid())])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(75))  # the trainer: save the step, exit 75
    # a mask inherited from whoever started the test must not hold the signal back
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    open(sys.argv[-1], "w").close()
    started = time.monotonic()
    while time.monotonic() - started < 40:  # never outlives the test: no signal is exit 3, a failure
        time.sleep(0.05)
    os._exit(3)
    """
)


@pytest.mark.distributed
def test_train_sh_signals_the_ranks_only_not_their_children(tmp_path: Path) -> None:
    """A rank's own child (a compile worker) is no rank: train.sh neither signals it nor, when it outlives
    a rank that exited 75, reports the run unfinished (exit 1, seen on the first GPU run of the trainer)."""
    ready = tmp_path / "rank_ready"
    launch, launcher = tmp_path / "fake_launch", tmp_path / "fake_deepspeed"
    # DeepSpeed's launcher, reduced: it starts a per-node launch process, which starts one rank named as
    # DeepSpeed names it; each exits with its child's code
    launch.write_text(
        "#!/usr/bin/env bash\n"
        f"{sys.executable} -c {shlex.quote(RANK_WITH_A_WORKER)} -m ds_tree.train --local_rank=0 {ready} &\n"
        'wait "$!"\n'
    )
    launcher.write_text(f'#!/usr/bin/env bash\n{launch} &\nwait "$!"\n')
    for script in (launch, launcher):
        script.chmod(0o755)
    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    env = environment() | {"DEEPSPEED": str(launcher), "NGPU": "1", "MASTER_PORT": str(free_port())}
    process = start_group(
        ["bash", str(TRAIN_SH), str(config)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
            time.sleep(0.05)
        ranks, _ = run_processes(process)
        (rank,) = ranks
        (worker,) = rank.children()
        status = Path(f"/proc/{rank.pid}/status").read_text().splitlines()
        masks = [line for line in status if line.startswith("Sig")]
        process.send_signal(signal.SIGTERM)
        try:
            output = process.communicate(timeout=60)[0].decode()
        except subprocess.TimeoutExpired as timeout:  # what the rank's signal state was, for the report
            raise AssertionError(
                f"train.sh, or a process holding its output, still ran 60 s after SIGTERM; the rank's {masks}: "
                f"{timeout.output}"
            ) from None
        assert process.returncode == EXIT_PREEMPTED, output
        assert f"train.sh: SIGTERM: forwarded to the ranks (pids {rank.pid}); waiting for them" in output
        assert "while ranks still ran" not in output
        worker.wait(timeout=10)
    finally:  # the fake launcher runs in a session of its own: nothing of it outlives the test
        for found in psutil.process_iter(["cmdline"]):
            if any(str(tmp_path) in part for part in found.info["cmdline"] or ()):
                with contextlib.suppress(psutil.NoSuchProcess):
                    found.kill()
