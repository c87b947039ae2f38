"""grpo/tasks/multiplication.py: digits-wide products (the calculator tool's task)."""
import re

from grpo.tasks.multiplication import multiplication


def test_products_of_the_asked_width():
    rows = multiplication(10, seed=0, digits=3)
    assert rows == multiplication(10, seed=0, digits=3)
    for r in rows:
        a, b = (int(x) for x in re.findall(r"\d{3}", r["prompt"])[:2])
        assert 100 <= a <= 999 and 100 <= b <= 999 and int(r["answer"]) == a * b
