"""Explicit trees (nodes with parent links) expand into root-to-leaf trajectories."""

import numpy as np
import pytest

from ds_tree.data.explicit import trajectories_from_explicit_tree
from ds_tree.errors import DataError
from ds_tree.trees import build_forest

WHERE = "trees.jsonl:3"


def node(node_id, parent, ids, **extra):
    return {"id": node_id, "parent": parent, "input_ids": ids, **extra}


TREE = {
    "group_id": "task-1",
    "nodes": [
        node("root", None, [5, 6, 7], loss_mask=[0, 0, 0]),
        node("a", "root", [8, 9]),
        node("leaf-1", "a", [10], reward=1.0),
        node("leaf-2", "a", [11, 12], loss_mask=[0.5, 0.25], reward=0),
        node("leaf-3", "root", [13]),
    ],
}


def test_expands_every_root_to_leaf_path():
    trajectories = trajectories_from_explicit_tree(TREE, WHERE)
    assert [t.input_ids.tolist() for t in trajectories] == [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 11, 12], [5, 6, 7, 13]]
    assert [t.loss_mask.tolist() for t in trajectories] == [
        [0, 0, 0, 1, 1, 1],  # loss_mask defaults to 1 on input_ids nodes
        [0, 0, 0, 1, 1, 0.5, 0.25],
        [0, 0, 0, 1],
    ]
    assert [t.reward for t in trajectories] == [1.0, 0.0, None]
    assert [t.trial for t in trajectories] == [0, 1, 2]
    assert {t.group_id for t in trajectories} == {"task-1"}
    assert trajectories[1].source == "trees.jsonl:3:leaf 'leaf-2'"
    (tree,) = build_forest(trajectories)
    assert tree.n_tokens == 9  # every given node's tokens exactly once


def test_node_order_does_not_matter_and_group_defaults_to_where():
    shuffled = {"nodes": TREE["nodes"][::-1]}
    trajectories = trajectories_from_explicit_tree(shuffled, WHERE)
    assert [t.input_ids.tolist()[-1] for t in trajectories] == [13, 12, 10]  # leaves in node order
    assert trajectories[0].group_id == WHERE


def test_message_nodes_render_the_whole_path():
    seen = []

    def tokenize(messages):
        seen.append([m["content"] for m in messages])
        return np.arange(5, 5 + len(messages)), np.ones(len(messages))

    record = {
        "nodes": [
            {"id": 0, "parent": None, "messages": [{"role": "user", "content": "q"}]},
            {"id": 1, "parent": 0, "messages": [{"role": "assistant", "content": "x"}], "reward": 1},
            {"id": 2, "parent": 0, "messages": [{"role": "assistant", "content": "y"}], "reward": 0},
        ]
    }
    trajectories = trajectories_from_explicit_tree(record, WHERE, tokenize)
    assert seen == [["q", "x"], ["q", "y"]]
    assert [t.reward for t in trajectories] == [1.0, 0.0]
    with pytest.raises(DataError, match="no tokenizer"):
        trajectories_from_explicit_tree(record, WHERE)


def test_rollout_fields_concatenate_along_each_path():
    nan = np.nan
    record = {
        "nodes": [
            node("prompt", None, [5, 6], loss_mask=[0, 0], advantages=[0.0, 0.0]),
            node("a", "prompt", [7, 8], logprobs=[-0.5, None], advantages=[1.5, -2.0]),
            node("a1", "a", [9], logprobs=[-1.25], advantages=[3.0]),
            node("a2", "a", [10, 11], advantages=[4.0, 5.0]),
            node("b", "prompt", [12], logprobs=[-0.0], advantages=[-6.0]),
        ]
    }
    a1, a2, b = trajectories_from_explicit_tree(record, WHERE)
    np.testing.assert_array_equal(a1.logprobs, [nan, nan, -0.5, nan, -1.25])  # nodes without: not sampled
    np.testing.assert_array_equal(a2.logprobs, [nan, nan, -0.5, nan, nan, nan])
    np.testing.assert_array_equal(b.logprobs, [nan, nan, -0.0])
    assert np.signbit(b.logprobs[-1])
    np.testing.assert_array_equal(a1.advantages, [0.0, 0.0, 1.5, -2.0, 3.0])
    np.testing.assert_array_equal(a2.advantages, [0.0, 0.0, 1.5, -2.0, 4.0, 5.0])
    np.testing.assert_array_equal(b.advantages, [0.0, 0.0, -6.0])
    plain = trajectories_from_explicit_tree(TREE, WHERE)
    assert all(t.logprobs is None and t.advantages is None for t in plain)


def with_nodes(*nodes, **fields):
    return {"nodes": list(nodes), **fields}


@pytest.mark.parametrize(
    ("record", "fragment"),
    [
        (with_nodes(node(1, None, [5]), node(2, 3, [6])), "parent 3, which is not a node"),
        (with_nodes(node(1, None, [5]), node(2, None, [6])), "exactly one root (a node with parent null), found 2"),
        (with_nodes(node(1, 2, [5]), node(2, 1, [6])), "found 0"),
        (with_nodes(node(1, None, [5]), node(2, 3, [6]), node(3, 2, [7])), "cycle (2 nodes unreachable"),
        (with_nodes(node(1, None, [5]), node(1, 1, [6])), "duplicate node id 1"),
        (with_nodes(node(1, None, [5], reward=1), node(2, 1, [6])), "node 1 has a reward but is not a leaf"),
        (with_nodes(node(1, None, [5], messages=[])), "exactly one of 'input_ids' and 'messages'"),
        (with_nodes({"id": 1, "parent": None}), "exactly one of"),
        (with_nodes(node(1, None, [5], loss_mask=[1, 1])), "as long as 'input_ids'"),
        (with_nodes(node(1, None, ["5"])), "list of integers"),
        (with_nodes(node(1, None, [5], reward="high")), "field 'reward' must be a finite number"),
        (with_nodes({"parent": None, "input_ids": [5]}), "needs an 'id'"),
        (with_nodes("node"), "a node must be an object"),
        (with_nodes(node(1, None, [5]), {"id": 2, "parent": 1, "messages": []}), "mixes"),
        (with_nodes(node(1, None, [5]), group_id=["g"]), "'group_id' must be a string"),
        ({"nodes": []}, "non-empty list"),
        ({}, "non-empty list"),
        (with_nodes(node(1, None, [])), "empty trajectory"),
        (
            with_nodes(node(1, None, [5, 6], logprobs=[-1.0])),
            "node 1: field 'logprobs' has 1 entries but 'input_ids' has 2",
        ),
        (
            with_nodes(node(1, None, [5], advantages=[1, 2])),
            "node 1: field 'advantages' has 2 entries but 'input_ids' has 1",
        ),
        (
            with_nodes(node(1, None, [5], logprobs=["-1"])),
            "node 1: field 'logprobs' must be a list of finite numbers or null",
        ),
        (
            with_nodes(node(1, None, [5], advantages=[True])),
            "node 1: field 'advantages' must be a list of finite numbers",
        ),
        (
            with_nodes(node(1, None, [5], advantages=[float("nan")])),
            "node 1: field 'advantages' must be a list of finite",
        ),
        (with_nodes(node(1, None, [5, 6], logprobs=[None, 0.5])), "leaf 1: logprobs has 0.5 at token 1"),
        (
            with_nodes(node(1, None, [5], advantages=[0]), node(2, 1, [6], advantages=[1]), node(3, 1, [7])),
            "node 3 has no field 'advantages' but another node on the path to leaf 3 has",
        ),
        (
            with_nodes(node(1, None, [5]), node(2, 1, [6], advantages=[1])),
            "node 1 has no field 'advantages' but another node on the path to leaf 2 has",
        ),
        (
            with_nodes({"id": 1, "parent": None, "messages": [], "logprobs": [-1.0]}),
            "node 1: field 'logprobs' is only allowed on 'input_ids' nodes",
        ),
        (
            with_nodes({"id": 1, "parent": None, "messages": [], "advantages": [0.5]}),
            "node 1: field 'advantages' is only allowed on 'input_ids' nodes",
        ),
    ],
)
def test_bad_trees(record, fragment):
    with pytest.raises(DataError) as raised:
        trajectories_from_explicit_tree(record, WHERE)
    assert str(raised.value).startswith(WHERE)
    assert fragment in str(raised.value)
