"""grpo/rewards/countdown.py: an <answer> equation that reaches the target with the given numbers."""
from fractions import Fraction

from grpo.rewards.countdown import countdown, evaluate, score_one


def test_an_equation_is_evaluated_exactly_with_the_numbers_it_uses():
    value, used = evaluate("(6 - 2) * 3 / 4")
    assert value == Fraction(3) and sorted(used) == [2, 3, 4, 6]
    assert evaluate("import os") is None


def test_correct_format_only_and_nothing():
    assert score_one("<answer>(6 - 2) * 3</answer>", 12, [6, 2, 3]) == 1.0
    assert score_one("<answer>6 * 3</answer>", 12, [6, 2, 3]) == 0.1      # wrong value: the format score
    assert score_one("<answer>6 * 6 - 24</answer>", 12, [6, 2, 3]) == 0.1  # a number it was not given
    assert score_one("12", 12, [6, 2, 3]) == 0.0
    assert score_one("<answer>6 * 2</answer>", 12, [6, 2, 3], use_all=True) == 0.1
    assert countdown(None, ["<answer>6*2</answer>"]) == [None]  # rows without target/numbers are not scored
