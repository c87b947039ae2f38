"""grpo/engine/hidden_states.py: the final hidden state at any position of any row, each prefix encoded once, equal
to the decoder's own forward over that row alone."""
import pytest
import torch

from grpo.engine.hidden_states import decoder_of, shared_prefix_hidden
from grpo.engine.prefix_attention import LAYOUT_KWARG
from grpo.models import tiny_model

# built at import, not in a fixture: mutation testing forks every mutant's tests from a process that has imported
# this module, so a model built here is built once, not once a mutant
MODEL = tiny_model("llama", 40, num_hidden_layers=1).eval()


def _alone(tokens: list[int], pos: int) -> torch.Tensor:
    with torch.no_grad():
        return MODEL.model(input_ids=torch.tensor([tokens])).last_hidden_state[0, pos]


def test_hidden_states_at_prefix_and_suffix_positions_equal_each_row_alone():
    prefixes = [[1, 2, 3], [4, 5]]
    suffixes = [[[6, 7], [8]], [[9, 10, 11], [12, 13], [14]]]
    at = [[4, 0], [2, 1, 2]]  # the last token, a prefix token, a suffix's first, the prefix's last, ...
    with torch.no_grad():
        got = shared_prefix_hidden(MODEL, prefixes, suffixes, at)
    want = torch.stack([_alone(p + s, pos) for p, rows, ats in zip(prefixes, suffixes, at)
                        for s, pos in zip(rows, ats)])
    assert got.shape == (5, 64) and torch.allclose(got, want, atol=1e-5)
    # a different row of the same group at the same suffix position differs: rows are not mixed up
    assert not torch.allclose(got[2], got[4], atol=1e-3)


def test_a_position_outside_its_row_is_refused():
    for pos in (-1, 3, 4):
        with pytest.raises(ValueError, match=f"position {pos} is outside row 0 of group 0"):
            shared_prefix_hidden(MODEL, [[1, 2]], [[[3], [4, 5]]], [[pos, 0]])
    with torch.no_grad():  # the last token of the longer row is inside it
        assert torch.allclose(shared_prefix_hidden(MODEL, [[1, 2]], [[[3], [4, 5]]], [[2, 3]])[1],
                              _alone([1, 2, 4, 5], 3), atol=1e-5)


def test_the_decoder_is_found_under_the_models_base_model_prefix():
    lm, decoder = decoder_of(MODEL)
    assert lm is MODEL and decoder is MODEL.model
    inner = torch.nn.Linear(1, 1)
    named = type("M", (torch.nn.Module,), {"base_model_prefix": "body"})()
    named.body = inner
    assert decoder_of(named) == (named, inner)
    plain = torch.nn.Module()  # no base_model_prefix: "model"
    plain.model = inner
    assert decoder_of(plain)[1] is inner
    itself = type("M", (torch.nn.Module,), {"base_model_prefix": ""})()  # getattr(m, "") is no attribute
    with pytest.raises(ValueError, match="cannot find the decoder stack of M"):
        decoder_of(itself)
    with pytest.raises(ValueError, match="cannot find the decoder stack of Module"):
        decoder_of(torch.nn.Module())


def test_the_decoder_gets_the_layout_the_placeholder_mask_and_no_cache_and_may_answer_with_a_tuple():
    seen = []
    hooks = [MODEL.model.register_forward_pre_hook(lambda m, a, kw: seen.append(dict(kw)), with_kwargs=True),
             MODEL.model.register_forward_hook(lambda m, a, out: out.to_tuple())]  # as with return_dict=False
    try:
        with torch.no_grad():
            got = shared_prefix_hidden(MODEL, [[1, 2]], [[[3], [4, 5]]], [[2, 3]])
    finally:
        for h in hooks:
            h.remove()
    assert torch.allclose(got[1], _alone([1, 2, 4, 5], 3), atol=1e-5)
    kw = seen[0]
    assert kw["use_cache"] is False and kw["attention_mask"].shape == (1, 1, 1, 0)
    assert kw[LAYOUT_KWARG].input_ids.shape == (1, 5) and kw["position_ids"].tolist() == [[0, 1, 2, 2, 3]]


def test_a_layer_that_does_not_pass_the_layout_on_reads_it_from_the_switch():
    def drop(m, args, kwargs):
        kwargs.pop(LAYOUT_KWARG, None)
        return args, kwargs

    hook = MODEL.model.layers[0].self_attn.register_forward_pre_hook(drop, with_kwargs=True)
    try:
        with torch.no_grad():
            got = shared_prefix_hidden(MODEL, [[1, 2]], [[[3], [4, 5]]], [[2, 3]])
    finally:
        hook.remove()
    assert torch.allclose(got, torch.stack([_alone([1, 2, 3], 2), _alone([1, 2, 4, 5], 3)]), atol=1e-5)
