"""The tiers' markers: an unmarked test cannot start processes (tests/helpers/processes.py), so the fast tier
(``tools/run_tests.sh --fast``: ``-m "not distributed and not slow"``) never starts ranks."""

from __future__ import annotations

import sys

import pytest
import torch.multiprocessing

from tests.helpers.processes import run_group, start_group

NOT_MARKED = r"test_markers\.py::test_\w+ starts .* but is not marked distributed: add @pytest\.mark\.distributed"


def test_an_unmarked_test_fails_at_its_first_process_group_before_it_starts() -> None:
    with pytest.raises(pytest.fail.Exception, match=NOT_MARKED):
        start_group([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(pytest.fail.Exception, match=NOT_MARKED):
        run_group(["torchrun", "--nproc_per_node=2", "script.py"], timeout=1)


def test_an_unmarked_test_fails_at_a_torch_spawn() -> None:
    """What ``spawn_group`` (the library's sequence-parallel groups) and ``torch.multiprocessing.spawn`` call."""
    with pytest.raises(pytest.fail.Exception, match=NOT_MARKED):
        torch.multiprocessing.start_processes(print, nprocs=2)
    with pytest.raises(pytest.fail.Exception, match=NOT_MARKED):
        torch.multiprocessing.spawn(print, nprocs=2)


@pytest.mark.distributed
def test_a_distributed_test_starts_them() -> None:
    assert run_group([sys.executable, "-c", "raise SystemExit(3)"], timeout=120).returncode == 3
