"""grpo/rewards/arithmetic.py: the last (or the bare) integer against the row's answer; number_only's shaping."""
from grpo.rewards.arithmetic import arithmetic, bare_integer, last_integer, number_only


def test_lenient_takes_the_last_integer_and_strict_only_a_bare_one():
    assert last_integer("so 3 + 4 = 7.") == 7 and last_integer("1,234 apples") == 1234 and last_integer("no") is None
    assert bare_integer(" 42.") == 42 and bare_integer("42 apples") is None
    comps = ["3 + 4 = 7", "7", "the answer is 8"]
    assert arithmetic(None, comps, [7, 7, 7]) == [1.0, 1.0, 0.0]
    assert arithmetic(None, comps, [7, 7, 7], strict=True) == [0.0, 1.0, 0.0]


def test_number_only_is_one_for_a_bare_number_and_shaped_otherwise():
    assert number_only(None, ["12", "a1", "", "ab"]) == [1.0, 0.25, 0.0, 0.0]


def test_a_bare_integer_may_have_thousands_separators_and_a_full_stop_but_nothing_else():
    assert bare_integer("1,234") == 1234 and bare_integer("-7.") == -7 and bare_integer(" 12 ") == 12
    assert bare_integer("12X") is None and bare_integer("12.5") is None and bare_integer("") is None


def test_number_only_drops_only_a_trailing_full_stop_before_shaping():
    # "a1." reads as "a1" (a quarter); in "1aX" the X counts (one digit of three), only "." is dropped
    assert number_only(None, ["a1.", "1aX", ".1a"]) == [0.25, 0.5 / 3, 0.5 / 3]
