"""Bad input gives one clear error that says where: file:line and the field, exit code 2.

Errors are driven through ``ds-tree verify``'s ``main()`` (what a user runs), plus one
end-to-end subprocess run on a small generated tokens file in float64 and float32.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_tree.cli import verify
from ds_tree.data import load_trajectories
from ds_tree.errors import DataError
from ds_tree.trees.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/models/tiny_llama.json")
GOOD = {"group_id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}


def _write(tmp_path: Path, lines: list, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _verify_error(capsys, *args: str) -> str:
    """Run verify's main(), expect exit code 2 and return its stderr."""
    code = verify.main(list(args))
    captured = capsys.readouterr()
    assert code == 2, f"exit code {code}; stdout {captured.out[:300]!r} stderr {captured.err[:300]!r}"
    assert captured.out == ""
    assert captured.err.startswith("error: ")
    assert "Traceback" not in captured.err
    return captured.err


# line 3 of the file is the bad one: (record or raw line, pattern after "file:3: ")
BAD_LINES = {
    "malformed_json": ('{"input_ids": [5, 6,', r"malformed JSON"),
    "not_an_object": ("[5, 6, 7]", r"expected a JSON object, got list"),
    "empty_trajectory": ({"input_ids": [], "loss_mask": []}, r"empty trajectory"),
    "negative_id": ({"input_ids": [5, -3, 7], "loss_mask": [0, 1, 1]}, r"negative token id -3"),
    "id_not_int": ({"input_ids": [5, 6.5], "loss_mask": [0, 1]}, r"field 'input_ids' must be a list of integers"),
    "mask_length": ({"input_ids": [5, 6, 7], "loss_mask": [0, 1]}, r"loss_mask has 2 entries.*input_ids has 3"),
    "mask_not_numbers": ({"input_ids": [5, 6], "loss_mask": [0, "x"]}, r"field 'loss_mask' must be a list of numbers"),
    "no_mask": ({"input_ids": [5, 6]}, r"missing field 'loss_mask'"),
    "labels_length": ({"input_ids": [5, 6, 7], "labels": [-100, 6]}, r"'labels' has 2 entries.*'input_ids' has 3"),
    "labels_differ": ({"input_ids": [5, 6, 7], "labels": [-100, 6, 9]}, r"'labels' must equal 'input_ids'"),
    "id_beyond_int64": ({"input_ids": [5, 2**70], "loss_mask": [0, 1]}, r".*(input_ids|token id)"),
    "id_over_vocab": ({"input_ids": [5, 1024, 7], "loss_mask": [0, 1, 1]}, r"token id 1024 .*vocab size 1024"),
    "logprob_positive": ({**GOOD, "logprobs": [None, -1, 0.5, -1]}, r"logprobs has 0\.5 at token 2"),
    "advantages_length": ({**GOOD, "advantages": [0, 1]}, r"advantages has 2 entries but input_ids has 4"),
    "advantages_not_numbers": ({**GOOD, "advantages": [0, 1, None, 1]}, r"field 'advantages' must be a list"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_and_line(case, tmp_path, capsys):
    line, pattern = BAD_LINES[case]
    if isinstance(line, dict):
        line = {"group_id": "a", **line}
    path = _write(tmp_path, [GOOD, "", line, GOOD])  # a blank line 2 still counts as a line
    message = _verify_error(capsys, "--data", str(path), "--model", CONFIG)
    assert re.search(re.escape(f"{path}:3: ") + pattern, message), message


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--budget", "0"], r"argument --budget: must be >= 1, got 0"),
        (["--block", "0"], r"argument --block: must be >= 1, got 0"),
        (["--limit", "0"], r"argument --limit: must be >= 1, got 0"),
    ],
)
def test_bad_arguments(args, pattern, tmp_path, capsys):
    """Usage errors (exit 2) naming the option, before the data is read."""
    path = _write(tmp_path, [GOOD, GOOD])
    with pytest.raises(SystemExit) as exit_info:
        verify.main(["--data", str(path), "--model", CONFIG, *args])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert re.search(pattern, message) and "Traceback" not in message, message


def test_one_token_trajectory_verifies(tmp_path, capsys):
    """A 1-token trajectory (nothing to predict) is valid data: verify must pass, not crash."""
    one, two = {"input_ids": [5], "loss_mask": [1]}, {"input_ids": [5, 6], "loss_mask": [1, 1]}
    path = _write(tmp_path, [{"group_id": "a", **one}, {"group_id": "a", **two}])
    code = verify.main(["--data", str(path), "--model", CONFIG, "--budget", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["passed"] is True


def test_labels_become_the_loss_mask(tmp_path):
    path = _write(tmp_path, [{"group_id": "a", "input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}])
    (trajectory,) = load_trajectories(path)
    np.testing.assert_array_equal(trajectory.loss_mask, [0, 0, 1, 1])
    assert trajectory.source == f"{path}:1"


def test_trajectory_longer_than_budget_is_named(tmp_path, capsys):
    long = {"group_id": "a", "input_ids": list(range(5, 25)), "loss_mask": [1] * 20}
    path = _write(tmp_path, [GOOD, GOOD, long])
    message = _verify_error(capsys, "--data", str(path), "--model", CONFIG, "--budget", "10")
    assert re.search(re.escape(f"{path}:3: ") + r"trajectory of 20 tokens .*budget 10", message), message


def test_missing_data_file(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    message = _verify_error(capsys, "--data", str(missing), "--model", CONFIG)
    assert str(missing) in message and "no such file" in message


def test_missing_model_config(tmp_path, capsys):
    path = _write(tmp_path, [GOOD])
    missing = tmp_path / "no_model.json"
    message = _verify_error(capsys, "--data", str(path), "--model", str(missing))
    assert str(missing) in message


def test_empty_file(tmp_path, capsys):
    path = _write(tmp_path, ["", "  "])
    message = _verify_error(capsys, "--data", str(path), "--model", CONFIG)
    assert str(path) in message and "no trajectories" in message


def test_trajectory_checks_without_a_source():
    with pytest.raises(DataError, match=r"group 'g7'.*loss_mask has 1 entries"):
        Trajectory([5, 6], [1.0], group_id="g7")
    with pytest.raises(DataError, match="non-finite"):
        Trajectory([5, 6], [1.0, float("nan")], source="x:1")


def _generated_tokens_file(tmp_path: Path) -> tuple[Path, list[dict]]:
    """Two groups with shared prefixes, a duplicate, a strict prefix and fractional masks."""
    rng = np.random.default_rng(random.randrange(2**63))  # seeded per test by conftest.py
    records = []
    for group in ("p", "q"):
        prompt = rng.integers(3, 1024, size=int(rng.integers(5, 15))).tolist()
        for trial in range(4):
            suffix = rng.integers(3, 1024, size=int(rng.integers(1, 10))).tolist()
            ids = prompt + suffix
            mask = [0.0] * len(prompt) + rng.uniform(0, 1, size=len(suffix)).round(3).tolist()
            records.append({"group_id": group, "input_ids": ids, "loss_mask": mask, "trial": trial})
        records.append(dict(records[-1]))  # a duplicate
        records.append({"group_id": group, "input_ids": prompt[:3], "labels": [-100, prompt[1], prompt[2]]})
    return _write(tmp_path, records), records


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_verify_end_to_end(dtype, tmp_path):
    path, records = _generated_tokens_file(tmp_path)
    longest = max(len(r["input_ids"]) for r in records)
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools/verify.py"), "--data", str(path), "--model", CONFIG,
         "--dtype", dtype, "--budget", str(longest)],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    report = json.loads(result.stdout)
    keys = ("n_trajectories", "flat_tokens", "tree_tokens", "ideal_speedup", "loss_flat", "loss_tree",
            "max_rel_grad_err", "max_abs_logprob_err", "passed")  # fmt: skip
    assert set(keys) <= set(report)
    prefixes = {(r["group_id"], tuple(r["input_ids"][:n])) for r in records for n in range(1, len(r["input_ids"]) + 1)}
    assert report["n_trajectories"] == len(records)
    assert report["flat_tokens"] == sum(len(r["input_ids"]) for r in records)
    assert report["tree_tokens"] == len(prefixes)
    assert report["ideal_speedup"] == pytest.approx(report["flat_tokens"] / report["tree_tokens"])
    assert report["passed"] is True
    tolerance = 1e-10 if dtype == "float64" else 1e-5
    assert report["loss_tree"] == pytest.approx(report["loss_flat"], rel=tolerance)
    assert 0 <= report["max_rel_grad_err"] <= tolerance
    assert 0 <= report["max_abs_logprob_err"] <= tolerance
