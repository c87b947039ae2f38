"""grpo/engine/state_layers.py's hand-over over a stand-in recurrent layer (a short convolution and a decaying
running sum, through the linear-attention cache interface): the shared forward equals each row run alone, and the
stand-in cache, the switch and the rollout's state fork do what they say. tests/engine/test_state_layers.py runs
the real hybrid families."""
import torch
import torch.nn.functional as F

from grpo.engine.layout import ACTIVE, build_layout
from grpo.engine.state_layers import (
    StateHandOver,
    fork_states,
    handed_over,
    has_recurrent_layers,
    not_handed_over,
    recurrent,
    shared_state_forward,
    state_layers,
    switched_state_layers,
)


class ToyRecurrent(torch.nn.Module):
    """y_t = x_t + x_{t-1} (a kernel-2 convolution), h_t = 0.5 h_{t-1} + y_t, returned as (h, None)."""

    def __init__(self, layer_idx=0, as_tuple=True):
        super().__init__()
        self.layer_idx, self.as_tuple = layer_idx, as_tuple

    def forward(self, hidden_states, attention_mask="not given", cache_params=None):
        assert attention_mask is None, "the hand-over passes no mask (the packed row's is a placeholder)"
        T = hidden_states.shape[1]
        # as real layers do, one token with a state given takes an in-place decoding step: not this stand-in's
        assert T > 1 or cache_params.get_recurrent_state(self.layer_idx) is None, "a one-token decoding step"
        full = cache_params.update_conv_state(hidden_states.transpose(1, 2), self.layer_idx, conv_kernel_size=2)
        y = (full[..., -T:] + F.pad(full, (1, 0))[..., -T - 1:-1]).transpose(1, 2)
        initial_state = cache_params.get_recurrent_state(self.layer_idx)
        h = torch.zeros_like(y[:, 0]) if initial_state is None else initial_state
        out = []
        for t in range(T):
            h = 0.5 * h + y[:, t]
            out.append(h)
        cache_params.update_recurrent_state(h, self.layer_idx)  # get_conv_state: the interface, by name
        return (torch.stack(out, 1), None) if self.as_tuple else torch.stack(out, 1)


def _alone(layer, x):
    out = layer(x[None], attention_mask=None, cache_params=StateHandOver())
    return (out[0] if isinstance(out, tuple) else out)[0]


def _check(prompts, comps, D=3, seed=0, as_tuple=True):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(50, D, generator=g)
    layout = build_layout(prompts, comps, "cpu")
    x = table[layout.input_ids[0]][None].requires_grad_(True)
    layer = ToyRecurrent(as_tuple=as_tuple)
    layout.calls = 3
    got = shared_state_forward(layer, layer.forward, x, layout)[0]
    assert layout.calls == 4 and got.shape == (layout.input_ids.shape[1], D)
    Pmax, Gmax, Smax = layout.max_prompt, layout.max_group, layout.max_completion
    for b, (p, rows) in enumerate(zip(prompts, comps)):
        for i, c in enumerate(rows):
            want = _alone(layer, table[torch.tensor(p + c)])
            for j in range(len(p)):
                assert torch.allclose(got[layout.prompt_idx[b * Pmax + j]], want[j], atol=1e-6), (b, i, j)
            for j in range(len(c)):
                at = layout.comp_idx[(b * Gmax + i) * Smax + j]
                assert torch.allclose(got[at], want[len(p) + j], atol=1e-6), (b, i, j)
    return x, got


def test_the_shared_forward_equals_each_row_alone():
    # prompts of three lengths (two groups share one), ragged completions, groups of different sizes
    _check([[1, 2, 3], [4, 5], [6, 7, 8], [9]], [[[10, 11], [12]], [[13, 14, 15]], [[16], [17, 18], [19]], [[20, 21]]])


def test_one_token_completions_and_one_token_prompts_and_a_layer_answering_with_a_tensor():
    _check([[1, 2], [3]], [[[4], [5]], [[6]]])
    _check([[1, 2], [3]], [[[4, 7], [5]], [[6]]], as_tuple=False)


def test_gradients_reach_the_prompt_from_every_completion():
    x, got = _check([[1, 2, 3]], [[[4, 5], [6]]])
    got.sum().backward()
    layer = ToyRecurrent()
    assert x.grad is not None and x.grad.abs().sum() > 0
    # against the rows alone: d/dx of the sum of every row's completion outputs plus the prompt's outputs once
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 3, generator=g).requires_grad_(True)
    total = 0
    for k, c in enumerate([[4, 5], [6]]):
        out = _alone(layer, table[torch.tensor([1, 2, 3] + c)])
        total = total + out[3:].sum() + (out[:3].sum() if k == 0 else 0)
    total.backward()
    layout = build_layout([[1, 2, 3]], [[[4, 5], [6]]], "cpu")
    want = torch.zeros_like(table).index_add_(0, layout.input_ids[0], x.grad[0])
    assert torch.allclose(table.grad, want, atol=1e-5)


def test_the_stand_in_cache():
    c = StateHandOver()
    assert c.get_conv_state(0) is None and c.get_recurrent_state(0) is None and c.is_recording_past(0)
    first = torch.arange(6.0).view(1, 2, 3)  # (N, C, T)
    assert torch.equal(c.update_conv_state(first, 0, conv_kernel_size=4), first)
    assert torch.equal(c.get_conv_state(0), F.pad(first, (1, 0)))  # fewer than K came: zeros on the left
    more = torch.tensor([[[10.0], [20.0]]])
    full = c.update_conv_state(more, 0, conv_kernel_size=4)
    assert torch.equal(full, torch.cat([F.pad(first, (1, 0)), more], -1))
    assert torch.equal(c.get_conv_state(0), torch.tensor([[[0.0, 1.0, 2.0, 10.0], [3.0, 4.0, 5.0, 20.0]]]))
    assert torch.equal(c.update_conv_state(more, 1, state_idx=1), more) and c.get_conv_state(1, 1).shape == (1, 2, 1)
    assert c.get_conv_state(1) is None  # another state index
    wide = StateHandOver(conv={(0, 0): torch.zeros(1, 2, 2, dtype=torch.float32)})  # held in another dtype
    assert wide.update_conv_state(more.half(), 0, conv_kernel_size=2).dtype == torch.float16
    s = torch.ones(2, 3)
    assert c.update_recurrent_state(s, 2) is s and c.get_recurrent_state(2) is s
    assert c.get_recurrent_state(2, 1) is None
    c.update_recurrent_state(s * 2, 2, state_idx=1)
    assert torch.equal(c.get_recurrent_state(2, 1), s * 2) and c.get_recurrent_state(2) is s


def test_rows_and_cat_of_stand_in_caches():
    a = StateHandOver({(0, 0): torch.tensor([[1.0], [2.0]])}, {(0, 0): torch.tensor([[3.0], [4.0]])})
    b = StateHandOver({(0, 0): torch.tensor([[5.0]])}, {(0, 0): torch.tensor([[6.0]])})
    both = StateHandOver.cat([a, b])
    assert both.conv[(0, 0)].tolist() == [[1.0], [2.0], [5.0]] and both.recurrent[(0, 0)].tolist() == [[3.0], [4.0],
                                                                                                         [6.0]]
    picked = both.rows(torch.tensor([2, 0, 0]))
    assert picked.conv[(0, 0)].tolist() == [[5.0], [1.0], [1.0]] and picked.recurrent[(0, 0)].tolist() == [[6.0],
                                                                                                           [3.0], [3.0]]
    assert StateHandOver().conv == {} and StateHandOver(None, None).recurrent == {}
    d = {(0, 0): torch.zeros(1)}
    assert StateHandOver(d).conv is not d  # its own dict


def test_the_switch_dispatches_inside_a_shared_forward_only_and_is_undone():
    layer = ToyRecurrent()
    assert handed_over(layer)
    x = torch.randn(1, 4, 3)
    with switched_state_layers([layer]):
        assert layer.forward.grpo_switched
        with switched_state_layers([layer]):  # re-entered: left as it is
            inner = layer.forward
        assert layer.forward is inner
        own = layer.forward(x, None, StateHandOver())  # no layout active: the layer's own forward, arguments as given
        assert torch.allclose(own[0], ToyRecurrent()(x, None, cache_params=StateHandOver())[0])
        by_name = layer.forward(x, attention_mask=None, cache_params=StateHandOver())  # and keywords as given
        assert torch.allclose(by_name[0], own[0])
        layout = build_layout([[1, 2]], [[[3, 4]]], "cpu")
        token = ACTIVE.set(layout)
        try:
            shared = layer.forward(x)  # the shared one (no cache given: it makes its own)
        finally:
            ACTIVE.reset(token)
        assert shared.shape == (1, 4, 3) and layout.calls == 1
    assert "forward" not in vars(layer)
    layout = build_layout([[1, 2]], [[[3, 4]]], "cpu")
    shared_state_forward(layer, layer.forward, torch.randn(1, 4, 3), layout)
    shared_state_forward(layer, layer.forward, torch.randn(1, 4, 3), layout)
    assert layout.calls == 2
    own_forward = lambda *a, **k: "own"  # noqa: E731 - an instance forward of its own is put back
    layer.forward = own_forward
    try:
        with switched_state_layers([layer]):
            assert layer.forward(x) == "own"
            raise KeyError("inside")
    except KeyError:
        pass
    assert layer.forward is own_forward


def test_a_reentered_switch_switches_the_layers_not_yet_switched_and_undoes_only_those():
    a, b = ToyRecurrent(0), ToyRecurrent(1)
    with switched_state_layers([a]):
        with switched_state_layers([a, b]):  # a is switched already: b after it still is
            assert b.forward.grpo_switched
        assert "forward" not in vars(b) and a.forward.grpo_switched
    assert "forward" not in vars(a)


class _Layer:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_fork_states_copies_each_prompts_states_to_its_rows():
    conv, rec = torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])
    old = _Layer(conv_states={0: conv, 1: None}, recurrent_states={0: rec}, is_conv_states_initialized={0: True},
                 is_recurrent_states_initialized={0: True}, has_previous_state={0: True}, conv_kernel_size={0: 4},
                 device="cpu", dtype=torch.float32)
    attention = _Layer(keys=1)  # a softmax layer's K/V: left alone
    prefilled = _Layer(layers=[attention, old])
    fresh = _Layer(layers=[_Layer(keys=2), _Layer(device=None, dtype=None)])
    assert fork_states(prefilled, fresh, torch.tensor([1, 1, 0])) is fresh
    new = fresh.layers[1]
    assert new.conv_states[0].tolist() == [[2.0], [2.0], [1.0]] and new.conv_states[1] is None
    assert new.recurrent_states[0].tolist() == [[4.0], [4.0], [3.0]]
    assert new.is_conv_states_initialized == {0: True} and new.is_conv_states_initialized is not \
        old.is_conv_states_initialized
    assert (new.is_recurrent_states_initialized, new.has_previous_state, new.conv_kernel_size) == ({0: True},
                                                                                                    {0: True}, {0: 4})
    assert (new.device, new.dtype) == ("cpu", torch.float32) and fresh.layers[0].keys == 2
    assert fork_states(_Layer(), fresh, torch.tensor([0])) is fresh  # a cache without layers
    bare = _Layer()
    assert fork_states(prefilled, bare, torch.tensor([0])) is bare
    half = _Layer(layers=[_Layer(conv_states={0: conv})])  # only one of the two state dicts: not a state layer
    untouched = _Layer(layers=[_Layer()])
    fork_states(half, untouched, torch.tensor([0]))
    assert not hasattr(untouched.layers[0], "conv_states")


def _layer(body: str, args: str = "x, cache_params=None", idx=True):
    """A module class whose forward's source holds ``body`` (the detection reads the source, never runs it)."""
    ns = {}
    exec(compile(f"def forward(self, {args}):\n    return {body!r}\n", f"<{body}>", "exec"), ns)
    cls = type("Layer", (torch.nn.Module,), {"forward": ns["forward"]})
    m = cls()
    if idx:
        m.layer_idx = 0
    return m


def test_which_layers_are_recurrent_and_which_are_handed_over(monkeypatch):
    import inspect

    import grpo.engine.state_layers as sl

    sources = {}
    monkeypatch.setattr(sl, "forward_source", lambda cls: sources.get(cls, ""))

    def make(src, args="x, cache_params=None", idx=True):
        m = _layer(src, args, idx)
        sources[type(m)] = src
        return m

    toy = ToyRecurrent()
    sources[ToyRecurrent] = inspect.getsource(ToyRecurrent.forward)
    assert recurrent(toy) and handed_over(toy) and not_handed_over(toy) is None
    for word in ("get_conv_state", "get_recurrent_state", "linear_cache", "ssm_state", "recurrent_state", "conv_state"):
        assert recurrent(make(word)), word
        assert not recurrent(make(word, idx=False)), word
    assert not recurrent(make("q_proj k_proj"))
    outside = "a recurrent state outside transformers' linear-attention cache"
    assert not_handed_over(make("ssm_state")) == outside
    assert not_handed_over(make("get_conv_state", args="x")) == outside  # no cache argument
    for arg in ("cache", "cache_params", "past_key_values"):
        assert not_handed_over(make("get_conv_state", args=f"x, {arg}=None")) is None, arg
    assert not_handed_over(make("get_recurrent_state")) == "its multi-token scan does not start from a given state"
    assert not_handed_over(make("get_recurrent_state initial_state")) is None
    assert not_handed_over(make("get_conv_state")) is None  # no recurrent state read at all
    assert not handed_over(make("get_conv_state", idx=False)) and handed_over(make("get_conv_state"))
    a, b, c = make("get_conv_state"), make("ssm_state"), make("q_proj")
    model = torch.nn.Sequential(a, b, c)
    assert state_layers(model) == [a] and has_recurrent_layers(model)
    assert not has_recurrent_layers(torch.nn.Sequential(c)) and state_layers(torch.nn.Sequential(c)) == []
