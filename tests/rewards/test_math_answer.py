"""grpo/rewards/math_answer.py: the boxed answer compared as a number or as maths."""
import pytest

from grpo.rewards.math_answer import is_correct, last_boxed, math_accuracy


def test_last_boxed_balances_braces():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}" and last_boxed("none") is None


def test_equal_numbers_in_different_forms_are_correct():
    assert is_correct(r"so \boxed{0.5}", "1/2") == 1.0 and is_correct(r"\boxed{3}", "4") == 0.0
    assert math_accuracy(None, [r"\boxed{1,000}", r"\boxed{999}"], answer=["1000", "1000"]) == [1.0, 0.0]


def test_last_boxed_reads_fbox_the_last_box_and_an_unbraced_answer():
    assert last_boxed(r"\fbox{7}") == "7" and last_boxed(r"\fbox{1} then \fbox{2}") == "2"
    assert last_boxed(r"\boxed{1} then \fbox{2}") == "2" and last_boxed(r"\fbox{1} then \boxed{2}") == "2"
    assert last_boxed(r"so \boxed 5 apples") == "5" and last_boxed(r"so \boxed   42$") == "42"
    assert last_boxed(r"so \boxed") is None and last_boxed("so \\boxed  ") is None   # nothing after it
    assert last_boxed(r"\boxed$x$") is None and last_boxed(r"\boxed{unclosed") is None


def test_the_answer_is_read_after_the_last_think_block_trimmed_of_dollars_dots_and_units():
    from grpo.rewards.math_answer import extract_answer

    assert extract_answer("<think>the answer is 5</think> so 6") == "6"
    assert extract_answer("<think>a</think>the answer is 5</think>the answer is 7") == "7"
    assert extract_answer("<think>the answer is 5</think>") == "5"    # nothing after it: the reasoning counts
    assert extract_answer("The final answer is $42$.") == "42" and extract_answer("The answer is 7.") == "7"
    assert extract_answer("The answer is 6 apples.") == "6" and extract_answer("The answer is 6 Apples") == "6"
    assert extract_answer("The answer is x + 1.") == "x + 1"
    assert extract_answer(None) is None and extract_answer("   ") is None


def test_the_reference_is_the_first_of_a_list_the_end_of_a_gsm8k_solution_or_its_box():
    from grpo.rewards.math_answer import _reference

    assert is_correct(r"\boxed{3}", ["3", "4"]) == 1.0 and is_correct(r"\boxed{4}", ["3", "4"]) == 0.0
    assert is_correct(r"\boxed{3}", ("3",)) == 1.0 and is_correct(r"\boxed{3}", []) is None
    assert _reference("so 3 + 4 = 7\n#### 7") == "7" and _reference("x #### 1 #### 3 apples") == "3 apples"
    assert _reference(r"so \boxed{5}.") == "5" and _reference("  ") is None and _reference(None) is None


def test_plain_numbers_in_latex_and_currency_forms():
    from fractions import Fraction

    from grpo.rewards.math_answer import as_number

    assert as_number("$-3$") == -3 and as_number(r"1\!000") == 1000 and as_number("1{,}000") == 1000
    assert as_number(r"\$5") == 5 and as_number("5.") == 5 and as_number("1 / 2") == Fraction(1, 2)
    assert as_number("+5") == 5 and as_number("1,234.5") == Fraction(2469, 2) and as_number("-0.5") == Fraction(-1, 2)
    assert as_number(r"-\frac{1}{2}") == Fraction(-1, 2) and as_number(r"\dfrac{3}{4}") == Fraction(3, 4)
    assert as_number("x") is None and as_number("1/0") is None and as_number("5X") is None and as_number("X5") is None


def test_numbers_are_equal_within_a_millionth_relative():
    assert is_correct(r"\boxed{0.3333333}", "1/3") == 1.0 and is_correct(r"\boxed{0.333}", "1/3") == 0.0
    assert is_correct(r"\boxed{1.000001}", "1") == 1.0 and is_correct(r"\boxed{1.0000011}", "1") == 0.0
    assert is_correct(r"\boxed{2.000002}", "2") == 1.0 and is_correct(r"\boxed{2.0000021}", "2") == 0.0


class _FakeMathVerify:
    """math_verify's parse and verify, recorded: parse gives [text] except for the texts in ``empty``; verify says
    equal when the prediction is ``["$z$"]``."""

    def __init__(self, empty=("\\boxed{z}", "$nogold$")):
        self.calls, self.empty = [], set(empty)

    def parse(self, text, *, parsing_timeout):
        self.calls.append(("parse", text, parsing_timeout))
        return [] if text in self.empty else [text]

    def verify(self, gold, pred, *, timeout_seconds):
        self.calls.append(("verify", gold, pred, timeout_seconds))
        return pred == ["$z$"]


@pytest.fixture
def fake_verify(monkeypatch):
    import grpo.rewards.math_answer as m

    fake = _FakeMathVerify()
    monkeypatch.setattr(m, "_math_verify", lambda: (fake.parse, fake.verify))
    return fake


def test_math_verify_gets_the_boxed_candidate_else_the_bare_one_and_the_timeout(fake_verify):
    assert is_correct(r"\boxed{y}", "x") == 0.0
    assert fake_verify.calls == [("parse", "$x$", 3), ("parse", "\\boxed{y}", 3),
                                 ("verify", ["$x$"], ["\\boxed{y}"], 3)]
    fake_verify.calls.clear()
    assert is_correct(r"\boxed{z}", "$x$", timeout_s=1) == 1.0   # the boxed parse finds nothing: the bare one
    assert fake_verify.calls == [("parse", "$x$", 1), ("parse", "\\boxed{z}", 1), ("parse", "$z$", 1),
                                 ("verify", ["$x$"], ["$z$"], 1)]
    fake_verify.calls.clear()
    assert is_correct(r"\boxed{z}", "nogold", timeout_s=0) == 0.0  # a reference it cannot parse; at least 1 s
    assert fake_verify.calls == [("parse", "$nogold$", 1)]


def test_off_the_main_thread_math_verify_runs_without_a_timeout(fake_verify):
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(is_correct(r"\boxed{y}", "x")))
    t.start()
    t.join()
    assert out == [0.0] and [c[-1] for c in fake_verify.calls] == [None, None, None]


def test_only_what_plain_comparison_cannot_settle_and_is_safe_goes_to_math_verify(fake_verify):
    assert is_correct(r"\boxed{0.5}", "1/2") == 1.0 and is_correct(r"\boxed{2}", "3") == 0.0  # numbers: plain
    assert is_correct(r"\boxed{\text{Yes.}}", "yes") == 1.0 and is_correct(r"\boxed{X}", "x") == 1.0  # text: plain
    assert fake_verify.calls == []
    for cand, ref in [("9^{9^{9}}", "x"), ("x", "2^2^2"), ("10^{123456}", "y"), ("12345!", "y"), ("y" * 401, "x")]:
        assert is_correct(rf"\boxed{{{cand}}}", ref) == 0.0
    assert fake_verify.calls == []                                     # never handed to sympy
    assert is_correct(r"\boxed{" + "y" * 400 + "}", "x") == 0.0 and len(fake_verify.calls) == 3


def test_a_failure_inside_the_comparison_scores_zero(monkeypatch):
    import grpo.rewards.math_answer as m

    def broken():
        raise RuntimeError("sympy broke")

    monkeypatch.setattr(m, "_math_verify", broken)
    assert is_correct(r"\boxed{x}", "y") == 0.0


def test_math_verifys_timeout_notices_are_dropped_and_its_other_messages_kept(caplog):
    import logging

    import grpo.rewards.math_answer  # noqa: F401  (installs the filter)

    with caplog.at_level(logging.WARNING):
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).warning("Timeout is disabled as timeout_seconds is None")
            logging.getLogger(name).warning("could not parse")
    assert [r.getMessage() for r in caplog.records] == ["could not parse", "could not parse"]


def test_math_accuracy_gives_math_verify_its_timeout_three_seconds_by_default(fake_verify):
    assert math_accuracy(None, [r"\boxed{y}"], answer=["x"]) == [0.0]
    assert [c[-1] for c in fake_verify.calls] == [3, 3, 3]
    fake_verify.calls.clear()
    assert math_accuracy(None, [r"\boxed{y}"], answer=["x"], timeout_s=2) == [0.0]
    assert [c[-1] for c in fake_verify.calls] == [2, 2, 2]


def test_the_warm_up_parses_and_verifies_two_equal_forms_without_a_timeout(monkeypatch):
    """The first call of math_verify (its grammar, sympy) is not charged to a sample's timeout: the warm-up runs the
    whole path, parsing and comparing two forms of one number, with every timeout off."""
    import math_verify

    import grpo.rewards.math_answer as m

    seen = []
    parse, verify = math_verify.parse, math_verify.verify

    def spy_parse(text, **kw):
        seen.append(("parse", kw))
        return parse(text, **kw)

    def spy_verify(gold, pred, **kw):
        seen.append(("verify", kw, bool(gold) and bool(pred)))
        out = verify(gold, pred, **kw)
        seen.append(("equal", out))
        return out

    monkeypatch.setattr(math_verify, "parse", spy_parse)
    monkeypatch.setattr(math_verify, "verify", spy_verify)
    assert m._load_math_verify() == (spy_parse, spy_verify)
    assert seen == [("parse", {"parsing_timeout": None}), ("parse", {"parsing_timeout": None}),
                    ("verify", {"timeout_seconds": None}, True), ("equal", True)]
