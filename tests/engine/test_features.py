"""grpo/engine/features.py over stand-in models (a config and modules whose forward source is all the detection
reads): which features are found, which are served and which refused, with what reason. The real families are
tests/engine/test_families.py's (model forwards)."""
import pytest
import torch

from grpo.engine import features as F
from grpo.engine.features import attention_modules, mixing_layers, model_features


class Cfg:
    def __init__(self, **kw):
        self.num_hidden_layers, self.num_attention_heads = 2, 4
        self.__dict__.update(kw)


class ThroughAttention(torch.nn.Module):
    def __init__(self, i, **attrs):
        super().__init__()
        self.layer_idx = i
        self.__dict__.update(attrs)

    def forward(self, x):
        return "ALL_ATTENTION_FUNCTIONS", x  # the word is what the detection reads in the source


class BypassAttention(ThroughAttention):
    def forward(self, x):
        return x


class HandedOver(torch.nn.Module):  # a recurrent layer in transformers' linear-attention cache
    def __init__(self, i):
        super().__init__()
        self.layer_idx = i

    def forward(self, x, cache_params=None):
        return "get_conv_state get_recurrent_state initial_state", x


class ForeignStateAttention(torch.nn.Module):  # named *Attention, but a recurrent state kept its own way
    def __init__(self, i):
        super().__init__()
        self.layer_idx = i

    def forward(self, x):
        return "ssm_state", x


class Model(torch.nn.Module):
    def __init__(self, cfg, *layers):
        super().__init__()
        self.config, self.layers = cfg, torch.nn.ModuleList(layers)


def _llama(**kw):
    return Model(Cfg(**kw), ThroughAttention(0), ThroughAttention(1))


def test_attention_modules_and_mixing_layers():
    a, b, s, f = ThroughAttention(0), BypassAttention(1), HandedOver(2), ForeignStateAttention(3)
    unnumbered = ThroughAttention(0)
    del unnumbered.layer_idx
    m = Model(Cfg(), a, b, s, f, unnumbered)
    assert attention_modules(m) == [a, b]
    assert mixing_layers(Cfg(num_hidden_layers=5, layer_types=["mlp", "full_attention", "moe", "mamba", "moe"])) == 2
    assert mixing_layers(Cfg(num_hidden_layers=3, layer_types=None)) == 3
    bare = Cfg()
    del bare.num_hidden_layers
    assert mixing_layers(bare) == 1


def test_whether_a_layer_goes_through_the_interface_is_read_from_its_forward():
    assert F._uses_interface(ThroughAttention) and not F._uses_interface(BypassAttention)
    made = type("MadeAttention", (torch.nn.Module,), {"forward": eval("lambda self, x: x")})  # no source file
    assert not F._uses_interface(made)
    assert not F._uses_interface(type("NoForward", (), {"forward": len}))  # a builtin: no source (TypeError)


def test_each_served_feature_is_found_on_the_config_or_the_modules():
    has = lambda name, cfg, attn=(): F.SERVED[name](cfg, list(attn))  # noqa: E731
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        assert has("mixture of experts", Cfg(**{key: 2})) and not has("mixture of experts", Cfg(**{key: 1}))
        assert not has("mixture of experts", Cfg(**{key: None}))
    assert not has("mixture of experts", Cfg())
    w = "sliding-window layers"
    assert has(w, Cfg(sliding_window=4)) and has(w, Cfg(sliding_window=4, layer_types=["sliding_attention"]))
    assert not has(w, Cfg(sliding_window=4, layer_types=["full_attention"])) and not has(w, Cfg(sliding_window=0))
    assert not has(w, Cfg()) and not has(w, Cfg(sliding_window=None, layer_types=None))
    s = "attention logit soft-capping"
    assert has(s, Cfg(attn_logit_softcapping=50.0)) and not has(s, Cfg()) and has(s, Cfg(attn_logit_softcapping=0))
    assert has("attention sinks", Cfg(), [ThroughAttention(0, sinks=1)]) and not has("attention sinks", Cfg(),
                                                                                      [ThroughAttention(0)])
    for n in ("q_norm", "q_layernorm", "query_norm"):
        assert has("QK-norm", Cfg(), [ThroughAttention(0), ThroughAttention(1, **{n: 1})])
    assert not has("QK-norm", Cfg(), [ThroughAttention(0, k_norm=1)])
    p = "partial rotary"
    assert has(p, Cfg(partial_rotary_factor=0.5)) and not has(p, Cfg(partial_rotary_factor=1.0))
    assert has(p, Cfg(rope_parameters={"partial_rotary_factor": 0.25})) and not has(p, Cfg(rope_parameters={}))
    assert not has(p, Cfg(rope_parameters="linear")) and not has(p, Cfg())
    assert has(p, Cfg(partial_rotary_factor=None, rope_parameters={"partial_rotary_factor": 0.5}))
    assert not has(p, Cfg(rope_parameters={"partial_rotary_factor": 1}))
    assert has("NoPE layers", Cfg(no_rope_layers=[1, 0, 1])) and not has("NoPE layers", Cfg(no_rope_layers=[1, 1]))
    assert not has("NoPE layers", Cfg(no_rope_layers=[])) and not has("NoPE layers", Cfg())
    assert has("multi-head latent attention", Cfg(kv_lora_rank=0)) and not has("multi-head latent attention", Cfg())
    g, attn = "grouped-query attention", [ThroughAttention(0)]
    assert has(g, Cfg(num_key_value_heads=2), attn) and not has(g, Cfg(num_key_value_heads=4), attn)
    assert not has(g, Cfg(num_key_value_heads=None), attn) and not has(g, Cfg(), attn)
    assert not has(g, Cfg(num_key_value_heads=2)) and has(g, Cfg(num_attention_heads=6, num_key_value_heads=3), attn)
    assert not has(g, Cfg(num_attention_heads=5, num_key_value_heads=3), attn)  # 5 // 3 = 1: one query head each


def test_the_served_features_of_a_model_in_their_order():
    assert model_features(_llama()) == ([], None)
    assert model_features(_llama(num_key_value_heads=2, num_experts=4, kv_lora_rank=8)) == (
        ["mixture of experts", "multi-head latent attention", "grouped-query attention"], None)
    hybrid = Model(Cfg(layer_types=["linear_attention", "full_attention"], num_key_value_heads=2), HandedOver(0),
                   ThroughAttention(1))
    assert model_features(hybrid) == (["recurrent layers (state handed over from the prompt)",
                                       "grouped-query attention"], None)


def test_what_is_refused_and_the_reason_named():
    assert model_features(_llama(is_encoder_decoder=True)) == ([], "an encoder-decoder")
    assert model_features(_llama(is_encoder_decoder=False))[1] is None
    for key, reason in (("attention_chunk_size", "chunked attention (attention_chunk_size)"),
                        ("use_bidirectional_attention", "bidirectional attention"), ("alibi", "ALiBi position biases"),
                        ("attn_temperature_tuning",
                         "position-dependent attention temperature (attn_temperature_tuning)")):
        assert model_features(_llama(**{key: 8})) == ([], reason)
        assert model_features(_llama(**{key: 0}))[1] is None
    # the first refusal wins
    assert model_features(_llama(alibi=True, attention_chunk_size=8))[1].startswith("chunked attention")
    assert model_features(_llama(is_encoder_decoder=True, alibi=True))[1] == "an encoder-decoder"


def test_layers_of_other_types_and_recurrent_layers_kept_their_own_way():
    mamba = Model(Cfg(layer_types=["mamba", "full_attention", "mlp", "conv"], num_hidden_layers=4), HandedOver(0),
                  ThroughAttention(1))
    assert model_features(mamba)[1] == "layers of type conv"
    two = Model(Cfg(layer_types=["mamba", "full_attention", "xlstm", "conv"], num_hidden_layers=4),
                ThroughAttention(1))
    assert model_features(two)[1] == "layers of type conv, mamba, xlstm"
    foreign = Model(Cfg(), ThroughAttention(0), ForeignStateAttention(1))
    assert model_features(foreign)[1] == ("layers of type recurrent (ForeignStateAttention: a recurrent state "
                                          "outside transformers' linear-attention cache)")
    other = type("OtherStateMixer", (ForeignStateAttention,), {"forward": lambda self, x: ("conv_state", x)})
    both = Model(Cfg(), ThroughAttention(0), ForeignStateAttention(1), other(2))
    assert model_features(both)[1] == ("layers of type recurrent (ForeignStateAttention: a recurrent state outside "
                                       "transformers' linear-attention cache; OtherStateMixer: a recurrent state "
                                       "outside transformers' linear-attention cache)")
    typed = Model(Cfg(layer_types=["full_attention", "lightning"]), ThroughAttention(0), ForeignStateAttention(1))
    assert model_features(typed)[1].startswith("layers of type lightning (ForeignStateAttention: ")
    assert F._layer_types(Cfg(layer_types=None), [], [], []) is None


def test_attention_that_bypasses_the_interface_is_refused_with_its_count():
    msg = "attention that does not go through transformers' AttentionInterface in every layer ({} of {} layers do)"
    assert model_features(Model(Cfg(), ThroughAttention(0), BypassAttention(1)))[1] == msg.format(1, 2)
    assert model_features(Model(Cfg(), ThroughAttention(0)))[1] == msg.format(1, 2)  # a layer without attention
    assert model_features(Model(Cfg(num_hidden_layers=0)))[1] == msg.format(0, 0)  # nothing at all
    assert model_features(Model(Cfg(), ThroughAttention(0), ThroughAttention(1, is_causal=False)))[1] == \
        msg.format(1, 2)
    assert model_features(Model(Cfg(), ThroughAttention(0), ThroughAttention(1, is_causal=True)))[1] is None
    three = Model(Cfg(num_hidden_layers=2), ThroughAttention(0), ThroughAttention(1), ThroughAttention(2))
    assert model_features(three)[1] is None  # more attention modules than layers (shared blocks) are fine
    states = Model(Cfg(layer_types=["linear_attention", "linear_attention"]), HandedOver(0), HandedOver(1))
    assert model_features(states) == (["recurrent layers (state handed over from the prompt)"], None)


@pytest.mark.parametrize("key", ["is_encoder_decoder", "alibi"])
def test_a_flag_names_its_feature_only_when_set(key):
    check = F._flag(key, "it")
    assert check(Cfg(**{key: True}), [], [], []) == "it" and check(Cfg(), [], [], []) is None
