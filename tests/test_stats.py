"""ds-tree stats on a hand-made tree with known numbers, on datasets (whole and damaged), and its plot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_tree.cli.stats import main as stats_main
from ds_tree.data.jsonl import write_jsonl
from ds_tree.data.synthetic import SyntheticConfig, generate
from ds_tree.data.tree_dataset import META_FILE, save_tree_dataset

ROOT = Path(__file__).resolve().parents[1]
DS_TREE = Path(sys.executable).parent / "ds-tree"
"""The console script, installed beside the interpreter (tools/bootstrap.sh)."""

# Group "a" is the trie  [5 6] -> {[7] -> {[8], [9]}, [10]}: 3 paths of 3, 3 and 2 nodes, two
# internal nodes with 2 children each; 11 flat tokens, 6 tree tokens. Group "b" is one path.
LINES = [
    {"group_id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},
    {"group_id": "a", "input_ids": [5, 6, 7, 9], "loss_mask": [0, 1, 1, 1]},
    {"group_id": "a", "input_ids": [5, 6, 10], "loss_mask": [0, 1, 1]},
    {"group_id": "b", "input_ids": [5, 11], "loss_mask": [0, 1]},
]


@pytest.fixture
def tokens_file(tmp_path):
    return write_jsonl(tmp_path / "tokens.jsonl", LINES)


def stats_of(path, capsys, *options):
    assert stats_main([str(path), "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def test_known_tree(tokens_file, capsys):
    stats = stats_of(tokens_file, capsys)
    assert (stats["n_groups"], stats["n_trees"], stats["n_trajectories"]) == (2, 2, 4)
    assert (stats["flat_tokens"], stats["tree_tokens"]) == (13, 8)
    assert stats["por"] == pytest.approx(1 - 8 / 13)
    assert stats["ideal_speedup"] == pytest.approx(13 / 8)
    assert (stats["depth"]["min"], stats["depth"]["max"]) == (1, 3)
    assert stats["depth"]["mean"] == pytest.approx((3 + 3 + 2 + 1) / 4)
    assert stats["branching"] == {"mean": 2.0, "max": 2}
    assert (stats["tree_speedup"]["min"], stats["tree_speedup"]["max"]) == (1.0, pytest.approx(11 / 6))


def test_text_output_and_plot(tokens_file, tmp_path, capsys):
    plot = tmp_path / "stats.png"
    assert stats_main([str(tokens_file), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "POR 0.3846  ideal speedup 1.62x" in text
    assert "branching (children per internal node): mean 2.00  max 2" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dataset_directory_gives_the_same_numbers(tmp_path, capsys):
    trajectories = list(generate(SyntheticConfig(groups=5, por=0.6, max_tokens=128)))
    records = [{"group_id": t.group_id, "input_ids": t.input_ids.tolist(), "loss_mask": t.loss_mask.tolist()}
               for t in trajectories]  # fmt: skip
    tokens = write_jsonl(tmp_path / "synthetic.jsonl", records)
    save_tree_dataset(trajectories, tmp_path / "dataset", {})
    from_file, from_dataset = stats_of(tokens, capsys), stats_of(tmp_path / "dataset", capsys)
    assert from_file == from_dataset
    assert from_file["n_groups"] == 5 and from_file["por"] == pytest.approx(0.6, abs=0.05)


def test_no_branching_and_errors(tmp_path, capsys):
    path = write_jsonl(tmp_path / "flat.jsonl", [{"group_id": "x", "input_ids": [5, 6], "loss_mask": [0, 1]}])
    assert stats_of(path, capsys)["branching"] is None
    assert stats_main([str(tmp_path / "absent.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def _damage_arrow(dataset):
    (arrow,) = dataset.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])


def _damage_meta(dataset):
    meta = dataset / META_FILE
    meta.write_text(meta.read_text()[:20])


@pytest.mark.parametrize("damage", [_damage_arrow, _damage_meta])
def test_a_damaged_dataset_is_one_error_line_naming_it(tokens_file, tmp_path, capsys, damage):
    from ds_tree.data import load_trajectories

    dataset = tmp_path / "dataset"
    save_tree_dataset(load_trajectories(tokens_file), dataset, {})
    stats_of(dataset, capsys)  # whole, it reads
    damage(dataset)
    assert stats_main([str(dataset)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"error: {dataset}")
    assert "damaged" in captured.err and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [[sys.executable, "tools/stats.py"], [str(DS_TREE), "stats"]])
def test_cli_runs_as_a_script_and_as_the_console_command(tokens_file, command):
    done = subprocess.run([*command, str(tokens_file), "--json"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout)["tree_tokens"] == 8
