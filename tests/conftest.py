"""Shared fixtures. The project tokenizer is built once per test session (it is deterministic).

The suite is deterministic by default: Hypothesis draws the same examples on every run
(``derandomize``, profile ``deterministic``) and every test starts with Python's ``random``,
numpy's and torch's global generators seeded from a hash of the test's id (the tests that draw
random q/k/v or token ids take their seed from ``random``). ``HYPOTHESIS_PROFILE=explore`` opts
into new examples and new seeds on every run, for looking for failures; a failure then prints the
blob (``@reproduce_failure``) or the seed that replays it. ``CI=1`` (the old switch) changes
nothing: the default is already deterministic.
"""

from __future__ import annotations

import hashlib
import os
import random

import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, print_blob=True)
settings.register_profile("ci", derandomize=True, print_blob=True)  # the name CI=1 used to load
settings.register_profile("explore", derandomize=False, print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "deterministic")
settings.load_profile(PROFILE)
EXPLORE = not settings.default.derandomize


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: it may start processes (``tests/helpers/processes.py``) only when marked
    ``distributed``."""
    from tests.helpers.processes import check_torch_spawns, running

    check_torch_spawns()
    running(item.nodeid, item.get_closest_marker("distributed") is not None)


def pytest_report_header(config):
    mode = "new examples and seeds every run" if EXPLORE else "fixed examples and seeds"
    return f"hypothesis profile: {PROFILE} ({mode}; HYPOTHESIS_PROFILE=explore to explore)"


@pytest.fixture(autouse=True)
def _seed_random_generators(request):
    """Seed ``random``, numpy's and torch's global generators per test: from the test's id by default
    (the same numbers whatever else runs), from the OS under the explore profile."""
    import numpy as np
    import torch

    if EXPLORE:
        random.seed()
    else:
        random.seed(int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:8], "little"))
    np.random.seed(random.randrange(2**32))
    torch.manual_seed(random.randrange(2**63))


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    """Launchers and ranks a test started (``tests/helpers/processes.py``) do not outlive it."""
    yield
    from tests.helpers.processes import kill_leftovers

    kill_leftovers()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from ds_tree.vocab.tokenizer import save_tokenizer

    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
