"""A step's host work one step ahead (ds_tree/engine/plan_ahead.py): the next step's work runs on the planner's
thread while the caller goes on; a step whose key changed since its work began is done again; the work's errors
reach the step that takes it; ``DS_TREE_PLAN_DELAY_S`` slows every step's work."""

from __future__ import annotations

import threading
import time

import pytest

from ds_tree.engine.plan_ahead import DELAY_VARIABLE, Planning
from ds_tree.packing.exchange import Collectives


def test_the_next_steps_work_runs_on_the_thread_while_the_caller_goes_on():
    comm = Collectives()
    planning = Planning(comm)
    calls = []

    def work_for(step, seconds=0.0):
        def work(given):
            assert given is comm  # the thread's own group
            calls.append((step, threading.current_thread().name))
            time.sleep(seconds)
            return step * 10

        return work

    try:
        first = planning.run(("step", 0), work_for(0))
        assert first.result == 0 and calls == [(0, "plan-ahead")]
        planning.ahead(("step", 1), work_for(1, seconds=0.3))
        time.sleep(0.6)  # the "step" computes meanwhile
        second = planning.run(("step", 1), work_for(1))
        assert second.result == 10 and second.plan_s >= 0.3 and second.wait_s < 0.1
        assert calls == [(0, "plan-ahead"), (1, "plan-ahead")]  # taken as begun: not done twice
        planning.ahead(("step", 2), work_for(2))
        third = planning.run(("step", 2, "edited config"), work_for(2))  # the key changed: done again
        assert third.result == 20 and calls[-2:] == [(2, "plan-ahead"), (2, "plan-ahead")]
        assert set(third.scalars()) == {"time/plan_s", "time/plan_wait_s"}
    finally:
        planning.close()
    assert not planning._thread.is_alive()


def test_a_failed_work_raises_in_the_step_that_takes_it(monkeypatch):
    def broken(comm):
        raise ValueError("a damaged row")

    planning = Planning(Collectives())
    try:
        planning.ahead("next", broken)
        with pytest.raises(ValueError, match="a damaged row"):
            planning.run("next", broken)
        assert planning.run("after", lambda comm: 7).result == 7  # the thread serves on
    finally:
        planning.close()
    monkeypatch.setenv(DELAY_VARIABLE, "0.2")
    inline = Planning()  # no thread: on the caller's, every second of it waited for
    outcome = inline.run(None, lambda comm: threading.current_thread().name)
    assert outcome.result == threading.current_thread().name
    assert outcome.plan_s >= 0.2 and outcome.wait_s >= outcome.plan_s
