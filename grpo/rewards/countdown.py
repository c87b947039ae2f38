"""Countdown reward (TinyZero's scoring): reach ``target`` with ``numbers``, each used at most once.

Score: 1.0 for an equation in the last ``<answer>...</answer>`` block that uses only the given
numbers (each at most once; ``use_all=True``: each exactly once), ``+ - * /`` and parentheses,
and equals ``target``; 0.1 (``format_score``) for an ``<answer>`` block that does not; 0.0 with
no ``<answer>`` block. The equation is parsed with :mod:`ast` and evaluated with exact fractions;
nothing is ever passed to ``eval``.
"""
from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from grpo.rewards.registry import register

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}
_MAX_CHARS = 200


def evaluate(expr: str) -> tuple[Fraction, list[int]] | None:
    """Value and the integers used of an arithmetic expression (``(3 + 5) * 2``), or None when it
    is anything else (names, calls, powers, unary minus, floats) or divides by zero."""
    expr = expr.replace("×", "*").replace("÷", "/").replace("−", "-").strip()
    expr = expr.partition("=")[0]  # "(3 + 5) * 2 = 16": judge the left-hand side
    if not expr or len(expr) > _MAX_CHARS:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    used: list[int] = []

    def walk(node) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError("not allowed")

    try:
        return walk(tree.body), used
    except (ValueError, ZeroDivisionError, RecursionError):
        return None


def score_one(completion: str, target, numbers, format_score: float = 0.1, use_all: bool = False) -> float:
    """1.0 / ``format_score`` / 0.0 for one completion (see the module docstring)."""
    found = _ANSWER.findall(completion) if isinstance(completion, str) else []
    if not found:
        return 0.0
    res = evaluate(found[-1])
    if res is None:
        return format_score
    value, used = res
    have, need = Counter(int(n) for n in numbers), Counter(used)
    fits = need == have if use_all else not (need - have)
    return 1.0 if fits and value == Fraction(int(target)) else format_score


def countdown(prompts: list[str], completions: list[str], target: list | None = None,
              numbers: list | None = None, format_score: float = 0.1, use_all: bool = False,
              **_) -> list[float | None]:
    """1.0 correct equation, ``format_score`` (0.1) an ``<answer>`` that is not, 0.0 none;
    columns ``target`` and ``numbers``. None for rows without them."""
    if target is None or numbers is None:
        return [None] * len(completions)
    return [None if t is None or n is None else score_one(c, t, n, format_score, use_all)
            for c, t, n in zip(completions, target, numbers)]


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register("countdown")(countdown)
