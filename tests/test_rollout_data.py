"""RL rollout fields (the sampler's per-token ``logprobs``, given ``advantages``) through the data path:
tokens JSONL -> Trajectory -> tree dataset -> Trajectory bit for bit, version-1 datasets, the
converter's formats, slicing, and every bad-input case named by file:line and field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ds_tree.cli.convert import main as convert_main
from ds_tree.data import load_trajectories
from ds_tree.data.jsonl import slice_groups
from ds_tree.data.tokens import read_tokens_jsonl
from ds_tree.data.tree_dataset import META_FILE, dataset_counts, load_tree_dataset, save_tree_dataset
from ds_tree.errors import DataError
from ds_tree.trees import Trajectory


def same_bits(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Both absent, or both float64 with identical bit patterns (NaN positions and -0.0 included)."""
    if a is None or b is None:
        return a is None and b is None
    return (
        a.dtype == b.dtype == np.float64 and a.shape == b.shape and np.array_equal(a.view(np.int64), b.view(np.int64))
    )


def rollout_records(rng: np.random.Generator) -> list[dict]:
    """Two groups sharing prompts; logprobs null on the prompt, awkward values (-0.0, the smallest
    subnormal, a positive round-off within tolerance, non-float32 values); some records without the fields."""
    records = []
    for group in ("p", "q"):
        prompt = rng.integers(3, 1000, size=int(rng.integers(3, 8))).tolist()
        for trial in range(4):
            answer = rng.integers(3, 1000, size=int(rng.integers(2, 9))).tolist()
            sampled = (-rng.exponential(2.0, size=len(answer))).tolist()
            sampled[0], sampled[-1] = -0.0, -5e-324
            if trial == 1:
                sampled[1] = 1e-7  # float32 rounding of a probability of 1
            record = {
                "group_id": group,
                "trial": trial,
                "input_ids": prompt + answer,
                "loss_mask": [0.0] * len(prompt) + [1.0] * len(answer),
                "reward": float(trial % 2),
                "logprobs": [None] * len(prompt) + sampled,
                "advantages": rng.normal(size=len(prompt) + len(answer)).tolist(),
            }
            records.append(record)
    del records[2]["logprobs"], records[2]["advantages"]
    records[3]["advantages"] = None  # null: the same as absent
    del records[5]["logprobs"]
    return records


def write_records(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def expected(record: dict, name: str) -> np.ndarray | None:
    values = record.get(name)
    return None if values is None else np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def assert_carries(trajectories: list[Trajectory], records: list[dict]) -> None:
    assert len(trajectories) == len(records)
    for trajectory, record in zip(trajectories, records, strict=True):
        assert trajectory.input_ids.tolist() == record["input_ids"]
        for name in ("logprobs", "advantages"):
            assert same_bits(getattr(trajectory, name), expected(record, name)), (trajectory.source, name)


def test_round_trip_tokens_jsonl_to_tree_dataset_is_bit_exact(tmp_path):
    records = rollout_records(np.random.default_rng(0))
    read = read_tokens_jsonl(write_records(tmp_path / "rollouts.jsonl", records))
    assert_carries(read, records)
    assert np.isnan(read[0].logprobs[: read[0].loss_mask.tolist().index(1.0)]).all()
    assert np.nanmax(read[1].logprobs) == 1e-7 and read[3].advantages is None and read[5].logprobs is None
    save_tree_dataset(read, tmp_path / "dataset", {})
    loaded = load_tree_dataset(tmp_path / "dataset")
    assert json.loads((tmp_path / "dataset" / META_FILE).read_text())["format_version"] == 2
    assert_carries(loaded, records)
    assert [t.group_id for t in loaded] == [r["group_id"] for r in records]


def test_converter_passes_them_through_tokens_and_tree_formats(tmp_path, tokenizer_dir, capsys):
    records = rollout_records(np.random.default_rng(1))
    source = write_records(tmp_path / "rollouts.jsonl", records)
    argv = ["--input", str(source), "--tokenizer", str(tokenizer_dir), "--format"]
    assert convert_main([*argv, "tokens", "--output", str(tmp_path / "tokens")]) == 0
    assert_carries(load_trajectories(tmp_path / "tokens"), records)

    tree = {
        "group_id": "t",
        "nodes": [
            {"id": "prompt", "parent": None, "input_ids": [5, 6, 7], "loss_mask": [0, 0, 0]},
            {"id": "a", "parent": "prompt", "input_ids": [8, 9], "logprobs": [-0.25, -0.0]},
            {"id": "b", "parent": "prompt", "input_ids": [10], "logprobs": [-3.5]},
        ],
    }
    trees = write_records(tmp_path / "trees.jsonl", [tree])
    assert convert_main(["--input", str(trees), "--tokenizer", str(tokenizer_dir), "--format", "tree",
                         "--output", str(tmp_path / "tree")]) == 0  # fmt: skip
    first, second = load_trajectories(tmp_path / "tree")
    nan = np.nan
    assert same_bits(first.logprobs, np.array([nan, nan, nan, -0.25, -0.0]))
    assert same_bits(second.logprobs, np.array([nan, nan, nan, -3.5]))
    assert first.advantages is None and second.advantages is None
    capsys.readouterr()


@pytest.mark.parametrize("name", ["logprobs", "advantages"])
def test_the_chat_format_rejects_them(name, tmp_path, tokenizer_dir, capsys):
    chat = {"group_id": "g", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    null = write_records(tmp_path / "null.jsonl", [chat, {**chat, name: None}])  # null: the same as absent
    assert (
        convert_main(["--input", str(null), "--output", str(tmp_path / "null"), "--tokenizer", str(tokenizer_dir)]) == 0
    )
    capsys.readouterr()
    source = write_records(tmp_path / "chat.jsonl", [chat, {**chat, name: [-1.0]}])
    argv = ["--input", str(source), "--output", str(tmp_path / "out"), "--tokenizer", str(tokenizer_dir)]
    assert convert_main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {source}:2: field {name!r} is not allowed in a chat record"), error
    assert not (tmp_path / "out").exists()


def write_version_1(trajectories: list[Trajectory], directory: Path) -> None:
    """A dataset laid out as format version 1 wrote it (commit 5c7f40e): five columns, meta version 1."""
    from datasets import Dataset, Features, List, Value

    features = Features(
        {
            "group_id": Value("string"),
            "input_ids": List(List(Value("int32"))),
            "loss_mask": List(List(Value("float32"))),
            "reward": List(Value("float64")),
            "trial": List(Value("int64")),
        }
    )
    columns = {
        "group_id": ["g"],
        "input_ids": [[t.input_ids.astype(np.int32) for t in trajectories]],
        "loss_mask": [[t.loss_mask.astype(np.float32) for t in trajectories]],
        "reward": [[t.reward for t in trajectories]],
        "trial": [[t.trial for t in trajectories]],
    }
    Dataset.from_dict(columns, features=features).save_to_disk(str(directory))
    meta = {"format_version": 1, "loss_mask_dtype": "float32", "counts": dataset_counts(trajectories)}
    (directory / META_FILE).write_text(json.dumps(meta))


def test_a_version_1_dataset_still_loads(tmp_path):
    trajectories = [
        Trajectory([5, 6, 7], [0, 1, 1], group_id="g", reward=1.0, trial=0),
        Trajectory([5, 6, 8, 9], [0, 1, 0.5, 1], group_id="g", reward=0.0, trial=1),
    ]
    write_version_1(trajectories, tmp_path / "v1")
    loaded = load_tree_dataset(tmp_path / "v1")
    assert [t.input_ids.tolist() for t in loaded] == [[5, 6, 7], [5, 6, 8, 9]]
    assert [t.loss_mask.tolist() for t in loaded] == [[0, 1, 1], [0, 1, 0.5, 1]]
    assert [(t.reward, t.trial, t.logprobs, t.advantages) for t in loaded] == [
        (1.0, 0, None, None),
        (0.0, 1, None, None),
    ]
    # The same files claiming version 2 lack its columns.
    meta_path = tmp_path / "v1" / META_FILE
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "format_version": 2}))
    with pytest.raises(DataError, match="missing column\\(s\\) logprobs, advantages"):
        load_tree_dataset(tmp_path / "v1")


def test_slice_groups_keeps_the_fields(tmp_path):
    records = rollout_records(np.random.default_rng(2))
    for suffix in (".jsonl", ".jsonl.gz"):
        sliced = slice_groups(write_records(tmp_path / "all.jsonl", records), tmp_path / f"slice{suffix}", 2, 3)
        kept = [r for r in records if r["trial"] < 3]
        assert_carries(read_tokens_jsonl(sliced), kept)


GOOD = {"group_id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}
# line 3 of the file is the bad one: (record or raw line, pattern after "file:3: "); every pattern names the field
BAD_LINES = {
    "logprobs_length": ({**GOOD, "logprobs": [None, -1.0]}, r"logprobs has 2 entries but input_ids has 4"),
    "advantages_length": ({**GOOD, "advantages": [0.0] * 5}, r"advantages has 5 entries but input_ids has 4"),
    "logprob_positive": ({**GOOD, "logprobs": [None, -1.0, 0.01, -2.0]}, r"logprobs has 0\.01 at token 2; .*at most 0"),
    "logprob_just_beyond_roundoff": ({**GOOD, "logprobs": [None, 2e-6, -1, -1]}, r"logprobs has 2e-06 at token 1"),
    "logprob_nan_literal": (
        '{"group_id": "a", "input_ids": [5, 6], "loss_mask": [0, 1], "logprobs": [null, NaN]}',
        r"field 'logprobs' must be a list of finite numbers or null; it holds a non-finite value",
    ),
    "logprob_minus_infinity": (
        '{"group_id": "a", "input_ids": [5, 6], "loss_mask": [0, 1], "logprobs": [null, -Infinity]}',
        r"field 'logprobs' .*non-finite",
    ),
    "advantage_nan_literal": (
        '{"group_id": "a", "input_ids": [5, 6], "loss_mask": [0, 1], "advantages": [0, NaN]}',
        r"field 'advantages' must be a list of finite numbers; it holds a non-finite value",
    ),
    "advantage_overflow": ({**GOOD, "advantages": [0, 1, 10**400, 2]}, r"field 'advantages' .*non-finite"),
    "advantage_float_overflow": (
        '{"group_id": "a", "input_ids": [5], "loss_mask": [1], "advantages": [1e999]}',
        r"field 'advantages' .*non-finite",
    ),
    "advantage_null": ({**GOOD, "advantages": [0, None, 1, 1]}, r"field 'advantages' must be a list of finite numbers"),
    "logprobs_not_a_list": ({**GOOD, "logprobs": "-1 -1 -1 -1"}, r"field 'logprobs' must be a list"),
    "logprobs_bool": ({**GOOD, "logprobs": [None, True, -1, -1]}, r"field 'logprobs' must be a list of finite numbers"),
    "advantages_bool": ({**GOOD, "advantages": [0, False, 1, 1]}, r"field 'advantages' must be a list of finite"),
    "advantages_string": ({**GOOD, "advantages": ["0", 1, 1, 1]}, r"field 'advantages' must be a list of finite"),
    "advantages_object": ({**GOOD, "advantages": {"1": 0.5}}, r"field 'advantages' must be a list of finite"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_rollout_fields_name_file_line_and_field(case, tmp_path):
    line, pattern = BAD_LINES[case]
    path = write_records(tmp_path / "data.jsonl", [GOOD, "", line, GOOD])
    with pytest.raises(DataError) as raised:
        load_trajectories(path)
    assert re.match(re.escape(f"{path}:3: ") + pattern, str(raised.value)), str(raised.value)


def test_trajectory_checks():
    ids, mask = [5, 6, 7], [0, 1, 1]
    kept = Trajectory(ids, mask, logprobs=[np.nan, 1e-6, -0.0], advantages=[1, 2, 3], source="x:1")
    assert kept.logprobs.dtype == kept.advantages.dtype == np.float64 and kept.logprobs[1] == 1e-6
    assert Trajectory(ids, mask).logprobs is None and Trajectory(ids, mask).advantages is None
    for fields, pattern in [
        ({"logprobs": [np.nan, -1.0]}, r"x:1: logprobs has 2 entries but input_ids has 3"),
        ({"advantages": [[1.0, 2.0, 3.0]] * 2}, r"x:1: advantages has 6 entries but input_ids has 3"),
        ({"logprobs": [np.nan, -np.inf, -1.0]}, r"x:1: logprobs contains an infinite value"),
        ({"logprobs": [np.nan, np.inf, -1.0]}, r"x:1: logprobs contains an infinite value"),
        ({"logprobs": [np.nan, -1.0, 1.5e-6]}, r"x:1: logprobs has 1\.5e-06 at token 2"),
        ({"advantages": [0.0, np.nan, 1.0]}, r"x:1: advantages contains a non-finite value"),
        ({"advantages": [0.0, 1.0, -np.inf]}, r"x:1: advantages contains a non-finite value"),
    ]:
        with pytest.raises(DataError, match=pattern):
            Trajectory(ids, mask, source="x:1", **fields)
    with pytest.raises(DataError, match=r"group 'g7': advantages has 1 entries"):
        Trajectory(ids, mask, group_id="g7", advantages=[1.0])
