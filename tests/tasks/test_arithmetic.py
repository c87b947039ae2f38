"""grpo/tasks/arithmetic.py: additions whose answer is in the row, deterministic in the seed."""
import re

import pytest

from grpo.tasks.arithmetic import arithmetic


def test_rows_are_deterministic_and_their_answers_right():
    rows = arithmetic(30, seed=1, level=0)
    assert rows == arithmetic(30, seed=1, level=0) and rows != arithmetic(30, seed=2, level=0)
    for r in rows:
        a, b = map(int, re.findall(r"\d+", r["prompt"])[:2])
        assert int(r["answer"]) == a + b and 0 <= a <= 20 and 0 <= b <= 20


# each level's operands (their exact ranges), operators and the number of terms, over enough draws to see every bound
LEVELS = {
    0: [(0, 20), (0, 20)],
    1: [(1, 99), (1, 99)],
    2: [(10, 99), (10, 99)],
    3: [(10, 99), (10, 99), (10, 99)],
    4: [(10, 99), (2, 9), (1, 99)],
}
OPERATORS = {0: [{"+"}], 1: [{"+"}], 2: [{"+", "-"}], 3: [{"+", "-"}, {"+", "-"}], 4: [{"*"}, {"+"}]}


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_each_level_draws_its_operands_over_their_whole_range_and_answers_the_expression(level):
    rows = arithmetic(441 if level == 0 else 1500, seed=0, level=level, template="{expr}")
    if level == 0:  # its 441 problems, each once
        assert len({r["prompt"] for r in rows}) == 441
    terms = [r["prompt"].split(" ") for r in rows]
    assert all(len(t) == 2 * len(LEVELS[level]) - 1 for t in terms)
    for r, t in zip(rows, terms):
        assert r["answer"] == eval(r["prompt"]) and isinstance(r["answer"], int)  # the expression's own value
    for i, (lo, hi) in enumerate(LEVELS[level]):
        seen = [int(t[2 * i]) for t in terms]
        assert (min(seen), max(seen)) == (lo, hi)
    assert [{t[2 * i + 1] for t in terms} for i in range(len(LEVELS[level]) - 1)] == OPERATORS[level]


def test_the_prompt_is_the_template_around_the_expression_and_other_levels_are_refused():
    (row,) = arithmetic(1, seed=3, level=2)
    assert row["prompt"].startswith("What is ") and row["prompt"].endswith("? Answer with the number only.")
    assert eval(row["prompt"][len("What is "):-len("? Answer with the number only.")]) == row["answer"]
    with pytest.raises(ValueError, match="arithmetic level must be 0-4, got 5"):
        arithmetic(1, seed=0, level=5)


def test_the_default_level_is_one_and_a_level_without_n_distinct_problems_repeats_after_50_draws_a_row(monkeypatch):
    from grpo.tasks import arithmetic as task

    rows = arithmetic(300, seed=0)  # level 1: two numbers of 1-2 digits, added
    numbers = [int(x) for r in rows for x in re.findall(r"\d+", r["prompt"])[:2]]
    assert "+" in rows[0]["prompt"] and min(numbers) == 1 and max(numbers) > 20
    assert all(" - " not in r["prompt"] for r in rows)
    more = arithmetic(500, seed=0, level=0)  # 441 problems: each of them, then repeats rather than an endless search
    assert len(more) == 500 and len({r["prompt"] for r in more}) == 441
    draws = []
    monkeypatch.setattr(task, "_problem", lambda rng, level: draws.append(level) or ("1 + 1", 2))
    assert [r["answer"] for r in arithmetic(2, seed=0, level=3)] == [2, 2]
    assert draws == [3] * 100  # the second row: after 50 x n draws that gave only the first's problem
