"""grpo/rewards/repetition.py: the share of repeated n-grams, as a penalty in [max_penalty, 0]."""
import pytest

from grpo.rewards.repetition import repeated_fraction, repetition_penalty


def test_repeated_fraction_counts_n_grams_seen_before():
    assert repeated_fraction([1, 2, 3, 4], 2) == 0.0
    assert repeated_fraction([1, 2, 1, 2, 1, 2], 2) == pytest.approx(1 - 2 / 5)
    assert repeated_fraction([1], 3) == 0.0


def test_the_penalty_scales_the_fraction_and_refuses_a_positive_cap():
    out = repetition_penalty(None, ["a b a b a b", "a b c d"], ngram_size=2, max_penalty=-0.5, unit="words")
    assert out == pytest.approx([-0.5 * (1 - 2 / 5), 0.0])
    with pytest.raises(ValueError, match="max_penalty <= 0"):
        repetition_penalty(None, ["x"], max_penalty=1.0)
