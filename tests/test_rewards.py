"""Rewards: the 24-game checker on hand-written cases and the tot-game24 labels, exact match, safe scoring."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest

from ds_tree.envs.game24 import ExpressionError, evaluate, extract_expression, puzzle_numbers, solves
from ds_tree.registries import REWARDS
from ds_tree.rollout.rewards import RewardRequest, score
from tests.helpers.shared_data import SHARED_DATA, absent

GAME24 = SHARED_DATA / "tot-game24" / "samples.jsonl"


@pytest.mark.parametrize(
    ("expression", "numbers", "expected"),
    [
        ("(6 - 4) * (4 + 8)", [4, 4, 6, 8], True),
        ("8 / (3 - 8 / 3)", [3, 3, 8, 8], True),  # exact only in rationals: 8 / (1/3)
        ("(10 - 4) * 5 - 6", [10, 5, 6, 4], True),  # any order of the given numbers
        ("4 × 6 × (2 ÷ 2)", [2, 2, 4, 6], True),
        ("(6 - 4) * (4 + 8) + 1", [4, 4, 6, 8], False),  # a number not given
        ("(6 - 4) * (4 * 8)", [4, 4, 6, 8], False),  # wrong value (64)
        ("6 * 4 * (8 / 8)", [4, 4, 6, 8], False),  # 8 reused, one 4 unused
        ("6 * 4", [4, 4, 6, 8], False),  # numbers left unused
        ("(6 - 4) * (4 + 8", [4, 4, 6, 8], False),  # malformed
        ("None", [4, 5, 6, 10], False),
        ("4 * 6 / (8 - 8)", [4, 6, 8, 8], False),  # division by zero
        ("-(4 - 6) * (4 + 8)", [4, 4, 6, 8], False),  # unary minus is not an operation of the game
        ("24 ** 1", [24, 1, 1, 1], False),
        ("__import__('os')", [1, 2, 3, 4], False),  # never evaluated
        ("0x18", [24, 0, 0, 0], False),  # decimal integers only
    ],
)
def test_game24_checker(expression, numbers, expected):
    assert solves(expression, numbers) is expected


def test_evaluate_is_exact_and_refuses_code():
    assert evaluate("8 / (3 - 8 / 3)") == (Fraction(24), [8, 3, 8, 3])
    for text in ("1 + 2.5", "abs(-3)", "1 // 2", "[1]", ""):
        with pytest.raises(ExpressionError):
            evaluate(text)


def test_extract_expression():
    assert extract_expression("Steps:\n4 + 8 = 12\nAnswer: (6 - 4) * (4 + 8) = 24") == "(6 - 4) * (4 + 8)"
    assert extract_expression("answer: 1 + 2\nAnswer: 3 * 8 = 24\nthanks") == "3 * 8"  # the last one
    assert extract_expression("Answer: 4 * 6\n") == "4 * 6"
    assert extract_expression("Steps:\n4 * 6 = 24 (left: 24)") is None
    assert extract_expression("Answer: = 24") is None
    assert puzzle_numbers("Input: 1 2 3 4\nSteps:\n...\nInput: 4 5 6 10\n") == [4, 5, 6, 10]
    assert puzzle_numbers("no puzzle here") is None


def test_builtin_rewards_and_safe_scoring():
    game24 = REWARDS.get("game24")
    assert game24(RewardRequest("Input: 4 4 6 8\n", "Steps: ...\nAnswer: (6 - 4) * (4 + 8) = 24", {})) == 1.0
    assert game24(RewardRequest("", "Answer: (6 - 4) * (4 + 8) = 24", {"numbers": [4, 4, 6, 8]})) == 1.0
    assert game24(RewardRequest("", "Answer: (6 - 4) * (4 + 8) = 24", {"numbers": [4, 4, 6, 9]})) == 0.0
    assert REWARDS.get("exact_match")(RewardRequest("q", " 42\n", {"answer": "42"})) == 1.0
    assert REWARDS.get("exact_match")(RewardRequest("q", "41", {"answer": "42"})) == 0.0

    def flaky(request: RewardRequest) -> float:
        if "boom" in request.completion:
            raise RuntimeError("checker crashed")
        return {"nan": math.nan, "inf": math.inf, "text": "1.0"}.get(request.completion, 0.5)

    requests = [RewardRequest("p", c, {}) for c in ("ok", "boom here", "nan", "inf", "text")]
    rewards, failures = score(flaky, requests)
    assert rewards == [0.5, None, None, None, None]
    assert len(failures) == 4
    assert "request 1" in failures[0] and "'boom here'" in failures[0]
    assert "RuntimeError: checker crashed" in failures[0]
    assert "request 2" in failures[1] and "nan" in failures[1]
    rewards, failures = score(REWARDS.get("game24"), [RewardRequest("no numbers", "Answer: 1", {})])
    assert rewards == [None] and "metadata['numbers']" in failures[0]


@pytest.mark.skipif(not GAME24.is_file(), reason=absent(GAME24))
def test_game24_agrees_with_the_data_labels():
    """Every tot-game24 sample's 1/0 label is what the checker gives its answer (403 correct of 10000)."""
    records = [json.loads(line) for line in GAME24.read_text().splitlines()]
    requests = [RewardRequest(r["messages"][0]["content"], r["messages"][1]["content"], {}) for r in records]
    rewards, failures = score(REWARDS.get("game24"), requests)
    assert failures == []
    assert rewards == [r["reward"] for r in records]
    assert sum(rewards) == 403
