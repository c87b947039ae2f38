"""The rollout's shared-prompt (cascade) decoding for every family of tests/prefix_families.py: each prompt's K/V held
once while its G samples decode gives the same next-token logits (to 2e-5) and samples the same tokens as G full copies of the prompt (rollout.share_prompt=false),
ragged prompts (a 1-token prompt included), sliding windows shorter than prompt + completion."""

from types import SimpleNamespace

import pytest
import torch

import grpo.rollout as rollout
from tests.prefix_families import FAMILIES, WINDOW, tiny_model

torch.set_num_threads(1)
TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)
PROMPTS = [[5, 17, 33, 8, 61, 9, 40], [12], [70, 3, 44]]
NEW = 8  # 7 + 8 tokens: longer than WINDOW


@pytest.mark.parametrize("family", FAMILIES)
def test_cascade_decode_matches_full_copies(family, monkeypatch):
    model = tiny_model(family, "eager")
    shared = []
    real_decode = rollout.decode

    def spy(*args, **kw):
        shared.append(kw["shared"])
        return real_decode(*args, **kw)

    logits = {True: [], False: []}
    real_sample = rollout.sample_tokens

    def sample(z, **kw):  # every step's next-token logits, to compare the two paths on more than the tokens
        logits[share].append(z.clone())
        return real_sample(z, **kw)

    monkeypatch.setattr(rollout, "decode", spy)
    monkeypatch.setattr(rollout, "sample_tokens", sample)
    out = []
    for share in (True, False):
        torch.manual_seed(3)
        out.append(rollout.generate(model, TOKENIZER, PROMPTS, group_size=3, max_new_tokens=NEW, batch_size=3,
                                    progress=False, share_prompt=share, min_new_tokens=NEW))
    assert shared[0] is not None and shared[0].calls >= model.config.num_hidden_layers  # the cascade ran
    assert shared[1] is None
    assert max(map(len, PROMPTS)) + NEW > WINDOW
    assert out[0] == out[1]
    assert len(logits[True]) == len(logits[False]) == NEW
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)  # EOS: -inf in both (min_new_tokens)
    assert len({tuple(c) for c in out[0][0][0]}) > 1  # samples differ inside a group
