"""grpo/rewards/score.py: every function on every sample, weighted; a failing sample scores None, not 0."""
import pytest

from grpo.rewards.score import RewardFunction, score


def test_weighted_total_skips_a_failed_sample_and_counts_the_error():
    def half(prompts, completions, **_):
        return [0.5] * len(completions)

    def flaky(prompts, completions, **_):
        return [1.0, None, 1.0]

    def raises(prompts, completions, **_):
        raise ZeroDivisionError("boom")

    fns = [RewardFunction("a", half, 2.0), RewardFunction("b", flaky, 1.0), RewardFunction("c", raises, 5.0)]
    s = score(fns, ["p"] * 3, ["x", "y", "z"], {})
    assert s.total == pytest.approx([2.0, 1.0, 2.0]) and s.per_fn["b"] == [1.0, None, 1.0]
    assert s.per_fn["c"] == [None] * 3 and s.errors == {"a": 0, "b": 0, "c": 3}  # None returned is no error
