"""Process groups the tests start (launchers and their ranks), never left behind.

A launcher (torchrun, the deepspeed launcher, ``launch/train.sh``) starts its ranks as children; a
test that times out, or fails while they run, used to kill the launcher at most, and its ranks kept
the cores busy for the rest of the suite. Each group started here is its own session, and
:func:`kill_leftovers` (an autouse fixture in ``tests/conftest.py``, after every test) kills every
group whose launcher is still running: a hang then shows up as that test's failure, not as a slow
or stuck suite.
"""

from __future__ import annotations

import os
import signal
import subprocess

_started: list[subprocess.Popen] = []


def start_group(command: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(command, **kwargs)`` as the leader of a new session (its process group)."""
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
    """SIGKILL ``process``'s whole group while its leader runs (its id is then certainly that group's)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def kill_leftovers() -> None:
    """Kill every group started since the last call whose launcher still runs."""
    while _started:
        kill_group(_started.pop())
