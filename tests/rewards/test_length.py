"""grpo/rewards/length.py: DAPO's soft overlong penalty."""
import pytest

from grpo.rewards.length import cosine_length, overlong_penalty


def test_zero_then_linear_then_the_full_penalty():
    ids = [[0] * n for n in (10, 12, 14, 16, 20)]
    out = overlong_penalty(None, [""] * 5, max_len=16, buffer_len=4, completion_ids=ids)
    assert out == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_without_token_ids_the_length_is_the_word_count_and_zero_for_a_non_text_completion():
    assert overlong_penalty(None, [None, "a b c d e", "a b"], max_len=4, buffer_len=4) == \
        pytest.approx([0.0, -1.0, -0.5])


def _ids(*lengths):
    return [[0] * n for n in lengths]


def test_the_default_buffer_is_a_quarter_of_max_len_rounded_down_and_the_penalty_scales_linearly():
    # max_len 10: buffer 2 (not 2.5), the penalty falling from length 8
    assert overlong_penalty(None, [""] * 3, max_len=10, completion_ids=_ids(8, 9, 10)) == pytest.approx([0, -0.5, -1])
    # max_len 16: buffer 4 (not 16 // 5 = 3); penalty_factor multiplies
    assert overlong_penalty(None, [""] * 3, max_len=16, penalty_factor=2.0, completion_ids=_ids(12, 14, 17)) == \
        pytest.approx([0.0, -1.0, -2.0])


def test_the_smallest_max_len_and_buffer_are_one_and_zero_of_either_is_refused():
    assert overlong_penalty(None, [""] * 3, max_len=1, buffer_len=1, completion_ids=_ids(0, 1, 2)) == [0.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="needs max_len > 0"):
        overlong_penalty(None, [""], max_len=0, buffer_len=1)
    with pytest.raises(ValueError, match="0 < buffer_len <= max_len, got 0"):
        overlong_penalty(None, [""], max_len=8, buffer_len=0)


def test_cosine_length_by_default_spans_1024_tokens():
    out = cosine_length(None, ["\\boxed{4}", "\\boxed{5}"], answer=["4", "4"], completion_ids=_ids(512, 512))
    assert out == pytest.approx([0.75, -0.25])  # half way down from 1.0 to 0.5, and up from -0.5 to 0


def test_cosine_length_of_max_len_one_and_zero_and_of_rows_without_a_reference():
    assert cosine_length(None, ["\\boxed{4}"], answer=["4"], max_len=1, completion_ids=_ids(1)) == [0.5]
    with pytest.raises(ValueError, match="needs max_len > 0"):
        cosine_length(None, ["\\boxed{4}"], answer=["4"], max_len=0, completion_ids=_ids(1))
    assert cosine_length(None, ["a", "b"]) == [None, None]


def test_the_exceed_penalty_scores_only_the_truncated_and_every_completion_after_one_is_scored():
    kw = dict(answer=["4", "4", "4"], max_len=4, exceed_penalty=-2.0, completion_ids=_ids(4, 4, 0))
    assert cosine_length(None, ["\\boxed{4}"] * 3, truncated=[True, False, False], **kw) == \
        pytest.approx([-2.0, 0.5, 1.0])
    assert cosine_length(None, ["\\boxed{4}"] * 3, **kw) == pytest.approx([0.5, 0.5, 1.0])  # truncated not given
