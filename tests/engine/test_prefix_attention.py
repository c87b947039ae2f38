"""grpo/engine/prefix_attention.py's `layer_extras`: what a layer adds to ``q k^T * scaling``, read as the model's
eager attention gets it (the family tests in tests/engine/test_families.py run whole models through it)."""
from __future__ import annotations

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
