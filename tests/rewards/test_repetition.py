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


def test_the_smallest_n_gram_and_cap_and_what_each_unit_reads():
    assert repetition_penalty(None, ["a a b"], ngram_size=1, unit="words") == pytest.approx([-1 / 3])
    assert repetition_penalty(None, ["a a a a"], max_penalty=0.0, unit="words") == [0.0]  # 0 is allowed
    with pytest.raises(ValueError, match="ngram_size >= 1, got 0"):
        repetition_penalty(None, ["x"], ngram_size=0)
    # a completion that is not text reads as empty, in every unit
    assert repetition_penalty(None, [None, None], ngram_size=1, unit="chars") == [0.0, 0.0]
    assert repetition_penalty(None, [None], unit="words") == [0.0]
    # words are the words even where token ids are given; tokens use the ids
    ids = [[7, 7, 7, 7]]
    assert repetition_penalty(None, ["a b c d"], ngram_size=1, unit="words", completion_ids=ids) == [0.0]
    assert repetition_penalty(None, ["a b c d"], ngram_size=1, completion_ids=ids) == pytest.approx([-0.75])
    # words are lower-cased (not upper-cased: "ß" and "ss" are two words)
    assert repetition_penalty(None, ["Straße strasse STRASSE"], ngram_size=1, unit="words") == \
        pytest.approx([-1 / 3])


def test_by_default_trigrams_of_words_without_token_ids_cost_up_to_one():
    assert repetition_penalty(None, ["a b c a b c"]) == pytest.approx([-0.25])  # abc, bca, cab, abc
