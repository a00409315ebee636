"""The training-time tree-vs-flat self-check (``objective.self_check``): which steps it runs on, its
sample, a passing check in float32/bf16 and dfs mode, and a broken restoration weight (a test-only
fault injection) stopping it with an error naming the step and the failing quantity.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.data import load_trajectories
from ds_tree.engine import self_check, step
from ds_tree.engine.dfs import DfsSettings
from ds_tree.models.loading import load_model
from tests.test_engine import write_forest

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "configs/models/tiny_llama.json")


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    return load_trajectories(write_forest(tmp_path_factory.mktemp("self_check") / "forest.jsonl"))


def test_due_steps():
    assert [s for s in range(8) if self_check.is_due("first", s, 3)] == [3]
    assert [s for s in range(8) if self_check.is_due("every:3", s, 1)] == [0, 3, 6]
    assert not any(self_check.is_due("off", s, 0) for s in range(8))


def test_sample_is_whole_groups_under_the_cap(trajectories):
    sample = self_check.sample_groups(trajectories, budget=400, cap=300)
    groups = {t.group_id for t in sample}
    assert groups and all(sum(t.group_id == g for t in sample) == 4 for g in groups)  # whole groups of 4
    assert len(self_check.sample_groups(trajectories, budget=10)) == 0  # no group fits the rows


@pytest.mark.parametrize("dtype, dfs", [(torch.float32, None), (torch.bfloat16, DfsSettings(24, False))])
def test_check_passes_within_the_dtype_tolerance(trajectories, dtype, dfs):
    model = load_model(MODEL, dtype=dtype, seed=3)
    sample = self_check.sample_groups(trajectories, budget=400)
    result = self_check.check_sample(model, sample, budget=400, dfs=dfs)
    self_check.verdict(result, 1, dtype)
    assert 0 < result.tokens and result.max_abs_logprob_err < self_check.TOLERANCES[dtype]


def test_a_broken_restoration_weight_stops_with_a_clear_error(trajectories, monkeypatch):
    model = load_model(MODEL, seed=3)
    sample = self_check.sample_groups(trajectories, budget=400)
    exact = step.restoration_weights

    def broken(row, *args):  # fault injection: a shared token counted once, not once per trajectory
        weights = exact(row, *args)
        return np.where(row.mask_sum > row.mask_max, weights * row.mask_max / np.maximum(row.mask_sum, 1), weights)

    monkeypatch.setattr(step, "restoration_weights", broken)
    result = self_check.check_sample(model, sample, budget=400)
    with pytest.raises(self_check.SelfCheckError, match=r"step 7: the tree result differs .* loss relative error"):
        self_check.verdict(result, 7, torch.float32)
