"""grpo/tasks/countdown.py: targets reachable with the row's numbers (the answer is one way)."""
from collections import Counter

from grpo.rewards.countdown import evaluate
from grpo.tasks.countdown import countdown


def test_every_answer_reaches_its_target_with_its_numbers():
    rows = countdown(30, seed=5)
    assert rows == countdown(30, seed=5)
    for r in rows:
        value, used = evaluate(r["answer"])
        assert value == r["target"] and Counter(used) == Counter(r["numbers"])
