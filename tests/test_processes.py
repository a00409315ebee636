"""The suite's process-group helpers (``tests/processes.py``): a launcher that hangs takes its children down."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.processes import kill_leftovers, run_group, start_group


def children_of(pid_file) -> psutil.Process:
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text().strip():
            return psutil.Process(int(pid_file.read_text()))
        time.sleep(0.01)
    raise AssertionError("the child never started")


def test_a_timed_out_group_is_killed_with_its_children(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {pid_file}; echo started; wait"
    with pytest.raises(AssertionError, match=r"(?s)ran past 1 s and was killed.*started"):
        run_group(["bash", "-c", script], timeout=1)
    child = children_of(pid_file)
    child.wait(timeout=5)  # gone with its launcher (psutil.TimeoutExpired if it still ran)
    assert not child.is_running()


def test_leftover_groups_are_killed_after_the_test(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    launcher = start_group(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"])
    child = children_of(pid_file)
    kill_leftovers()  # what the autouse fixture in conftest.py does after every test
    assert launcher.poll() is not None
    child.wait(timeout=5)
    assert not child.is_running()
