"""Small-number arithmetic: ``What is 37 + 48?`` with an integer answer.

Levels make it harder: 0 = two numbers 0-20 added (441 distinct problems), 1 = two 1-2 digit numbers added,
2 = add/subtract 2-digit numbers,
3 = three 2-digit terms with + and -, 4 = 2-digit x 1-digit multiplication plus a term.
"""
from __future__ import annotations

import random

from grpo.tasks import register_task


def _problem(rng: random.Random, level: int) -> tuple[str, int]:
    if level == 0:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"{a} + {b}", a + b
    if level == 1:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        return f"{a} + {b}", a + b
    if level == 2:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice("+-")
        return f"{a} {op} {b}", a + b if op == "+" else a - b
    if level == 3:
        a, b, c = (rng.randint(10, 99) for _ in range(3))
        o1, o2 = rng.choice("+-"), rng.choice("+-")
        val = a + (b if o1 == "+" else -b)
        val = val + (c if o2 == "+" else -c)
        return f"{a} {o1} {b} {o2} {c}", val
    if level == 4:
        a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(1, 99)
        return f"{a} * {b} + {c}", a * b + c
    raise ValueError(f"arithmetic level must be 0-4, got {level}")


def arithmetic(n: int, seed: int, level: int = 1,
               template: str = "What is {expr}? Answer with the number only.") -> list[dict]:
    """``n`` problems at ``level`` (0-4), deterministic in ``seed``; distinct while the level has enough."""
    rng = random.Random(seed)
    rows, seen = [], set()
    attempts = 0
    while len(rows) < n:
        expr, ans = _problem(rng, level)
        attempts += 1
        if expr in seen and attempts < 50 * n:
            continue
        seen.add(expr)
        rows.append({"prompt": template.format(expr=expr), "answer": ans})
    return rows


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register_task("arithmetic")(arithmetic)
