"""grpo/rewards/length.py: DAPO's soft overlong penalty."""
import pytest

from grpo.rewards.length import overlong_penalty


def test_zero_then_linear_then_the_full_penalty():
    ids = [[0] * n for n in (10, 12, 14, 16, 20)]
    out = overlong_penalty(None, [""] * 5, max_len=16, buffer_len=4, completion_ids=ids)
    assert out == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
