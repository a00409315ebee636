"""The suite's process-group helpers (``tests/helpers/processes.py``): a launcher that hangs takes its children down."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from tests.helpers.processes import kill_leftovers, run_group, start_group


def child_pid(pid_file) -> int:
    for _ in range(500):
        if pid_file.exists() and pid_file.read_text().strip():
            return int(pid_file.read_text())
        time.sleep(0.01)
    raise AssertionError("the child never started")


def assert_gone(pid: int) -> None:
    """``pid`` ends within 5 s (a zombie awaiting its reaper counts as ended)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs: its group was not killed")


@pytest.mark.distributed
def test_a_timed_out_group_is_killed_with_its_children(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    script = f"sleep 600 & echo $! > {pid_file}; echo started; wait"
    with pytest.raises(AssertionError, match=r"(?s)ran past 1 s and was killed.*started"):
        run_group(["bash", "-c", script], timeout=1)
    assert_gone(child_pid(pid_file))


@pytest.mark.distributed
def test_leftover_groups_are_killed_after_the_test(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    launcher = start_group(["bash", "-c", f"sleep 600 & echo $! > {pid_file}; wait"])
    child = child_pid(pid_file)
    kill_leftovers()  # what the autouse fixture in conftest.py does after every test
    assert launcher.poll() is not None
    assert_gone(child)


SESSION_OF_ITS_OWN = (
    "import subprocess, sys; child = subprocess.Popen(['sleep', '600'], start_new_session=True); "
    "open(sys.argv[1], 'w').write(str(child.pid)); print('started', flush=True); child.wait()"
)


@pytest.mark.distributed
def test_a_child_in_a_session_of_its_own_is_killed_too(tmp_path) -> None:
    """As torchrun starts its ranks: out of the launcher's group, holding its output pipes."""
    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError, match=r"(?s)ran past 2 s and was killed.*started"):
        run_group([sys.executable, "-c", SESSION_OF_ITS_OWN, str(pid_file)], timeout=2)
    assert_gone(child_pid(pid_file))
