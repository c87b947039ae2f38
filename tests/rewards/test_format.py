"""grpo/rewards/format.py: the think/answer structure, strict or lenient, and the shaped tag count."""
from grpo.rewards.format import format_reward, tag_count, tag_score

GOOD = "<think>\nsteps\n</think>\n<answer>\n4\n</answer>"


def test_structure_strict_and_lenient():
    assert format_reward(None, [GOOD, "pre " + GOOD, "<answer>4</answer>"]) == [1.0, 1.0, 0.0]
    assert format_reward(None, [GOOD, "pre " + GOOD], strict=True) == [1.0, 0.0]


def test_a_completion_that_is_not_text_has_no_structure():
    assert format_reward(None, [None]) == [0.0] and format_reward(None, [None], strict=True) == [0.0]
    assert tag_count(None, [None]) == [0.0] and tag_count(None, [None], think_in_prompt=True) == [0.25]


def test_tag_score_counts_each_tag_once_and_in_order():
    assert tag_score(GOOD) == 1.0 and tag_score("<answer>4</answer>") == 0.5
    assert tag_score("</think><think>") == 0.25 and tag_score("<think><think>") == 0.0
