"""grpo/engine/decode_attention.py on its own: one decoding step of G rows per prompt against the prompt's single
K/V equals eager attention over each row's whole sequence, with each extra a family adds (a sliding window, the logit
soft-cap, attention sinks, MLA's expanded latents) and the default scaling."""
from __future__ import annotations

import pytest
import torch

from grpo.engine.decode_attention import DECODE_KWARG, SharedPrefixKV, prefix_decode_attention_forward

B, G, HKV, REP, W, T, D = 2, 3, 2, 2, 5, 3, 8  # prompts, rows per prompt, kv heads, heads per kv head, slots, own


class _Layer:
    layer_idx = 0


class _MLALayer(_Layer):
    """Caches compressed latents: expands the prompt's keys and values (here: scaled), counting the calls."""

    def __init__(self):
        self.expansions = 0

    def expand_kv(self, k, v):
        self.expansions += 1
        return k * 2.0, v * 3.0


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    valid = torch.tensor([[True] * W, [False, False] + [True] * (W - 2)])  # the second prompt is shorter
    return r(B * G, HKV * REP, 1, D), r(B, HKV, W, D), r(B, HKV, W, D), r(B * G, HKV, T, D), r(B * G, HKV, T, D), valid


def _eager(q, kp, vp, k, v, valid, scaling, window=None, softcap=None, sinks=None):
    """Each row r: its prompt's valid slots, then its own T tokens, at positions 0, 1, ...; the query is the last."""
    out = []
    for row in range(B * G):
        b, keep = row // G, valid[row // G]
        keys = torch.cat([kp[b][:, keep], k[row]], 1).repeat_interleave(REP, 0)  # (H, L, D)
        vals = torch.cat([vp[b][:, keep], v[row]], 1).repeat_interleave(REP, 0)
        s = (q[row] @ keys.transpose(-1, -2))[:, 0] * scaling  # (H, L)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if window is not None:
            pos = torch.arange(s.shape[-1])
            s = s.masked_fill(pos[-1] - pos >= window, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks[:, None]], -1)
        a = s.softmax(-1)[:, :keys.shape[1]]
        out.append(torch.einsum("hl,hld->hd", a, vals)[None])  # (1, H, D)
    return torch.stack(out)  # (R, 1, H, D)


@pytest.mark.parametrize("extras", [{}, {"sliding_window": 4}, {"softcap": 1.5}, {"s_aux": True}],
                         ids=["plain", "window", "softcap", "sinks"])
def test_one_decoding_step_equals_eager_attention_over_each_rows_sequence(extras):
    q, kp, vp, k, v, valid = _case()
    prefix = SharedPrefixKV([kp], [vp], valid, G)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if extras.get("s_aux") else None
    kwargs = {**extras, "s_aux": sinks} if sinks is not None else extras
    got, _ = prefix_decode_attention_forward(_Layer(), q, k, v, None, **kwargs, **{DECODE_KWARG: prefix})
    want = _eager(q, kp, vp, k, v, valid, D ** -0.5, extras.get("sliding_window"), extras.get("softcap"), sinks)
    assert got.shape == (B * G, 1, HKV * REP, D) and prefix.calls == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mla_expands_the_prompts_latents_once_per_layer():
    q, kp, vp, k, v, valid = _case(1)
    prefix, layer = SharedPrefixKV([kp], [vp], valid, G), _MLALayer()
    for _ in range(2):  # two decoding steps
        got, _ = prefix_decode_attention_forward(layer, q, k, v, None, scaling=0.3, **{DECODE_KWARG: prefix})
    assert layer.expansions == 1 and prefix.calls == 2
    torch.testing.assert_close(got, _eager(q, kp * 2.0, vp * 3.0, k, v, valid, 0.3), rtol=1e-5, atol=1e-5)


class _WindowedLayer(_Layer):
    sliding_window = 4  # a family that windows through the mask alone: the layer's attribute


def test_a_layers_own_window_and_bfloat16():
    q, kp, vp, k, v, valid = _case(2)
    got, _ = prefix_decode_attention_forward(_WindowedLayer(), q, k, v, None, **{DECODE_KWARG: SharedPrefixKV(
        [kp], [vp], valid, G)})
    torch.testing.assert_close(got, _eager(q, kp, vp, k, v, valid, D ** -0.5, window=4), rtol=1e-5, atol=1e-5)
    half = [t.bfloat16() for t in (q, kp, vp, k, v)]
    got, _ = prefix_decode_attention_forward(_Layer(), half[0], half[3], half[4], None, **{
        DECODE_KWARG: SharedPrefixKV([half[1]], [half[2]], valid, G)})
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _eager(q, kp, vp, k, v, valid, D ** -0.5), rtol=3e-2, atol=3e-2)
