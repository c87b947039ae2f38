"""grpo/engine/prefix_attention.py's `layer_extras`: what a layer adds to ``q k^T * scaling``, read as the model's
eager attention gets it (the family tests in tests/engine/test_families.py run whole models through it)."""
from __future__ import annotations

import pytest

from grpo.engine.prefix_attention import layer_extras
from grpo.engine.score_attention import ScoreExtras


class _Windowed:
    sliding_window = 4  # a family that windows through the mask alone: the layer's attribute


def test_the_window_softcap_and_sinks_come_from_the_call_or_the_layer():
    sinks = object()
    assert layer_extras(_Windowed(), {"softcap": 30.0, "s_aux": sinks}, 10) == ScoreExtras(4, 30.0, sinks)
    assert layer_extras(_Windowed(), {"sliding_window": 6}, 10) == ScoreExtras(6)  # the call's window wins
    assert layer_extras(_Windowed(), {}, 5).window == 4  # the longest sequence sees 4 back: the window cuts
    assert layer_extras(_Windowed(), {}, 4).window is None  # it sees at most 3 back: inactive
    assert layer_extras(_Windowed(), {}).window == 4  # decoding: no longest sequence known
    assert layer_extras(object(), {"sliding_window": None}, 10) == ScoreExtras()


def _forward(module, scaling=None, layout_kw=True, **kw):
    import torch

    from grpo.engine.layout import ACTIVE, build_layout
    from grpo.engine.prefix_attention import LAYOUT_KWARG, prefix_attention_forward

    layout = build_layout([[1, 2, 3], [4, 5]], [[[6, 7], [8]], [[9, 10, 11]]], "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, layout.n_tokens, 8, generator=gen) for h in (4, 2, 2))
    token = None if layout_kw else ACTIVE.set(layout)
    try:
        out, _ = prefix_attention_forward(module, q, k, v, None, scaling, **kw,
                                          **({LAYOUT_KWARG: layout} if layout_kw else {}))
    finally:
        if token is not None:
            ACTIVE.reset(token)
    return out


def test_the_forward_takes_its_layout_either_way_and_scales_by_the_head_dim_by_default():
    from types import SimpleNamespace

    import torch

    plain, windowed = SimpleNamespace(training=False), SimpleNamespace(training=False, sliding_window=2)
    want = _forward(plain, scaling=8 ** -0.5)
    torch.testing.assert_close(_forward(plain), want)  # scaling None: 1 / sqrt(head dim)
    torch.testing.assert_close(_forward(plain, layout_kw=False), want)  # the layout from the context
    train = SimpleNamespace(training=True)
    torch.testing.assert_close(_forward(train), want)  # no dropout asked: none applied
    assert (_forward(windowed) - want).abs().max() > 1e-3  # the layer's own window (2 < the longest, 5) acts


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flex_branch_scales_as_asked_and_refuses_dropout_in_training():
    """A layout with a block mask runs the flex kernel: at the caller's scaling (1 / sqrt(head dim) when none), the
    same attention as the grouped kernel; attention dropout while training is refused, in eval it is off."""
    from types import SimpleNamespace

    import torch

    from grpo.engine.flex_kernel import build_block_mask, flex_available
    from grpo.engine.layout import build_layout
    from grpo.engine.prefix_attention import LAYOUT_KWARG, prefix_attention_forward

    if not flex_available():
        pytest.skip("this torch has no FlexAttention")
    plain, train = SimpleNamespace(training=False), SimpleNamespace(training=True)
    layout = build_layout([[1, 2, 3], [4, 5]], [[[6, 7], [8]], [[9, 10, 11]]], "cpu")
    layout.block_mask = build_block_mask(layout, block=4)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, layout.n_tokens, 8, generator=gen) for h in (4, 2, 2))

    def flex(module, scaling=None, **kw):
        return prefix_attention_forward(module, q, k, v, None, scaling, **kw, **{LAYOUT_KWARG: layout})[0]

    for scaling in (0.2, 8 ** -0.5):  # the grouped kernel (no block mask) at the same scaling
        torch.testing.assert_close(flex(plain, scaling), _forward(plain, scaling=scaling), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex(plain), _forward(plain, scaling=8 ** -0.5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex(plain, 0.2, dropout=0.5), _forward(plain, scaling=0.2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex(train, 0.2, dropout=0.0), _forward(plain, scaling=0.2), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="no attention dropout"):
        flex(train, 0.2, dropout=0.1)
