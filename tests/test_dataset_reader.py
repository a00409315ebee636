"""A converted dataset read lazily (ds_tree/data/dataset_reader.py): the rows of chosen groups equal the eager
loader's, sizes come from the offsets, the step planner reads through it, and a rank's anonymous memory after
opening a dataset and reading a step does not grow with the dataset; the step sampler draws each epoch's
shuffle once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_tree.data import load_trajectories
from ds_tree.data import tree_dataset as tree_dataset_module
from ds_tree.data.dataset_reader import DatasetGroups, TreeDatasetReader
from ds_tree.data.sampler import StepSampler
from ds_tree.data.synthetic import SyntheticConfig, generate
from ds_tree.data.tree_dataset import META_FILE, save_tree_dataset
from ds_tree.errors import DataError
from ds_tree.packing.distributed import GroupUnits, simulate_ranks
from ds_tree.packing.plan import PlanSettings, plan_step
from ds_tree.trees.token_arrays import TOKEN_FIELDS
from ds_tree.trees.trajectory import Trajectory, group_trajectories

ROOT = Path(__file__).resolve().parents[1]


def rollout_trajectories() -> list[Trajectory]:
    """Groups with integer and string ids, rewards, trials, log-probs (NaN: not sampled) and advantages."""
    rng = np.random.default_rng(0)
    out = []
    for group in range(23):
        for trial in range(int(rng.integers(1, 5))):
            n = int(rng.integers(2, 40))
            extra = {}
            if trial % 2:
                extra["logprobs"] = np.where(rng.random(n) < 0.3, np.nan, -rng.random(n))
            if trial % 3 == 1:
                extra["advantages"] = rng.normal(size=n)
            group_id = group if group % 3 == 0 else f"g{group}"
            reward = None if trial == 2 else float(trial)
            ids = np.concatenate([[group], rng.integers(0, 1000, n - 1)])  # a shared first token per group
            mask = rng.choice([0.0, 1.0, 0.25], n)
            out.append(Trajectory(ids, mask, group_id=group_id, reward=reward, trial=trial, **extra))
    return out


def assert_same(got: list[Trajectory], expected: list[Trajectory]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert (a.group_id, a.reward, a.trial, a.source) == (b.group_id, b.reward, b.trial, b.source)
        for name in ("input_ids", "loss_mask", "logprobs", "advantages"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or np.array_equal(x, y, equal_nan=True), name


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Written in record batches of 5 groups, then saved again as 3 Arrow files: the table has several chunks."""
    import shutil

    import datasets

    written = tmp_path_factory.mktemp("lazy") / "written"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tree_dataset_module, "WRITE_BATCH_GROUPS", 5)
        save_tree_dataset(rollout_trajectories(), written, {})
    path = written.parent / "dataset"
    datasets.load_from_disk(str(written)).save_to_disk(str(path), num_shards=3)
    shutil.copy(written / META_FILE, path / META_FILE)
    return path


def test_the_rows_of_chosen_groups_are_the_eager_loaders(dataset):
    eager = group_trajectories(load_trajectories(dataset))
    reader = TreeDatasetReader(dataset)
    assert reader.n_groups == len(eager) == 23
    assert reader.table.column("input_ids").num_chunks > 1
    chosen = [22, 0, 7, 7, 13, 4]
    for rows, group in zip(chosen, reader.groups(chosen), strict=True):
        assert_same(group, eager[rows])
    sizes = reader.flat_tokens(range(reader.n_groups))
    assert sizes.tolist() == [sum(len(t) for t in group) for group in eager]
    assert reader.nbytes([3]) < reader.nbytes(range(23)) / 5
    with pytest.raises(DataError, match="no group 23 .the dataset holds 23"):
        reader.groups([23])


@pytest.mark.parametrize("drawn", ["sampled", "a group twice"])
def test_a_step_planned_from_the_reader_is_the_whole_step_plan(dataset, drawn):
    """The step planner reading each rank's groups lazily makes, for every rank, the items ``plan_step`` makes
    of the step's trajectories as the trainer lists them, also when a step (spanning two epochs) draws a group
    twice: one trie of both copies, as ``plan_step`` builds."""
    eager = group_trajectories(load_trajectories(dataset))
    reader = TreeDatasetReader(dataset)
    if drawn == "sampled":
        rows = StepSampler(reader.n_groups, 16, seed=1).groups_for_step(2)
    else:
        rows = [3, 9, 3, 0, 9, 12]
    trajectories = [t for row in rows for t in eager[row]]  # StepSampler.trajectories_for_step
    for settings in (PlanSettings(budget=48, over_budget="dfs", block=8), PlanSettings(budget=40)):
        lazy = simulate_ranks(DatasetGroups(reader, rows), settings, 4)
        expected = plan_step(trajectories, settings, 4)
        for rank, plan in enumerate(lazy):
            reference = expected.for_rank(rank)
            assert [row.kind for row in plan.rows] == [row.kind for row in reference.rows]
            for x, y in zip(plan.rows, reference.rows, strict=True):
                assert all(np.array_equal(getattr(x, name), getattr(y, name)) for name in TOKEN_FIELDS)
            counts = (plan.flat_tokens, plan.tree_tokens, plan.packed_tokens)
            assert counts == (reference.flat_tokens, reference.tree_tokens, reference.packed_tokens)
        in_memory = simulate_ranks(GroupUnits.of_step(trajectories), settings, 4)
        assert [len(p.rows) for p in in_memory] == [len(p.rows) for p in lazy]


def test_a_damaged_count_is_refused_at_open(dataset, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    meta = json.loads((copy / META_FILE).read_text())
    meta["counts"]["trajectories"] += 1
    (copy / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(DataError, match="its meta file says"):
        TreeDatasetReader(copy)


MEASURE = """
import json, sys
from ds_tree.data.dataset_reader import TreeDatasetReader
from ds_tree.data import load_trajectories

def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:"))

path, mode = sys.argv[1], sys.argv[2]
before = anon()
if mode == "lazy":
    reader = TreeDatasetReader(path)
    groups = reader.groups(range(0, reader.n_groups, max(1, reader.n_groups // 8))[:8])  # a step's groups
else:
    groups = load_trajectories(path)
print(json.dumps({"kib": anon() - before}))
"""


def _anonymous_growth(path: Path, mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), mode], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["kib"]


def test_a_ranks_memory_does_not_grow_with_the_dataset(tmp_path):
    """Open a dataset and read a step's 8 groups: the anonymous memory added is the same for a dataset 10x
    larger (eager loading of the larger one adds tens of MiB, which this measurement sees)."""
    paths = {}
    for name, groups in (("small", 12), ("large", 120)):
        config = SyntheticConfig(groups=groups, por=0.5, max_tokens=2048, seed=0)
        paths[name] = tmp_path / name
        save_tree_dataset(list(generate(config)), paths[name], {})
    small, large = _anonymous_growth(paths["small"], "lazy"), _anonymous_growth(paths["large"], "lazy")
    eager = _anonymous_growth(paths["large"], "eager")
    assert eager > 20 * 1024, eager  # ~1.5M tokens held as trajectories
    assert large - small < 4 * 1024, (small, large)


def test_the_sampler_draws_what_the_per_group_definition_draws():
    def reference(sampler: StepSampler, step: int) -> list[int]:
        first = step * sampler.groups_per_step
        picked = []
        for position in range(first, first + sampler.groups_per_step):  # one shuffle per position, as before
            epoch, offset = divmod(position, sampler.n_groups)
            picked.append(int(np.random.default_rng([sampler.seed, epoch]).permutation(sampler.n_groups)[offset]))
        return picked

    for n_groups, per_step in ((7, 3), (5, 12), (100, 8), (1, 4)):
        sampler = StepSampler(n_groups, per_step, seed=3)
        for step in range(6):
            assert sampler.groups_for_step(step) == reference(sampler, step)


def test_the_trainer_reads_a_converted_dataset_lazily_and_checks_it_from_its_columns(dataset, tmp_path):
    """``prepare`` holds the reader, not the trajectories; its checks read the mapped columns (the largest id, the
    longest trajectory) and name the trajectory at fault as the eager loader's checks do; in-memory groups (tokens
    JSONL) read through the same interface."""
    from ds_tree.config import ConfigError
    from ds_tree.data.dataset_reader import LoadedGroups
    from tests.helpers.configs import write_config
    from tests.helpers.runs import prepare

    reader = TreeDatasetReader(dataset)
    eager = group_trajectories(load_trajectories(dataset))
    assert reader.max_token_id() == max(int(t.input_ids.max()) for group in eager for t in group)
    longest = max((t for group in eager for t in group), key=len)
    tokens, row = reader.longest_trajectory()
    assert tokens == len(longest) and any(t is longest for t in eager[row])
    config = write_config(tmp_path, dataset, packing={"budget": 64})  # 4 groups a step
    trainer = prepare(config)
    assert isinstance(trainer.groups, TreeDatasetReader) and trainer.trajectories == []
    assert trainer.sampler.n_groups == 23
    too_long = rf"packing.budget \(30\) is below the longest trajectory \({tokens} tokens, {dataset}:row {row}:"
    with pytest.raises(ConfigError, match=too_long):
        prepare(config, "packing.budget=30")
    with pytest.raises(DataError, match=r":row \d+:trajectory \d+: token id \d+ is >= the model's vocab size 512"):
        prepare(config, "packing.budget=64", f"model.source={tiny_vocab(tmp_path)}")
    loaded = LoadedGroups(eager)
    assert loaded.flat_tokens([4, 1]).tolist() == reader.flat_tokens([4, 1]).tolist()
    assert_same([t for g in loaded.groups([5, 5]) for t in g], [t for g in reader.groups([5, 5]) for t in g])


def tiny_vocab(tmp_path: Path) -> Path:
    """The tiny Llama with a vocabulary of 512 (the dataset's ids go up to 999)."""
    config = json.loads((ROOT / "configs/models/tiny_llama.json").read_text())
    path = tmp_path / "small_vocab.json"
    path.write_text(json.dumps({**config, "vocab_size": 512}))
    return path
