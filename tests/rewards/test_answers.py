"""The answers maj@k votes on: each built-in reward's own reading and normalisation of a completion."""
from grpo.rewards.answers import needs_answer, vote_key
from grpo.rewards.score import build


def test_arithmetic_votes_on_the_integer_it_reads():
    key = vote_key("arithmetic", {})
    assert key("so 3 + 4 = 7.") == key(" 7") == 7 and key("no number") is None
    strict = vote_key("arithmetic", {"strict": True})
    assert strict("7") == 7 and strict("it is 7") is None        # strict reads only a bare number, as it scores


def test_math_votes_on_equal_values():
    key = vote_key("math_accuracy", {})
    assert key("The answer is \\boxed{\\frac{1}{2}}") == key("so 0.5") == key("answer: 1/2")
    assert key("\\boxed{x+1}") == key("\\boxed{ x + 1 }") != key("\\boxed{x+2}")
    assert key("") is None


def test_exact_match_votes_only_in_exact_mode():
    assert vote_key("exact_match", {})("The answer is: Paris.") == vote_key("exact_match", {})("paris")
    assert vote_key("exact_match", {"mode": "contains"}) is None
    assert vote_key("countdown", {}) is None and vote_key("number_only", {}) is None


def test_which_rewards_read_the_answer():
    got = {rf.name: needs_answer(rf.fn) for rf in build({"a": {"fn": "arithmetic"}, "m": {"fn": "math_accuracy"},
                                                          "f": {"fn": "number_only"}, "t": {"fn": "tag_count"}})}
    assert got == {"a": True, "m": True, "f": False, "t": False}


def test_exact_match_votes_on_the_normal_form_and_none_without_an_answer():
    key = vote_key("exact_match", {"mode": "exact"})
    assert key("<think>x</think>The answer is: The Eiffel Tower.") == "eiffel tower"
    assert key("Paris") != key("Rome") and key("") is None and key("The.") is None   # nothing left to vote on


def test_a_verl_function_reads_the_answer_and_an_unreadable_signature_does_not(tmp_path, monkeypatch):
    from grpo.rewards import resolve

    (tmp_path / "verl_fns.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                          "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert needs_answer(resolve("verl_fns:score"))
    assert not needs_answer(max)                       # a builtin whose signature inspect cannot read
    assert needs_answer(lambda prompts, completions, answer: []) and not needs_answer(lambda p, c, **kw: [])
