"""The record checks are one set: a tokens record and an explicit tree record reject the same
bad values with the same message, and accept the same good ones the same way."""

import math

import numpy as np
import pytest

from ds_tree.data.explicit import trajectories_from_explicit_tree
from ds_tree.data.tokens import trajectory_from_record
from ds_tree.errors import DataError

WHERE = "data.jsonl:4"
GROUP_FIELDS = ("group_id",)  # record-level in both formats; the rest sit on the tree's node


def read_tokens(fields: dict) -> list:
    return [trajectory_from_record(WHERE, {"group_id": "g", "input_ids": [5, 6], "loss_mask": [0, 1], **fields})]


def read_tree(fields: dict) -> list:
    node = {"id": 0, "parent": None, "input_ids": [5, 6], "loss_mask": [0, 1]}
    node.update({k: v for k, v in fields.items() if k not in GROUP_FIELDS})
    record = {"group_id": "g", "nodes": [node], **{k: v for k, v in fields.items() if k in GROUP_FIELDS}}
    return trajectories_from_explicit_tree(record, WHERE)


READERS = {"tokens": read_tokens, "tree": read_tree}

BAD = [
    ({"group_id": True}, "field 'group_id' must be a string or an integer"),
    ({"group_id": ["g"]}, "field 'group_id' must be a string or an integer"),
    ({"group_id": None}, "field 'group_id' must be a string or an integer"),
    ({"group_id": 1.0}, "field 'group_id' must be a string or an integer"),
    ({"input_ids": [5, True]}, "field 'input_ids' must be a list of integers"),
    ({"input_ids": [5, 6.0]}, "field 'input_ids' must be a list of integers"),
    ({"input_ids": "56"}, "field 'input_ids' must be a list of integers"),
    ({"input_ids": [5, 2**70]}, "field 'input_ids' has an integer outside the 64-bit range"),
    ({"loss_mask": [0, True]}, "field 'loss_mask' must be a list of numbers"),
    ({"loss_mask": [0, "1"]}, "field 'loss_mask' must be a list of numbers"),
    ({"reward": True}, "field 'reward' must be a finite number or null"),
    ({"reward": "1"}, "field 'reward' must be a finite number or null"),
    ({"reward": math.nan}, "field 'reward' must be a finite number or null"),
    ({"reward": -math.inf}, "field 'reward' must be a finite number or null"),
    ({"reward": 10**400}, "field 'reward' must be a finite number or null"),
]


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize(("fields", "fragment"), BAD)
def test_both_formats_reject_the_same_values(reader, fields, fragment):
    with pytest.raises(DataError) as raised:
        READERS[reader](fields)
    message = str(raised.value)
    assert message.startswith(WHERE) and message.endswith(fragment), message


@pytest.mark.parametrize("reader", sorted(READERS))
def test_both_formats_accept_the_same_values(reader):
    (trajectory,) = READERS[reader]({"group_id": 7, "input_ids": [5, 2**40], "loss_mask": [0, 0.5], "reward": 1})
    assert trajectory.group_id == 7  # an integer id stays one: the group "7" is another group
    np.testing.assert_array_equal(trajectory.input_ids, [5, 2**40])
    np.testing.assert_array_equal(trajectory.loss_mask, [0, 0.5])
    assert trajectory.reward == 1.0 and isinstance(trajectory.reward, float)
    (unrewarded,) = READERS[reader]({"reward": None})
    assert unrewarded.reward is None


def test_a_boolean_is_not_a_node_id_or_a_trial():
    node = {"id": True, "parent": None, "input_ids": [5, 6]}
    with pytest.raises(DataError, match="needs an 'id'"):
        trajectories_from_explicit_tree({"nodes": [node]}, WHERE)
    (trajectory,) = read_tokens({"trial": True})
    assert trajectory.trial is None
    (trajectory,) = read_tokens({"trial": 3})
    assert trajectory.trial == 3
