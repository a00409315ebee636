"""Process groups the tests start (launchers and their ranks), never left behind.

A launcher (torchrun, the deepspeed launcher, ``launch/train.sh``) starts its ranks as children; a
test that times out, or fails while they run, used to kill the launcher at most, and its ranks kept
the cores busy for the rest of the suite. Each group started here is its own session, and
:func:`kill_leftovers` (an autouse fixture in ``tests/conftest.py``, after every test) kills every
group whose launcher is still running: a hang then shows up as that test's failure, not as a slow
or stuck suite.

Only a test marked ``distributed`` may start processes here, or spawn them with torch
(``torch.multiprocessing.start_processes``: ``spawn``, and the library's sequence-parallel groups):
``tests/conftest.py`` tells :func:`running` which test runs, and any other test fails at its first
start, before anything starts, naming the marker. So ``pytest -m "not distributed"`` (the fast tier,
``tools/run_tests.sh --fast``) starts no launcher and no ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import psutil
import pytest

_started: list[subprocess.Popen] = []
_running = {"test": "", "distributed": True}
"""The running test and whether it is marked ``distributed`` (outside pytest nothing is checked)."""


def running(test: str, distributed: bool) -> None:
    """``test`` (a node id) runs now; it may start processes when ``distributed``."""
    _running.update(test=test, distributed=distributed)


def check_marked(what: str) -> None:
    """Fail the running test unless it is marked ``distributed``: it is about to start ``what``."""
    if not _running["distributed"]:
        pytest.fail(
            f"{_running['test']} starts {what} but is not marked distributed: add @pytest.mark.distributed "
            "(tools/run_tests.sh --fast deselects those tests; tests/helpers/processes.py)",
            pytrace=False,
        )


def check_torch_spawns() -> None:
    """Make ``torch.multiprocessing.start_processes`` (which ``torch.multiprocessing.spawn`` calls too)
    :func:`check_marked` first (once; later calls change nothing). The library calls it as an attribute of
    ``torch.multiprocessing``, so this holds whenever it is installed before the first test runs."""
    import torch.multiprocessing

    spawn = sys.modules["torch.multiprocessing.spawn"]
    start_processes = spawn.start_processes
    if getattr(start_processes, "checks_marker", False):
        return

    def checked(*args, **kwargs):
        check_marked("processes with torch.multiprocessing")
        return start_processes(*args, **kwargs)

    checked.checks_marker = True
    spawn.start_processes = torch.multiprocessing.start_processes = checked


def start_group(command: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(command, **kwargs)`` as the leader of a new session (its process group)."""
    check_marked(f"{command[0]} (a process group)")
    process = subprocess.Popen(command, start_new_session=True, **kwargs)
    _started.append(process)
    return process


def run_group(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``command`` to its end with its output captured (text); past ``timeout`` seconds the whole
    group is killed and the test fails with the output so far."""
    process = start_group(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        stdout, stderr = process.communicate(timeout=10)  # the pipes close with the group's last process
        raise AssertionError(
            f"{' '.join(map(str, command[:3]))} ... ran past {timeout} s and was killed with its processes:\n"
            + (stdout or "")[-3000:]
            + (stderr or "")[-6000:]
        ) from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s whole group while its leader runs (its id is then certainly that group's), and
    every descendant found then: torchrun starts each rank in a session of its own, out of the group's reach
    (its ranks ran on after a timeout, holding the output pipes open)."""
    if process.poll() is None:
        try:
            descendants = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for descendant in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                descendant.kill()
        process.wait()


def kill_leftovers() -> None:
    """Kill every group started since the last call whose launcher still runs."""
    while _started:
        kill_group(_started.pop())


@contextlib.contextmanager
def one_rank_group():
    """A 1-rank gloo process group in this process for the duration (none is started where one exists): what
    code that sums over the ranks (normalisers, metrics, evaluations) needs outside a launcher."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()
