"""Countdown: combine 3-4 numbers with + - * / to reach a target (TinyZero's task).

Each problem is built backwards from a random expression over all its numbers, so it always has
a solution (the ``answer`` column); intermediate results are whole and non-negative. Score it with
the ``countdown`` reward (columns ``target`` and ``numbers``).
"""
from __future__ import annotations

import random
from fractions import Fraction

from grpo.tasks import register_task

TEMPLATE = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
    "arithmetic operations (+, -, *, /) and each number can be used at most once. Show your work "
    "in <think> </think> tags. And return the final equation in <answer> </answer> tags, for "
    "example <answer> (1 + 2) / 3 </answer>."
)


def _combine(rng: random.Random, items: list[tuple[Fraction, str]]) -> tuple[Fraction, str]:
    """Fold ``items`` (value, text) pairwise in random order with random operations; a division
    that would not be whole becomes an addition, a subtraction never goes negative."""
    items = list(items)
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ta), (b, tb) = items[i], items[j]
        op = rng.choice("+-*/")
        if op == "-" and a < b:
            (a, ta), (b, tb) = (b, tb), (a, ta)
        if op == "/" and (b == 0 or a % b != 0):
            op = "+"
        value = {"+": a + b, "-": a - b, "*": a * b}[op] if op != "/" else a / b
        text = f"({ta} {op} {tb})"
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(value, text)]
    value, text = items[0]
    return value, text[1:-1] if text.startswith("(") else text


def countdown(n: int, seed: int, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 99,
              max_target: int = 999, template: str = TEMPLATE) -> list[dict]:
    """``n`` problems, deterministic in ``seed``: ``min_numbers``..``max_numbers`` numbers in
    1..``max_number``, a target in 1..``max_target``. Columns: ``target`` (int), ``numbers``
    (list of int), ``answer`` (one valid equation, e.g. ``(44 - 19) * 3 + 2``)."""
    if not 2 <= min_numbers <= max_numbers:
        raise ValueError("countdown needs 2 <= min_numbers <= max_numbers")
    rng = random.Random(seed)
    rows, seen = [], set()
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 1000 * max(n, 1):
            raise RuntimeError("countdown: cannot generate enough distinct problems; widen the ranges")
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        value, expr = _combine(rng, [(Fraction(x), str(x)) for x in numbers])
        if value.denominator != 1 or not 1 <= value <= max_target:
            continue
        key = (tuple(sorted(numbers)), int(value))
        if key in seen:
            continue
        seen.add(key)
        target = int(value)
        rows.append({"prompt": template.format(numbers=numbers, target=target),
                     "target": target, "numbers": numbers, "answer": expr})
    return rows


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register_task("countdown")(countdown)
