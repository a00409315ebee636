"""Real trajectories from ../shared/data: convert, rebuild the trees, check every path and the POR.

Measured with the project tokenizer (its chat template renders no tool-call ids):
- tau2-telecom, all 5 groups x 4 trials: 269,704 flat / 68,121 tree tokens, POR 0.747, ideal
  speedup 3.96 (4 near-identical temperature-0 trials: at most 4.0; README char-level: about 4.0).
- tot-game24, first 3 groups x 100 answers: 174,022 / 8,962 tokens, POR 0.949, speedup 19.4
  (per group 16.4-23.5); char-level on the same renderings 17.7. Over all 100 groups (not run
  here, a minute): token-level 22.4; char-level on these renderings 20.8 (22.1 as a mean of
  per-group ratios). The README's "about 18.5" is below both, so it likely measured another
  rendering; the test compares against char-level on the renderings it checks.
"""

import json
import os
from collections import defaultdict

import numpy as np
import pytest
from transformers import AutoTokenizer

from ds_tree.cli.convert import main as convert_main
from ds_tree.data import load_trajectories
from ds_tree.data.chat import render_chat
from ds_tree.trees import build_forest
from ds_tree.trees.stats import token_counts
from tests.helpers.shared_data import SHARED_DATA, absent

SHARED = SHARED_DATA

CASES = {
    # name: (file, --limit, groups, trials, token-level ideal speedup bounds)
    "tau2-telecom": ("tau2-telecom/trials.jsonl", None, 5, 20, (3.6, 4.0)),
    "tot-game24": ("tot-game24/samples.jsonl", 300, 3, 300, (16.0, 23.0)),
}


def char_level_speedup(texts_by_group):
    """Sum of lengths / merged character-trie size, summed over groups (the README's measure)."""
    flat = tree = 0
    for texts in texts_by_group.values():
        texts = sorted(texts)
        shared = sum(len(os.path.commonprefix([a, b])) for a, b in zip(texts, texts[1:], strict=False))
        flat += sum(map(len, texts))
        tree += sum(map(len, texts)) - shared
    return flat / tree


@pytest.mark.parametrize("name", sorted(CASES))
def test_convert_rebuild_and_por(name, tmp_path, tokenizer_dir, capsys):
    relative, limit, n_groups, n_trajectories, (low, high) = CASES[name]
    source = SHARED / relative
    if not source.is_file():
        pytest.skip(absent(source))
    options = [] if limit is None else ["--limit", str(limit)]
    argv = ["--input", str(source), "--output", str(tmp_path / "out"), "--tokenizer", str(tokenizer_dir), *options]
    assert convert_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped"] == {} and summary["prefix_unstable_kept"] == 0

    records = {}
    with source.open() as handle:
        for _, line in zip(range(limit or 10**9), handle, strict=False):
            record = json.loads(line)
            records[record["group_id"], record["trial"]] = record
    assert len(records) == n_trajectories  # (group, trial) names each line uniquely

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    trees = build_forest(load_trajectories(tmp_path / "out"), merge="group")
    assert len(trees) == n_groups
    texts = defaultdict(list)
    for tree in trees:
        for trajectory, path in zip(tree.trajectories, tree.paths, strict=True):
            record = records[trajectory.group_id, trajectory.trial]
            rendered = render_chat(tokenizer, record["messages"], record.get("tools"))
            assert tree.input_ids[path].tolist() == rendered.input_ids.tolist(), trajectory.source
            assert np.array_equal(trajectory.loss_mask, rendered.loss_mask), trajectory.source
            assert trajectory.reward == record["reward"]
            texts[trajectory.group_id].append(tokenizer.apply_chat_template(record["messages"], tokenize=False))

    speedup = token_counts(trees).ideal_speedup
    print(f"{name}: token-level POR {1 - 1 / speedup:.4f}, ideal speedup {speedup:.2f}")
    assert summary["por"] == pytest.approx(1 - 1 / speedup)
    assert low <= speedup <= high
    # Consistent with the character-level dedup of the same renderings (differs "slightly").
    assert 0.8 <= speedup / char_level_speedup(texts) <= 1.25


def test_get_shared_data_converts_the_upstream_shapes(tmp_path):
    """tools/get_shared_data.py on tiny files in the upstream shapes (no network: --source): the
    chat-JSONL lines the tests read, tool calls in OpenAI form with sorted JSON arguments, LICENSEs
    beside them. (On the real upstream files its output equals ../shared/data byte for byte.)"""
    from tools import get_shared_data as tool

    tau2, game24 = tmp_path / tool.TAU2["repo"], tmp_path / tool.GAME24["repo"]
    call = {"id": "c1", "name": "get_line", "arguments": {"z": 1, "a": "L1"}, "requestor": "assistant"}
    results = {
        "info": {"environment_info": {"policy": "POLICY"}},
        "tasks": [{"id": "task-1", "ticket": "my phone has no data"}],
        "simulations": [
            {"task_id": "task-1", "trial": trial, "reward_info": {"reward": float(trial)}, "messages": [
                {"role": "assistant", "content": None, "tool_calls": [call], "turn_idx": 0},
                {"role": "tool", "id": "c1", "content": "{}", "requestor": "assistant", "turn_idx": 1},
                {"role": "assistant", "content": f"done {trial}", "tool_calls": None, "turn_idx": 2},
            ]}
            for trial in (0, 1)
        ],
    }  # fmt: skip
    prompts = 'standard_prompt = "x"\ncot_prompt = """Solve: {input}\n"""\n'
    log = [{"idx": 1, "ys": ["Answer: 4 * 6 = 24", "Answer: None"], "infos": [{"r": 1}, {"r": 0}]}]
    files = {
        tau2 / tool.TAU2["results"]: json.dumps(results),
        tau2 / "LICENSE": "MIT tau2",
        game24 / tool.GAME24["log"]: json.dumps(log),
        game24 / tool.GAME24["puzzles"]: "Rank,Puzzles\n1,1 1 4 6\n2,1 4 6 9\n",
        game24 / tool.GAME24["prompts"]: prompts,
        game24 / "LICENSE": "MIT tot",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    out = tmp_path / "out"
    assert tool.main(["--source", str(tmp_path), "--output", str(out)]) == 0

    lines = [json.loads(line) for line in (out / "tau2-telecom/trials.jsonl").read_text().splitlines()]
    assert [(r["group_id"], r["trial"], r["reward"]) for r in lines] == [("task-1", 0, 0.0), ("task-1", 1, 1.0)]
    assert lines[1]["messages"] == [
        {"role": "system", "content": "POLICY"},
        {"role": "user", "content": "my phone has no data"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_line", "arguments": '{"a": "L1", "z": 1}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "{}"},
        {"role": "assistant", "content": "done 1"},
    ]  # fmt: skip
    lines = [json.loads(line) for line in (out / "tot-game24/samples.jsonl").read_text().splitlines()]
    assert lines == [
        {"group_id": "game24-1", "trial": k, "reward": reward, "messages": [
            {"role": "user", "content": "Solve: 1 4 6 9\n"}, {"role": "assistant", "content": answer}
        ]}
        for k, (answer, reward) in enumerate([("Answer: 4 * 6 = 24", 1.0), ("Answer: None", 0.0)])
    ]  # fmt: skip
    assert (out / "tot-game24/LICENSE").read_text() == "MIT tot" and not list(out.rglob("*.partial"))
    assert tool.main(["--source", str(tmp_path / "missing"), "--output", str(out)]) == 2


def test_get_shared_data_names_the_file_and_line_of_a_malformed_source(tmp_path, capsys):
    """Issue 42 #29: a malformed upstream file was reported as a bare JSON error; it names the file and line."""
    from tools import get_shared_data as tool

    results = tmp_path / tool.TAU2["repo"] / tool.TAU2["results"]
    results.parent.mkdir(parents=True)
    results.write_text('{\n  "info": {},\n  "tasks": [,]\n}\n')
    argv = ["--source", str(tmp_path), "--output", str(tmp_path / "out"), "--only", "tau2-telecom"]
    assert tool.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {results}:3: malformed JSON (Expecting value at column 13)"), err
    results.write_bytes(b'{"info": "\xff"}')
    assert tool.main(argv) == 2
    assert capsys.readouterr().err.startswith(f"error: {results}: not UTF-8 text (byte 0xff at byte 11)")
    assert not (tmp_path / "out").exists()
