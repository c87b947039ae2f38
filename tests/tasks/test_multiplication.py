"""grpo/tasks/multiplication.py: digits-wide products (the calculator tool's task)."""
import re

import pytest

from grpo.tasks.multiplication import CALCULATOR_PROMPT, TOOL_PROMPT, multiplication


def test_products_of_the_asked_width():
    rows = multiplication(10, seed=0, digits=3)
    assert rows == multiplication(10, seed=0, digits=3)
    for r in rows:
        a, b = (int(x) for x in re.findall(r"\d{3}", r["prompt"])[:2])
        assert 100 <= a <= 999 and 100 <= b <= 999 and int(r["answer"]) == a * b


def _operands(rows):
    return [tuple(int(x) for x in re.match(r"(\d+) \* (\d+)$", r["prompt"]).groups()) for r in rows]


def test_the_prompt_is_the_calculators_the_tool_calls_or_the_one_given():
    (a, b), = _operands(multiplication(1, seed=4, template="{a} * {b}"))
    assert multiplication(1, seed=4) == [{"prompt": CALCULATOR_PROMPT.format(a=a, b=b), "answer": a * b}]  # 3 digits
    assert 100 <= a <= 999 and 100 <= b <= 999
    assert multiplication(1, seed=4, tools=True)[0]["prompt"] == TOOL_PROMPT.format(a=a, b=b)
    assert '"expression": "%d * %d"' % (a, b) in TOOL_PROMPT.format(a=a, b=b)


def test_operands_span_their_width_and_problems_repeat_only_once_every_pair_is_used():
    two = _operands(multiplication(3000, seed=0, digits=2, template="{a} * {b}"))
    assert len(two) == 3000 and min(min(p) for p in two) == 10 and max(max(p) for p in two) == 99
    every = _operands(multiplication(81, seed=0, digits=1, template="{a} * {b}"))
    assert sorted(every) == [(a, b) for a in range(1, 10) for b in range(1, 10)]  # all 81 pairs, once each
    more = _operands(multiplication(100, seed=0, digits=1, template="{a} * {b}"))
    assert len(more) == 100 and len(set(more)) == 81
    assert len(multiplication(2, seed=0, digits=9)[0]["prompt"]) > 0
    for digits in (0, 10):
        with pytest.raises(ValueError, match=f"digits must be 1-9, got {digits}"):
            multiplication(1, seed=0, digits=digits)
