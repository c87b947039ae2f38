"""grpo/tasks/countdown.py: targets reachable with the row's numbers (the answer is one way)."""
from collections import Counter
from fractions import Fraction

import pytest

from grpo.rewards.countdown import evaluate
from grpo.tasks.countdown import _combine, countdown


def test_every_answer_reaches_its_target_with_its_numbers():
    rows = countdown(30, seed=5)
    assert rows == countdown(30, seed=5)
    for r in rows:
        value, used = evaluate(r["answer"])
        assert value == r["target"] and Counter(used) == Counter(r["numbers"])


class Scripted:
    """An rng whose picks are given: ``pairs`` for `sample` (which two items combine next), ``ops`` for `choice`."""

    def __init__(self, pairs, ops):
        self.pairs, self.ops = list(pairs), list(ops)

    def sample(self, population, k):
        assert k == 2 and len(population) >= 2
        return self.pairs.pop(0)

    def choice(self, seq):
        assert seq == "+-*/"
        return self.ops.pop(0)


def _fold(values_texts, pairs, ops):
    return _combine(Scripted(pairs, ops), [(Fraction(v), t) for v, t in values_texts])


@pytest.mark.parametrize("a,b,op,value,text", [
    (3, 5, "+", 8, "3 + 5"),
    (3, 5, "*", 15, "3 * 5"),          # an operation other than / and - is taken as drawn, in the drawn order
    (5, 3, "-", 2, "5 - 3"),
    (3, 5, "-", 2, "5 - 3"),           # a subtraction never goes negative: the operands swap
    (6, 3, "/", 2, "6 / 3"),           # a whole division stays
    (7, 3, "/", 10, "7 + 3"),          # one that is not whole (7 % 3 == 1) becomes an addition
    (3, 6, "/", 9, "3 + 6"),
    (4, 0, "/", 4, "4 + 0"),           # and so does one by zero
])
def test_two_numbers_combine_with_the_drawn_operation(a, b, op, value, text):
    assert _fold([(a, str(a)), (b, str(b))], [(0, 1)], [op]) == (value, text)


def test_a_subtraction_of_equal_values_keeps_the_drawn_order_and_folds_keep_inner_parentheses():
    # equal values do not swap: the first drawn stays first
    assert _fold([(5, "(2 + 3)"), (5, "5")], [(0, 1)], ["-"]) == (0, "(2 + 3) - 5")
    # the picked pair leaves the list, its result joins it at the end; only the outermost parentheses go
    got = _fold([(2, "2"), (9, "9"), (4, "4")], [(0, 2), (0, 1)], ["*", "+"])
    assert got == (17, "9 + (2 * 4)")
    assert _fold([(7, "7")], [], []) == (7, "7")       # one number alone is its own expression
    assert _fold([(7, "(7)")], [], []) == (7, "7")


def test_the_ranges_asked_for_are_drawn_in_full_and_problems_are_distinct(monkeypatch):
    from grpo.tasks import countdown as task

    calls = []
    combine = task._combine
    monkeypatch.setattr(task, "_combine", lambda rng, items: calls.append(len(items)) or combine(rng, items))
    rows = countdown(40, seed=0, max_number=5, max_target=10)
    keys = {(tuple(sorted(r["numbers"])), r["target"]) for r in rows}
    assert len(rows) == 40 == len(keys) and len(calls) > 40  # draws that repeat a problem are skipped
    assert {r["target"] for r in rows} == set(range(1, 11)) and {x for r in rows for x in r["numbers"]} == set(range(
        1, 6))
    assert {len(r["numbers"]) for r in countdown(50, seed=0)} == {3, 4}  # the default: 3 or 4 numbers
    assert {len(r["numbers"]) for r in countdown(5, seed=0, min_numbers=2, max_numbers=2)} == {2}
    with pytest.raises(ValueError, match="countdown needs 2 <= min_numbers <= max_numbers"):
        countdown(1, seed=0, min_numbers=1)
    with pytest.raises(ValueError, match="countdown needs 2 <= min_numbers <= max_numbers"):
        countdown(1, seed=0, min_numbers=4, max_numbers=3)


@pytest.mark.parametrize("n", [1, 2])
def test_a_range_without_enough_problems_gives_up_after_1000_draws_a_problem(monkeypatch, n):
    from grpo.tasks import countdown as task

    calls = []
    combine = task._combine
    monkeypatch.setattr(task, "_combine", lambda rng, items: calls.append(1) or combine(rng, items))
    with pytest.raises(RuntimeError, match="cannot generate enough distinct problems; widen the ranges"):
        countdown(n, seed=0, max_target=0)  # no target in 1..0
    assert len(calls) == 1000 * n


def test_the_default_targets_stay_below_1000():
    """docs/tasks.md: targets lie in 1..999 by default (seed 6 draws a 1000 among its first 300 problems)."""
    rows = countdown(300, seed=6)
    assert max(r["target"] for r in rows) <= 999 and 1000 in {r["target"] for r in countdown(300, 6, max_target=1000)}
