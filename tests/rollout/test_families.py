"""The rollout's shared-prompt (cascade) decoding for every family of tests/prefix_families.py: each prompt's K/V held
once while its G samples decode gives the same next-token logits (to 2e-5) and samples the same tokens as G full
copies of the prompt (rollout.share_prompt=false), ragged prompts (a 1-token prompt included), sliding windows
shorter than prompt + completion."""

from types import SimpleNamespace

import pytest
import torch

import grpo.rollout.hf as rollout
from grpo.rollout.base import Sampling
from tests.prefix_families import EAGER_ONLY, FAMILIES, WINDOW, tiny_model

torch.set_num_threads(1)
TOKENIZER = SimpleNamespace(eos_token_id=2, pad_token_id=0)
PROMPTS = [[5, 17, 33, 8, 61, 9, 40], [12], [70, 3, 44]]
NEW = 8  # 7 + 8 tokens: longer than WINDOW


@pytest.mark.parametrize("family,impl", [(f, i) for f in FAMILIES for i in ("eager", "sdpa")
                                         if i == "eager" or f not in EAGER_ONLY])
def test_cascade_decode_matches_full_copies(family, impl, monkeypatch):
    model = tiny_model(family, impl)
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
        out.append(rollout.generate(model, TOKENIZER, PROMPTS, Sampling(NEW), group_size=3, batch_size=3,
                                    progress=False, share_prompt=share, min_new_tokens=NEW))
    assert shared[0] is not None and shared[0].calls >= model.config.num_hidden_layers  # the cascade ran
    assert shared[1] is None
    assert max(map(len, PROMPTS)) + NEW > WINDOW
    assert out[0] == out[1]
    assert len(logits[True]) == len(logits[False]) == NEW
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)  # EOS: -inf in both (min_new_tokens)
    assert len({tuple(c) for c in out[0][0][0]}) > 1  # samples differ inside a group


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (3, None, False), (6, None, False),
                                                   (None, 0.5, False), (None, None, True), (4, 0.7, True)])
def test_decode_attention_extras_match_eager_attention_over_the_whole_row(window, softcap, sinks):
    """One decoding step of ``grpo_prefix_decode`` with a layer's window, soft-cap and sinks equals eager attention
    of each row over its whole context [prompt; own tokens] (large random scores, so that every extra bites; a
    sliding-window layer's cache keeping only the last window - 1 prompt slots)."""
    from grpo.engine.decode_attention import SharedPrefixKV, prefix_decode_attention_forward

    g = torch.Generator().manual_seed(0)
    B, G, Hkv, rep, D, slots, own = 2, 3, 2, 2, 8, 6, 2
    lens = [6, 2]  # prompt slots in use (left-padded)
    valid = torch.arange(slots)[None, :] >= slots - torch.tensor(lens)[:, None]
    q = 2 * torch.randn(B * G, Hkv * rep, 1, D, generator=g)
    kp, vp = 2 * torch.randn(B, Hkv, slots, D, generator=g), torch.randn(B, Hkv, slots, D, generator=g)
    ko, vo = 2 * torch.randn(B * G, Hkv, own, D, generator=g), torch.randn(B * G, Hkv, own, D, generator=g)
    sink = torch.randn(Hkv * rep, generator=g) if sinks else None
    kept = slots if window is None else window - 1  # what a sliding-window cache layer holds of the prompt
    prefix = SharedPrefixKV(keys=[kp[:, :, slots - kept:]], values=[vp[:, :, slots - kept:]], valid=valid, group=G)
    module = SimpleNamespace(layer_idx=0, training=False)
    out, _ = prefix_decode_attention_forward(module, q, ko, vo, None, scaling=0.4, sliding_window=window,
                                             softcap=softcap, s_aux=sink, grpo_shared_prefix=prefix)
    for r in range(B * G):
        b = r // G
        k = torch.cat([kp[b][:, valid[b]], ko[r]], dim=1).repeat_interleave(rep, 0)  # (H, L, D)
        v = torch.cat([vp[b][:, valid[b]], vo[r]], dim=1).repeat_interleave(rep, 0)
        s = q[r] @ k.transpose(-1, -2) * 0.4  # (H, 1, L)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        back = torch.arange(k.shape[1] - 1, -1, -1)
        if window is not None:
            s = s.masked_fill(back >= window, float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.view(-1, 1, 1)], dim=-1)
        a = torch.softmax(s, dim=-1)[..., : k.shape[1]]
        torch.testing.assert_close(out[r, 0], (a @ v)[:, 0], atol=1e-5, rtol=1e-5)
