"""grpo/engine/patch.py, one tiny llama built at import and stand-ins: what may be switched and why not, the switch of
every config (sub-configs once each, the internal field where a config has one) and of the gradient-checkpointing
recompute, everything restored (also on exception), the placeholder mask and the every-layer check.
tests/engine/test_logprobs.py runs whole forwards through it."""
import sys
import types

import pytest
import torch
import transformers

from grpo.engine import patch
from grpo.engine.decode_attention import DECODE_ATTN_NAME, prefix_decode_attention_forward
from grpo.engine.layout import ACTIVE
from grpo.engine.prefix_attention import ATTN_NAME, prefix_attention_forward
from tests.engine.test_state_hand_over import ToyRecurrent
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401  (a mutant that makes the config walk endless)

torch.manual_seed(0)
LLAMA = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, attn_implementation="sdpa")).eval()


class _Cfg:
    """A config: ``_attn_implementation`` and its sub-configs, by name."""

    def __init__(self, impl="sdpa", **subs):
        self._attn_implementation = impl
        self.sub_configs = dict.fromkeys(subs)
        for k, v in subs.items():
            setattr(self, k, v)


class _Holder(torch.nn.Module):
    def __init__(self, config=None, *children):
        super().__init__()
        if config is not None:
            self.config = config
        self.kids = torch.nn.ModuleList(children)


class _Checkpointed(torch.nn.Module):
    """A layer under gradient checkpointing, its function its own (an instance attribute) or its class's."""

    gradient_checkpointing = True

    def __init__(self, own=None):
        super().__init__()
        if own is not None:
            self._gradient_checkpointing_func = own


class _ClassCheckpointed(_Checkpointed):
    def _gradient_checkpointing_func(self, fn, *args, **kwargs):
        return "class", fn(*args, **kwargs)


# --------------------------------------------------------------------------------------------- may we switch
def test_a_plain_model_is_served_and_an_unimplemented_feature_is_named():
    assert patch.shared_prefix_unsupported(LLAMA, 8) is None
    assert patch.shared_decode_unsupported(LLAMA, 8) is None
    LLAMA.config.attention_chunk_size = 4
    try:
        want = "chunked attention (attention_chunk_size) is not implemented by the shared layout"
        assert patch.shared_prefix_unsupported(LLAMA, 8) == want
        assert patch.shared_decode_unsupported(LLAMA, 8) == want  # what the shared layout refuses, decoding too
    finally:
        del LLAMA.config.attention_chunk_size


def test_checkpointing_the_engine_cannot_follow_is_refused():
    hidden = "gradient checkpointing is applied by a mechanism the engine cannot follow"
    layer = LLAMA.model.layers[0]
    try:
        layer.gradient_checkpointing = True  # on, and no function of ours to wrap
        assert patch.shared_prefix_unsupported(LLAMA, 8) == hidden
        assert not patch._checkpointing_is_wrappable(LLAMA)
        layer._gradient_checkpointing_func = "not callable"
        assert patch.shared_prefix_unsupported(LLAMA, 8) == hidden
        layer._gradient_checkpointing_func = lambda fn, *a: fn(*a)
        assert patch.shared_prefix_unsupported(LLAMA, 8) is None
        layer.gradient_checkpointing = False
        del layer._gradient_checkpointing_func
        assert patch.shared_prefix_unsupported(LLAMA, 8) is None  # off: nothing to follow
    finally:
        layer.gradient_checkpointing = False
        vars(layer).pop("_gradient_checkpointing_func", None)
    assert patch._checkpointing_is_wrappable(_Holder(None, _Checkpointed(lambda fn: fn)))
    assert not patch._checkpointing_is_wrappable(_Holder(None, torch.nn.Linear(1, 1), _Checkpointed()))


def test_attention_shared_between_layers_cannot_decode_against_one_prompt_copy(monkeypatch):
    class SharedAttention(torch.nn.Module):
        layer_idx = 0

        def forward(self, hidden_states, layer_idx=0):
            return hidden_states

    model = _Holder(None, LLAMA, SharedAttention())
    monkeypatch.setattr(patch, "shared_prefix_unsupported", lambda m, n: None)
    assert patch.shared_decode_unsupported(model, 8) == "attention blocks shared between decoder layers"
    assert patch.shared_decode_unsupported(LLAMA, 8) is None
    monkeypatch.setattr(patch, "shared_prefix_unsupported", lambda m, n: f"refused at {n}")
    assert patch.shared_decode_unsupported(model, 8) == "refused at 8"  # the shared layout's reason comes first


# --------------------------------------------------------------------------------------------- the switch
def test_register_registers_both_functions_once(monkeypatch):
    calls = []
    # the module register() imports from (sys.modules' entry, which a lazy import may have replaced since this file's)
    monkeypatch.setattr(sys.modules["transformers"], "AttentionInterface", types.SimpleNamespace(
        register=lambda name, fn: calls.append((name, fn))))
    monkeypatch.setattr(patch, "_registered", False)
    patch.register()
    patch.register()
    assert calls == [(ATTN_NAME, prefix_attention_forward), (DECODE_ATTN_NAME, prefix_decode_attention_forward)]
    assert patch._registered is True


def test_every_config_once_with_its_sub_configs():
    leaf, other = _Cfg(), _Cfg()
    top = _Cfg(text=leaf, vision=None, again=leaf)  # a None sub-config, one reached twice
    no_impl = types.SimpleNamespace(model_type="x")  # a config without an attention field: not switched
    model = _Holder(top, _Holder(leaf), _Holder(no_impl), _Holder(other), _Holder(top))
    top.sub_configs["plain"] = top.sub_configs["absent"] = None
    top.plain = types.SimpleNamespace()  # a sub-config without the field is skipped, one not set too
    bare = types.SimpleNamespace(_attn_implementation="sdpa")  # no sub_configs at all
    assert patch._configs(_Holder(bare)) == [bare]
    got = patch._configs(model)
    assert sorted(map(id, got)) == sorted(map(id, [top, leaf, other]))
    assert patch._configs(_Holder(None, _Holder(_Cfg(deep=_Cfg(deeper=leaf))))).count(leaf) == 1
    shared = _Cfg(sub=_Cfg())  # one config on two modules, its sub-config read after the second
    assert len(patch._configs(_Holder(shared, _Holder(shared)))) == 2
    leaf.sub_configs, leaf.parent = {"parent": None}, top  # a cycle: each config once, and the walk ends
    assert sorted(map(id, patch._configs(model))) == sorted(map(id, [top, leaf, other]))


def test_set_impl_writes_the_internal_field_where_the_config_has_one():
    config = transformers.Qwen2VLConfig()  # its _attn_implementation setter recurses into the sub-configs
    text, vision = config.text_config, config.vision_config
    before = vision._attn_implementation
    patch._set_impl([config], ["eager"])
    assert config._attn_implementation == "eager" and vision._attn_implementation == before
    plain = _Cfg("sdpa")
    patch._set_impl([plain, text], [ATTN_NAME, "eager"])
    assert plain._attn_implementation == ATTN_NAME and "_attn_implementation_internal" not in vars(plain)
    assert text._attn_implementation == "eager"


def _seen(configs, layer):
    return lambda *a, **kw: (a, kw, [c._attn_implementation for c in configs], ACTIVE.get(),
                             "grpo_switched" in vars(layer).get("forward", lambda: 0).__dict__)


def test_the_recompute_runs_switched_and_restores_also_on_exception():
    configs, layer, state = [_Cfg("sdpa"), _Cfg("eager")], ToyRecurrent(), object()
    run = patch._with_impl(_seen(configs, layer), configs, ATTN_NAME, state, [layer])
    assert run(1, k=2) == ((1,), {"k": 2}, [ATTN_NAME, ATTN_NAME], state, True)
    assert [c._attn_implementation for c in configs] == ["sdpa", "eager"] and ACTIVE.get() is None
    assert "forward" not in vars(layer)

    def fails():
        assert ACTIVE.get() is state
        raise KeyError("x")

    with pytest.raises(KeyError):
        patch._with_impl(fails, configs, ATTN_NAME, state, [layer])()
    assert [c._attn_implementation for c in configs] == ["sdpa", "eager"] and ACTIVE.get() is None


def test_switched_attention_switches_every_config_and_the_recurrent_layers_then_restores():
    cfg, layer, state = _Cfg("sdpa", text=_Cfg("eager")), ToyRecurrent(), object()
    model = _Holder(cfg, layer)
    with patch.switched_attention(model, DECODE_ATTN_NAME, state):
        assert [cfg._attn_implementation, cfg.text._attn_implementation] == [DECODE_ATTN_NAME] * 2
        assert ACTIVE.get() is state and vars(layer)["forward"].grpo_switched
    assert (cfg._attn_implementation, cfg.text._attn_implementation, ACTIVE.get()) == ("sdpa", "eager", None)
    assert "forward" not in vars(layer)
    with pytest.raises(ValueError):
        with patch.switched_attention(model, state=state):
            assert cfg._attn_implementation == ATTN_NAME
            raise ValueError
    assert (cfg._attn_implementation, ACTIVE.get()) == ("sdpa", None) and "forward" not in vars(layer)


def test_checkpointing_functions_are_wrapped_for_the_recompute_and_put_back():
    cfg, state = _Cfg("sdpa"), object()
    own_calls = []

    def own(fn, *a, **kw):
        own_calls.append(1)
        return "own", fn(*a, **kw)

    mine, theirs, off = _Checkpointed(own), _ClassCheckpointed(), _Checkpointed(own)
    off.gradient_checkpointing = False
    layer = ToyRecurrent()
    model = _Holder(cfg, mine, theirs, off, layer)
    with patch.switched_attention(model, ATTN_NAME, state):
        assert off._gradient_checkpointing_func is own  # not checkpointing: left alone
        wrapped_mine, wrapped_theirs = mine._gradient_checkpointing_func, theirs._gradient_checkpointing_func
    assert mine._gradient_checkpointing_func is own and "_gradient_checkpointing_func" not in vars(theirs)
    seen = _seen([cfg], layer)
    # in backward, after the switch was undone: the recompute switches again, through the layer's own function
    assert wrapped_mine(seen, 3, k=4) == ("own", ((3,), {"k": 4}, [ATTN_NAME], state, True)) and own_calls == [1]
    assert wrapped_theirs(seen, 5) == ("class", ((5,), {}, [ATTN_NAME], state, True))
    assert cfg._attn_implementation == "sdpa" and ACTIVE.get() is None and "forward" not in vars(layer)


def test_the_real_models_config_is_switched_and_put_back():
    with patch.switched_attention(LLAMA):
        assert LLAMA.config._attn_implementation == ATTN_NAME
    assert LLAMA.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------------------------- around the forward
def test_the_placeholder_mask_is_zero_wide_and_4d_on_the_device():
    m = patch.placeholder_mask(torch.device("cpu"))
    assert m.shape == (1, 1, 1, 0) and m.dtype == torch.bool and m.device.type == "cpu"


def test_the_check_counts_every_layer_in_training_and_the_attention_ones_in_decoding():
    patch.check_every_layer(2, LLAMA)
    patch.check_every_layer(3, LLAMA, DECODE_ATTN_NAME)
    with pytest.raises(RuntimeError) as e:
        patch.check_every_layer(1, LLAMA)
    assert str(e.value) == (
        "only 1 of 2 attention layers of this 'llama' model went through the shared-prefix attention 'grpo_prefix' "
        "(the others bypass transformers' AttentionInterface, so their output would be wrong); call token_logprobs "
        "with shared_prefix=False (trainer: engine.shared_prefix=false)")
    # a hybrid: layer 0 attention (LLAMA's layer 0), layer 1 recurrent only, layer 0 also recurrent
    hybrid = _Holder(types.SimpleNamespace(num_hidden_layers=3, model_type="h"), LLAMA.model.layers[0].self_attn,
                     ToyRecurrent(1), ToyRecurrent(2), ToyRecurrent(0))
    patch.check_every_layer(3, hybrid)
    with pytest.raises(RuntimeError, match="only 2 of 3 attention layers"):
        patch.check_every_layer(2, hybrid)
    patch.check_every_layer(1, hybrid, DECODE_ATTN_NAME)  # decoding: the two recurrent-only layers call nothing
    with pytest.raises(RuntimeError, match=r"only 0 of 1 .*'grpo_prefix_decode'.*; set rollout.share_prompt=false$"):
        patch.check_every_layer(0, hybrid, DECODE_ATTN_NAME)
