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


def test_typeset_operators_and_an_equation_judged_by_its_left_hand_side():
    assert evaluate("(6 − 2) × 3 ÷ 4") == (Fraction(3), [6, 2, 3, 4])
    assert evaluate("(3 + 5) * 2 = 16") == (Fraction(16), [3, 5, 2])
    assert evaluate("2 * 6 = 12 = 12") == (Fraction(12), [2, 6])
    assert evaluate("= 16") is None and evaluate("  ") is None


def test_names_powers_and_overlong_expressions_are_refused():
    assert evaluate("x + 1") is None and evaluate("2 ** 3") is None and evaluate("1.5 * 2") is None
    assert evaluate("-3 + 5") is None and evaluate("4 / (2 - 2)") is None
    longest = "11" + "+1" * 99                                   # 200 characters: still read
    assert len(longest) == 200 and evaluate(longest) == (Fraction(110), [11] + [1] * 99)
    assert evaluate(longest + "1") is None                        # 201


def test_by_default_numbers_may_be_left_unused_and_a_non_text_completion_scores_zero():
    assert score_one("<answer>6 * 2</answer>", 12, [6, 2, 3]) == 1.0
    assert score_one("<answer>6 * 2 * 1</answer>", 12, [6, 2, 1], use_all=True) == 1.0
    assert score_one("<answer>6 * 6 / 3</answer>", 12, [6, 3]) == 0.1           # 6 used twice, given once
    assert score_one(None, 12, [6, 2]) == 0.0
    assert countdown(None, ["<answer>6*2</answer>", "x"], target=[12, None], numbers=[[6, 2], [1]]) == [1.0, None]


def test_countdown_passes_its_format_score_and_use_all_on_and_needs_both_columns():
    kw = dict(target=[12, 12], numbers=[[6, 2, 3], [6, 2, 3]])
    comps = ["<answer>6 * 3</answer>", "<answer>6 * 2</answer>"]  # wrong; right leaving 3 unused
    assert countdown(None, comps, **kw) == [0.1, 1.0]                  # the defaults: 0.1, numbers may be left
    assert countdown(None, comps, format_score=0.3, use_all=True, **kw) == [0.3, 0.3]
    assert countdown(None, comps, target=[12, 12]) == [None, None]      # numbers missing
    assert countdown(None, comps, numbers=kw["numbers"]) == [None, None]
