"""The bench's multi-turn preference pairs with messages cut short (``tools/history_pairs.py
--max-message-chars``, ``ds_tree.bench.preference_pairs``): each message keeps its start, the records of a
conversation keep its group id and merge into one tree, and the cut shrinks the flat tokens while the tree
still shares the history."""

from __future__ import annotations

import json
from itertools import pairwise

from ds_tree.data import load_trajectories
from ds_tree.data.convert import ConvertOptions, convert
from ds_tree.data.jsonl import write_jsonl
from ds_tree.trees.pairs import preference_pairs
from tools.history_pairs import main as history_pairs

SYSTEM = "You are a telecom support agent. " + "Policy rule: check the line status first. " * 12


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        call = {"id": f"c{turn}", "type": "function", "function": {"name": "status", "arguments": "{}"}}
        messages += [{"role": "user", "content": f"my phone has no data, day {turn}"},
                     {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{turn}", "content": "line active"},
                     {"role": "assistant", "content": f"the line is active, try restarting ({turn})"}]  # fmt: skip
    return messages


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cut_messages_keep_their_start_and_one_tree_per_conversation(tmp_path, tokenizer_dir, capsys):
    trials = write_jsonl(tmp_path / "trials.jsonl", [{"group_id": "a", "messages": conversation(3)},
                                                     {"group_id": "a", "messages": conversation(1)},
                                                     {"group_id": "b", "messages": conversation(2)}])  # fmt: skip
    flat_tokens = {}
    for cap in (None, 40):
        output = tmp_path / f"pairs-{cap}.jsonl"
        argv = ["--trials", str(trials), "--output", str(output), "--pairs", "3"]
        assert history_pairs(argv + (["--max-message-chars", str(cap)] if cap else [])) == 0
        assert json.loads(capsys.readouterr().out) == {"groups": 2, "records": 6}
        written = records(output)
        assert [record["group_id"] for record in written] == ["a"] * 3 + ["b"] * 3
        for record in written:
            system, user = record["prompt"][:2]
            assert system["content"] == SYSTEM[:cap] and user["content"].startswith("my phone has no data")
            assert len(SYSTEM) > 40 and len(user["content"]) <= 40  # the cut shortens the long message only
        for group in ("a", "b"):  # each history a prefix of the next: the conversation's history is shared
            prompts = [record["prompt"] for record in written if record["group_id"] == group]
            assert all(later[: len(earlier)] == earlier for earlier, later in pairwise(prompts))
        summary = convert([output], tmp_path / f"data-{cap}", tokenizer_dir, ConvertOptions(format="preference"))
        counts = summary["counts"]
        assert counts["groups"] == 2 and counts["trajectories"] == 12  # one tree per conversation, 2 per record
        assert counts["tree_tokens"] < counts["flat_tokens"] / 2  # the history once, not twice per pair
        assert len(preference_pairs(load_trajectories(tmp_path / f"data-{cap}"))) == 6
        flat_tokens[cap] = counts["flat_tokens"]
    assert flat_tokens[40] < flat_tokens[None] * 0.75


def test_a_trial_without_messages_is_refused_with_its_line(tmp_path, capsys):
    trials = write_jsonl(tmp_path / "trials.jsonl", [{"group_id": "a", "messages": conversation(2)},
                                                     {"group_id": "b"}])  # fmt: skip
    output = tmp_path / "pairs.jsonl"
    assert history_pairs(["--trials", str(trials), "--output", str(output)]) == 2
    assert capsys.readouterr().err == f"error: {trials}:2: no messages (a chat trial: group_id, messages)\n"
    assert not output.exists()
