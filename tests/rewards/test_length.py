"""grpo/rewards/length.py: DAPO's soft overlong penalty."""
import pytest

from grpo.rewards.length import overlong_penalty


def test_zero_then_linear_then_the_full_penalty():
    ids = [[0] * n for n in (10, 12, 14, 16, 20)]
    out = overlong_penalty(None, [""] * 5, max_len=16, buffer_len=4, completion_ids=ids)
    assert out == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_without_token_ids_the_length_is_the_word_count_and_zero_for_a_non_text_completion():
    assert overlong_penalty(None, [None, "a b c d e", "a b"], max_len=4, buffer_len=4) == \
        pytest.approx([0.0, -1.0, -0.5])
