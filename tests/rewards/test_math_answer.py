"""grpo/rewards/math_answer.py: the boxed answer compared as a number or as maths."""
from grpo.rewards.math_answer import is_correct, last_boxed, math_accuracy


def test_last_boxed_balances_braces():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}" and last_boxed("none") is None


def test_equal_numbers_in_different_forms_are_correct():
    assert is_correct(r"so \boxed{0.5}", "1/2") == 1.0 and is_correct(r"\boxed{3}", "4") == 0.0
    assert math_accuracy(None, [r"\boxed{1,000}", r"\boxed{999}"], answer=["1000", "1000"]) == [1.0, 0.0]
