"""Input rules every reader applies the same way (issue 25's reliability probe): loss masks are
non-negative, group ids are required strings or integers kept apart from strings, and bytes that
are not UTF-8 are a ``file:line`` error, exit 2, in ``stats``, ``verify`` and ``convert`` alike."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from ds_tree.cli import stats, verify
from ds_tree.cli.convert import main as convert_main
from ds_tree.data import load_trajectories
from ds_tree.data.explicit import trajectories_from_explicit_tree
from ds_tree.errors import DataError
from ds_tree.trees.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "configs/models/tiny_llama.json")
GOOD = {"group_id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}


def write_lines(path: Path, lines: list) -> Path:
    """Objects as JSON, ``bytes`` as they are (to write bytes that are not UTF-8)."""
    data = b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def error_of(capsys, main, argv: list[str]) -> str:
    """Run a command's ``main``; expect exit 2, one ``error:`` line and no traceback."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, (code, captured.out[-500:], captured.err[-1500:])
    assert captured.err.startswith("error: ") and "Traceback" not in captured.err, captured.err
    return captured.err.strip()


def convert_argv(tokenizer_dir, source: Path, output: Path, form: str = "tokens") -> list[str]:
    return ["--input", str(source), "--output", str(output), "--tokenizer", str(tokenizer_dir), "--format", form]


# ----------------------------------------------------------------- loss_mask >= 0
NEGATIVE = {**GOOD, "loss_mask": [0, 1, -1, 1]}
NEGATIVE_TEXT = "loss_mask has -1.0 at token 2; a loss coefficient is >= 0"


def test_negative_loss_mask_is_refused_by_every_reader(tmp_path, tokenizer_dir, capsys):
    path = write_lines(tmp_path / "data.jsonl", [GOOD, NEGATIVE])
    expected = f"error: {path}:2: {NEGATIVE_TEXT}"
    assert error_of(capsys, stats.main, [str(path)]) == expected
    assert error_of(capsys, verify.main, ["--data", str(path), "--model", MODEL]) == expected
    assert error_of(capsys, convert_main, convert_argv(tokenizer_dir, path, tmp_path / "out")) == expected
    assert not (tmp_path / "out").exists()
    node = {"id": 0, "parent": None, "input_ids": [5, 6, 7], "loss_mask": [0, -0.5, 1]}
    with pytest.raises(DataError, match=r"^t\.jsonl:1:leaf 0: loss_mask has -0\.5 at token 1"):
        trajectories_from_explicit_tree({"group_id": "g", "nodes": [node]}, "t.jsonl:1")
    with pytest.raises(DataError, match="a loss coefficient is >= 0"):
        Trajectory([5, 6], [0.0, -1e-300], source="x:1")
    (zero,) = [Trajectory([5, 6], [0.0, -0.0], source="x:1")]  # -0.0 is not negative
    assert zero.trained_tokens == 0


@pytest.mark.parametrize(
    "record, text",
    [  # issue 42 #12: 1e308 ran to exit 0 with loss 0; #13: labels were silently ignored
        (
            {**GOOD, "loss_mask": [0, 1, 1e308, 1]},
            "loss_mask has 1e+308 at token 2; a loss coefficient is at most 1e+30",
        ),
        ({**GOOD, "labels": [-100, 6, 7, 8]}, "both 'loss_mask' and 'labels': give one of them"),
    ],
    ids=["overflowing", "ambiguous"],
)
def test_overflowing_or_ambiguous_loss_masks_are_refused_with_file_and_line(record, text, tmp_path, capsys):
    path = write_lines(tmp_path / "data.jsonl", [GOOD, record])
    expected = f"error: {path}:2: {text}"
    assert error_of(capsys, stats.main, [str(path)]).startswith(expected)
    assert error_of(capsys, verify.main, ["--data", str(path), "--model", MODEL]).startswith(expected)


# ----------------------------------------------------------------- group ids
def test_integer_and_string_group_ids_are_different_groups(tmp_path, tokenizer_dir, capsys):
    records = [
        {**GOOD, "group_id": 1},
        {**GOOD, "group_id": "1", "input_ids": [5, 6, 7, 9]},
        {**GOOD, "group_id": 1, "input_ids": [5, 6, 9, 9]},
        {**GOOD, "group_id": "b"},
    ]
    path = write_lines(tmp_path / "data.jsonl", records)
    assert stats.main([str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_groups"] == 3
    assert [t.group_id for t in load_trajectories(path)] == [1, "1", 1, "b"]
    assert convert_main(convert_argv(tokenizer_dir, path, tmp_path / "out")) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["groups"] == 3
    loaded = load_trajectories(tmp_path / "out")  # the converted dataset keeps them apart too
    assert sorted((str(t.group_id), type(t.group_id).__name__, t.input_ids.tolist()) for t in loaded) == sorted(
        (str(r["group_id"]), type(r["group_id"]).__name__, r["input_ids"]) for r in records
    )


def test_a_missing_group_id_is_the_same_error_everywhere(tmp_path, tokenizer_dir, capsys):
    missing = {key: value for key, value in GOOD.items() if key != "group_id"}
    path = write_lines(tmp_path / "data.jsonl", [GOOD, missing])
    expected = f"error: {path}:2: missing field 'group_id' (a string or an integer)"
    assert error_of(capsys, stats.main, [str(path)]) == expected
    assert error_of(capsys, verify.main, ["--data", str(path), "--model", MODEL]) == expected
    assert error_of(capsys, convert_main, convert_argv(tokenizer_dir, path, tmp_path / "out")) == expected
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    chat_path = write_lines(tmp_path / "chat.jsonl", [chat])
    message = error_of(capsys, convert_main, convert_argv(tokenizer_dir, chat_path, tmp_path / "out", "chat"))
    assert message == f"error: {chat_path}:1: missing field 'group_id' (a string or an integer)"
    wrong = write_lines(tmp_path / "wrong.jsonl", [{**GOOD, "group_id": 1.5}])
    assert error_of(capsys, stats.main, [str(wrong)]) == (
        f"error: {wrong}:1: field 'group_id' must be a string or an integer"
    )


# ----------------------------------------------------------------- bytes that are not UTF-8
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_bytes_that_are_not_utf8_name_the_line(suffix, tmp_path, tokenizer_dir, capsys):
    bad = b'{"group_id": "caf\xe9", "input_ids": [5, 6], "loss_mask": [0, 1]}'
    path = write_lines(tmp_path / f"data{suffix}", [GOOD, bad])
    expected = f"error: {path}:2: not UTF-8 text (byte 0xe9 at byte 18)"
    assert error_of(capsys, stats.main, [str(path)]) == expected
    assert error_of(capsys, verify.main, ["--data", str(path), "--model", MODEL]) == expected
    assert error_of(capsys, convert_main, convert_argv(tokenizer_dir, path, tmp_path / "out")) == expected
    # --skip-bad counts it like any other bad line
    argv = [*convert_argv(tokenizer_dir, path, tmp_path / "out"), "--skip-bad"]
    assert convert_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == {"not_utf8": 1}
    np.testing.assert_array_equal(load_trajectories(tmp_path / "out")[0].input_ids, GOOD["input_ids"])


# ----------------------------------------------------------------- rewards overflowing float64
def rewarded(rewards: list[float]) -> list[Trajectory]:
    return [Trajectory([5, 6, 7 + i], [0, 1, 1], group_id="g", reward=r) for i, r in enumerate(rewards)]


def test_non_finite_reward_and_advantage_statistics_are_found():
    from ds_tree.losses.advantages import check_finite_statistics, non_finite_statistics
    from ds_tree.registries import ESTIMATORS

    ordinary = rewarded([1.0, 0.0, 0.5])
    assert non_finite_statistics(ordinary, ESTIMATORS.get("grpo")(ordinary).values) is None
    huge = rewarded([1.5e308, 1.5e308, 0.0, 0.0])  # finite rewards, overflowing mean and spread
    values = ESTIMATORS.get("grpo")(huge).values
    problem = non_finite_statistics(huge, values)
    assert problem is not None and "the reward standard deviation" in problem and "4 trajectories" in problem
    opposite = rewarded([1e308, -1e308])
    with pytest.raises(DataError, match="not finite over 2 trajectories: .*the advantage"):
        check_finite_statistics(opposite, ESTIMATORS.get("rloo")(opposite).values)


def test_verify_refuses_rewards_overflowing_float64(tmp_path, capsys):
    records = [{**GOOD, "input_ids": [5, 6, 7, 8 + i], "reward": r} for i, r in enumerate([1e308, -1e308])]
    path = write_lines(tmp_path / "data.jsonl", records)
    message = error_of(capsys, verify.main, ["--data", str(path), "--model", MODEL, "--objective", "grpo"])
    assert message.startswith("error: not finite over 2 trajectories: ") and "NaN" not in message


def test_training_refuses_rewards_overflowing_float64_at_config_time(tmp_path, monkeypatch, capsys):
    from tests.helpers.configs import write_config
    from tests.helpers.runs import dry_run

    records = [{**GOOD, "group_id": f"g{i // 2}", "input_ids": [5, 6, 7, 8 + i], "reward": r} for i, r in
               enumerate([1.5e308, 0.0, 1.0, 0.0])]  # fmt: skip
    config = write_config(tmp_path, write_lines(tmp_path / "data.jsonl", records))
    code, err = dry_run(monkeypatch, capsys, config, "objective.kind=grpo", "data.groups_per_step=2")
    assert code == 2 and "data.path: not finite over 4 trajectories: the reward standard deviation" in err, err


def test_json_output_has_no_nan_or_infinity(tmp_path):
    from ds_tree.data.jsonl import json_text
    from ds_tree.run.metrics import MetricsLogger

    assert json_text({"a": [float("nan"), np.float64("inf"), 1.5], "b": (float("-inf"),)}) == (
        '{"a": [null, null, 1.5], "b": [null]}'
    )
    metrics = MetricsLogger(tmp_path, enabled=True, resume_step=0)
    metrics.log(1, {"loss/train": float("nan"), "rl/reward_std": float("inf"), "optim/lr": 1e-3})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert line == '{"step": 1, "loss/train": null, "rl/reward_std": null, "optim/lr": 0.001}\n'


def huge_reward(request) -> float:
    """A reward function whose rewards are finite but whose mean overflows float64."""
    return 1.5e308


@pytest.mark.distributed
def test_online_rewards_overflowing_float64_skip_the_step(tmp_path, tokenizer_dir):
    """All four leaves of a group rewarded 1.5e308: the advantages are exactly 0 and the loss 0, so
    the run trained nothing with exit 0 and an infinite reward_std; now the step is non-finite and,
    with ``optimizer.non_finite=skip``, discarded (``stop`` raises the same message, as for a loss)."""
    import subprocess
    import sys

    from tests.helpers.configs import online_config
    from tests.helpers.launch import environment

    reward = "tests.test_input_rules:huge_reward"
    config = online_config(tmp_path, tokenizer_dir, max_steps=1, rollout={"reward": reward})
    command = [sys.executable, "-m", "ds_tree.train", "--config", str(config), "optimizer.non_finite=skip"]
    run = subprocess.run(command, env=environment(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 1: not finite over 8 trajectories: the reward mean, the reward standard deviation" in run.stderr
    assert "its update is discarded (optimizer.non_finite=skip; 1 step(s) skipped)" in run.stderr
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (record,) = [json.loads(line) for line in text.splitlines()]
    assert (record["step"], record["loss/train"], record["optim/skipped_steps"]) == (1, None, 1.0)
