"""grpo/rollout/base.py: what a backend is asked (Sampling, frozen) and returns (Completions)."""
import dataclasses

import pytest

from grpo.rollout.base import Completions, Sampling


def test_sampling_means_the_same_for_every_backend_and_is_frozen():
    s = Sampling(16)
    assert (s.temperature, s.top_p, s.top_k, s.greedy) == (1.0, 1.0, 0, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_new_tokens = 3
    assert Completions([[[1, 2]]], [[False]]).logprobs is None  # the trainer's own log-probs
