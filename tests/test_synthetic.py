"""Synthetic tree data: POR on target, deterministic, well-formed ids and masks."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_tree.data.synthetic import IM_END, IM_START, ROLE, SyntheticConfig, generate
from ds_tree.data.tokens import read_tokens_jsonl
from ds_tree.trees import build_forest
from ds_tree.trees.stats import token_counts

ROOT = Path(__file__).resolve().parents[1]


def achieved_por(trajectories):
    return token_counts(trajectories, merge="group").por


@pytest.mark.parametrize("por", [0.0, 0.2, 0.5, 0.8, 0.95])
def test_por_near_target(por):
    trajectories = list(generate(SyntheticConfig(groups=32, por=por, seed=3)))
    assert abs(achieved_por(trajectories) - por) < 0.05


def test_trees_branch_and_nest():
    trees = build_forest(list(generate(SyntheticConfig(groups=16, por=0.5))), merge="group")
    assert len(trees) == 16
    assert np.mean([tree.node_depths().max() for tree in trees]) >= 3  # branches inside branches
    assert max(tree.num_children().max() for tree in trees) >= 2


def test_por_zero_means_no_sharing():
    config = SyntheticConfig(groups=4, por=0.0)
    trajectories = list(generate(config))
    assert len(trajectories) == 4 * config.trials_per_group
    assert len({t.group_id for t in trajectories}) == len(trajectories)


def test_deterministic_for_a_seed():
    def dump(seed):
        return [
            (t.group_id, t.input_ids.tolist(), t.loss_mask.tolist(), t.reward)
            for t in generate(SyntheticConfig(groups=4, seed=seed))
        ]

    assert dump(7) == dump(7)
    assert dump(7) != dump(8)


@pytest.mark.parametrize("vocab_size", [64, 1024])
def test_ids_and_masks_are_well_formed(vocab_size):
    config = SyntheticConfig(groups=8, por=0.6, vocab_size=vocab_size, max_tokens=200)
    for trajectory in generate(config):
        ids, mask = trajectory.input_ids, trajectory.loss_mask
        assert 0 <= ids.min() and ids.max() < vocab_size
        assert len(ids) <= 200
        assert ids[0] == IM_START and mask[0] == 0
        assert set(np.unique(mask)) <= {0.0, 1.0} and mask.sum() > 0
        # Trained tokens are assistant output: never a turn start, always inside an assistant turn.
        assert not np.any(mask[ids == IM_START])
        starts = np.flatnonzero(ids == IM_START)
        for start, end in zip(starts, [*starts[1:], len(ids)], strict=True):
            if ids[start + 1] != ROLE["assistant"]:
                assert not mask[start:end].any()
            else:
                assert not mask[start : start + 3].any()  # the header is the generation prompt
                turn_end = np.flatnonzero(ids[start:end] == IM_END)
                if turn_end.size:
                    assert mask[start + 3 : start + turn_end[0] + 1].all()


def test_config_validation():
    with pytest.raises(ValueError, match="por must be"):
        SyntheticConfig(por=0.99)
    with pytest.raises(ValueError, match="needs at least"):
        SyntheticConfig(por=0.9, trials=4)
    assert SyntheticConfig(por=0.9).trials_per_group >= 11


def test_cli_writes_what_generate_gives(tmp_path):
    output = tmp_path / "synthetic.jsonl.gz"
    done = subprocess.run(
        [
            sys.executable,
            "tools/make_synthetic.py",
            "--output",
            str(output),
            "--groups",
            "6",
            "--por",
            "0.7",
            "--seed",
            "2",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    summary = json.loads(done.stdout)
    written = read_tokens_jsonl(output)
    expected = list(generate(SyntheticConfig(groups=6, por=0.7, seed=2)))
    assert [t.input_ids.tolist() for t in written] == [t.input_ids.tolist() for t in expected]
    assert [t.loss_mask.tolist() for t in written] == [t.loss_mask.tolist() for t in expected]
    assert [(t.group_id, t.trial, t.reward) for t in written] == [(t.group_id, t.trial, t.reward) for t in expected]
    assert summary["por"] == pytest.approx(achieved_por(expected))
