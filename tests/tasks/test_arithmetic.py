"""grpo/tasks/arithmetic.py: additions whose answer is in the row, deterministic in the seed."""
import re

from grpo.tasks.arithmetic import arithmetic


def test_rows_are_deterministic_and_their_answers_right():
    rows = arithmetic(30, seed=1, level=0)
    assert rows == arithmetic(30, seed=1, level=0) and rows != arithmetic(30, seed=2, level=0)
    for r in rows:
        a, b = map(int, re.findall(r"\d+", r["prompt"])[:2])
        assert int(r["answer"]) == a + b and 0 <= a <= 20 and 0 <= b <= 20
