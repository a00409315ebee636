"""The 24 game: does an expression use four given numbers once each and evaluate to 24?

The checker accepts only decimal integers, binary ``+ - * /`` and parentheses (``×``, ``÷`` and
``−`` read as ``*``, ``/``, ``-``), parses them with :mod:`ast` (nothing is evaluated as Python;
no unary minus, powers or floats) and computes with :class:`fractions.Fraction`,
so ``8 / (3 - 8 / 3)`` is exactly 24. A completion's answer is read by :func:`extract_expression`;
:func:`reward` is the built-in ``game24`` reward (``rollout.reward: game24``, ``ds-tree sample --reward game24``).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from ds_tree.rollout.rewards import RewardRequest

TARGET = 24

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_SYMBOLS = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})
_ALLOWED = re.compile(r"[0-9\s+\-*/()]+")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_INPUT = re.compile(r"input\s*:\s*(-?\d+(?:\s+-?\d+){3})\s*$", re.IGNORECASE | re.MULTILINE)


class ExpressionError(ValueError):
    """The text is not an arithmetic expression the checker accepts."""


def extract_expression(completion: str) -> str | None:
    """The expression a completion answers with, or None when it gives none.

    Rule: the text after the last ``Answer:`` (any case) up to the end of that line; if it has an
    ``=``, the part before the first ``=`` (``(6 - 4) * (4 + 8) = 24`` gives ``(6 - 4) * (4 + 8)``).
    A completion without ``Answer:`` has no answer (its steps are not read).
    """
    matches = list(_ANSWER.finditer(completion))
    if not matches:
        return None
    line = completion[matches[-1].end() :].split("\n", 1)[0]
    expression = line.split("=", 1)[0].strip()
    return expression or None


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of ``expression`` and the integers it uses, in order of appearance."""
    text = expression.translate(_SYMBOLS).strip()
    if not _ALLOWED.fullmatch(text):
        raise ExpressionError(f"{expression!r}: only integers, + - * / and parentheses are allowed")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise ExpressionError(f"not an arithmetic expression: {expression!r} ({error.msg})") from None
    numbers: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ExpressionError(f"division by zero in {expression!r}")
            return _OPERATORS[type(node.op)](left, right)
        raise ExpressionError(f"{expression!r}: only integers, + - * / and parentheses are allowed")

    return value(tree.body), numbers


def solves(expression: str, numbers: Sequence[int]) -> bool:
    """Whether ``expression`` uses exactly ``numbers`` (each once, any order) and equals 24."""
    try:
        result, used = evaluate(expression)
    except ExpressionError:
        return False
    return Counter(used) == Counter(int(n) for n in numbers) and result == TARGET


def puzzle_numbers(prompt: str) -> list[int] | None:
    """The four numbers of the last ``Input: a b c d`` line of a prompt (the tot-game24 form), else None."""
    matches = _INPUT.findall(prompt)
    return [int(n) for n in matches[-1].split()] if matches else None


def reward(request: RewardRequest) -> float:
    """1.0 when the completion's ``Answer:`` expression uses the four numbers once each and equals 24.

    The numbers come from ``metadata["numbers"]``, else from the prompt's last ``Input: a b c d`` line.
    """
    numbers = request.metadata.get("numbers") or puzzle_numbers(request.prompt)
    if numbers is None or len(numbers) != 4:
        raise ValueError("game24 needs metadata['numbers'] (4 integers) or an 'Input: a b c d' line in the prompt")
    expression = extract_expression(request.completion)
    return float(expression is not None and solves(expression, numbers))
