"""The rollout's shared-prompt decoding for the hybrid families (tests/hybrid_families.py): each prompt prefilled
once, its attention K/V held once (cascade) and its recurrent states copied to each of its G rows, gives the same
next-token logits (to 2e-5) and samples the same tokens as G full copies of the prompt (rollout.share_prompt=false),
ragged prompts (a 1-token one, and one longer than the convolution kernel and the scan chunk)."""

from types import SimpleNamespace

import pytest
import torch

import grpo.rollout.hf as rollout
from grpo.rollout.base import Sampling
from tests.hybrid_families import FAMILIES, tiny_model

torch.set_num_threads(1)
TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)
PROMPTS = [[5, 17, 33, 8, 61, 9, 40, 11, 23], [12], [70, 3, 44]]
NEW = 6
REAL_DECODE, REAL_SAMPLE, REAL_GENERATE = rollout.decode, rollout.sample_tokens, rollout.generate


def _run(model, share, monkeypatch):
    shared, logits = [], []

    def spy(*args, **kw):
        shared.append(kw["shared"])
        return REAL_DECODE(*args, **kw)

    def sample(z, **kw):
        logits.append(z.clone())
        return REAL_SAMPLE(z, **kw)

    monkeypatch.setattr(rollout, "decode", spy)
    monkeypatch.setattr(rollout, "sample_tokens", sample)
    torch.manual_seed(3)
    out = rollout.generate(model, TOKENIZER, PROMPTS, Sampling(NEW), group_size=3, batch_size=3,
                           progress=False, share_prompt=share, min_new_tokens=NEW)
    return out, shared[0], logits


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_decode_matches_full_copies(family, monkeypatch):
    model = tiny_model(family)
    (out, _), shared, logits = _run(model, True, monkeypatch)
    (ref, _), none, ref_logits = _run(model, False, monkeypatch)
    assert none is None
    # the cascade ran; Jamba (refused) and Zamba2 (an attention block shared between layers) fork the cache G times
    assert (shared is None) == (family in ("jamba", "zamba2"))
    assert out == ref
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)
    assert len({tuple(c) for c in out[0]}) > 1  # samples differ inside a group
    with torch.no_grad():  # the first step of every row: its prompt alone through the model's own forward
        first = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS]).repeat_interleave(3, 0)
    torch.testing.assert_close(logits[0], first.index_fill(-1, torch.tensor([2]), float("-inf")), atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_5_text", "bamba"])
def test_hybrid_suffixes_match_whole_contexts(family):
    """Multi-turn contexts (a prompt prefilled once, its K/V and recurrent states copied to each row, each row's own
    suffix prefilled after them) sample the same tokens as every prompt + suffix prefilled whole."""
    model = tiny_model(family)
    suffixes = [[[7, 8], [9, 10, 11, 12, 13], [14]], [[15, 16, 17]], [[18], [19, 20]]]
    out = []
    for share in (True, False):
        torch.manual_seed(4)
        out.append(REAL_GENERATE(model, TOKENIZER, PROMPTS, Sampling(NEW), group_size=1, batch_size=2,
                                 progress=False, share_prompt=share, min_new_tokens=NEW, suffixes=suffixes))
    assert out[0] == out[1]
    assert [len(g) for g in out[0][0]] == [3, 1, 2]
