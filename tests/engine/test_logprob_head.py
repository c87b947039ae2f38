"""The fused log-prob head: gradients equal plain autograd whichever outputs a loss uses, and an entropy that is
only logged (detached) costs no backward work."""
import pytest
import torch

from grpo.engine.logprob_head import head_logprobs


class _Cfg:
    model_type = "llama"


class _PlainHead(torch.nn.Linear):
    """Not exactly nn.Linear, so head_logprobs takes the ordinary autograd path: the reference."""


def _setup(seed=0, M=37, h=16, V=301):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, h, generator=g, requires_grad=True)
    fused = torch.nn.Linear(h, V, bias=True)
    with torch.no_grad():
        fused.weight.copy_(torch.randn(V, h, generator=g) * 0.3)
        fused.bias.copy_(torch.randn(V, generator=g) * 0.1)
    plain = _PlainHead(h, V, bias=True)
    plain.load_state_dict(fused.state_dict())
    targets = torch.randint(0, V, (M,), generator=g)
    w_lp, w_ent = torch.randn(M, generator=g), torch.randn(M, generator=g)
    return hidden, fused, plain, targets, w_lp, w_ent


def _grads(head, hidden, targets, use, w_lp, w_ent, temperature):
    h = hidden.detach().clone().requires_grad_(True)
    head.zero_grad()
    lp, ent = head_logprobs(h, head, _Cfg(), targets, temperature, want_entropy=True)
    loss = 0.0
    if "lp" in use:
        loss = loss + (w_lp * lp).sum()
    if "ent" in use:
        loss = loss + (w_ent * ent).sum()
    loss.backward()
    return h.grad, head.weight.grad, head.bias.grad, lp.detach(), ent.detach()


@pytest.mark.parametrize("use", [("lp",), ("ent",), ("lp", "ent")])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_gradients_match_autograd(use, temperature):
    hidden, fused, plain, targets, w_lp, w_ent = _setup()
    got = _grads(fused, hidden, targets, use, w_lp, w_ent, temperature)
    want = _grads(plain, hidden, targets, use, w_lp, w_ent, temperature)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _backward_ops(want_entropy: bool) -> dict:
    hidden, fused, _, targets, w_lp, _ = _setup(M=64, V=4096)
    h = hidden.detach().clone().requires_grad_(True)
    lp, ent = head_logprobs(h, fused, _Cfg(), targets, 1.0, want_entropy=want_entropy)
    if want_entropy:
        ent = ent.detach()  # logged only, as grpo.update does
    loss = (w_lp * lp).sum()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")}, h.grad


def test_detached_entropy_costs_no_backward_work():
    """A logged-only entropy gets the same gradient and the same backward ops as not asking for it at all: no
    zero gradient is materialised and pushed through the full-vocabulary passes."""
    with_ent, g1 = _backward_ops(True)
    without, g2 = _backward_ops(False)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    vocab_ops = ("aten::mul_", "aten::add_", "aten::sub_")
    assert {k: with_ent.get(k, 0) for k in vocab_ops} == {k: without.get(k, 0) for k in vocab_ops}


# ------------------------------------------------------------------- against an independent reference (both paths)
def _reference(hidden, weight, bias, targets, mult, cap, vocab, temperature):
    """log p(target) and entropy written out from the formula, with plain torch ops (autograd gives its grads)."""
    u = hidden.float() @ weight.float().t() + (0 if bias is None else bias.float())
    if vocab is not None:
        u = u[:, :vocab]
    u = u * mult
    if cap is not None:
        u = cap * torch.tanh(u / cap)
    logp = torch.log_softmax(u / temperature, dim=-1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


class _Typed:
    def __init__(self, model_type, **kw):
        self.model_type = model_type
        self.__dict__.update(kw)


_CASES = [  # (config, mult, cap, vocab) of the transforms the engine reproduces
    (_Typed("llama"), 1.0, None, None),
    (_Typed("granite", logits_scaling=4.0), 0.25, None, None),
    (_Typed("cohere", logit_scale=0.5), 0.5, None, None),
    (_Typed("gemma2", final_logit_softcapping=1.5), 1.0, 1.5, None),
    (_Typed("inkling_text", logits_mup_width_multiplier=2.0, unpadded_vocab_size=20), 0.5, None, 20),
    (_Typed("cohere2", logit_scale=2.0), 2.0, None, None),
]


def _run(head, cfg, hidden, targets, temperature, w_lp, w_ent, use=("lp", "ent"), grads=("h", "w", "b"),
         want_entropy=None):
    h = hidden.detach().clone().requires_grad_("h" in grads)
    head.weight.requires_grad_("w" in grads)
    if head.bias is not None:
        head.bias.requires_grad_("b" in grads)
    head.zero_grad()
    want = "ent" in use if want_entropy is None else want_entropy
    lp, ent = head_logprobs(h, head, cfg, targets, temperature, want_entropy=want)
    loss = _loss(lp, ent, w_lp, w_ent, use)
    loss.backward()
    b_grad = None if head.bias is None else head.bias.grad
    return lp.detach(), None if ent is None or not want else ent.detach(), h.grad, head.weight.grad, b_grad


def _loss(lp, ent, w_lp, w_ent, use):
    """The loss of the outputs in ``use`` only: an unused output gets no gradient at all (None in backward)."""
    terms = ([(w_lp * lp).sum()] if "lp" in use else []) + ([(w_ent * ent).sum()] if "ent" in use else [])
    return sum(terms[1:], terms[0])


def _close(a, b, tol=1e-4):
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _check(head, cfg, mult, cap, vocab, temperature, use=("lp", "ent"), grads=("h", "w", "b"), M=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    h_dim, V = head.weight.shape[1], head.weight.shape[0]
    hidden = torch.randn(M, h_dim, generator=g)
    targets = torch.randint(0, vocab or V, (M,), generator=g)
    w_lp, w_ent = torch.randn(M, generator=g), torch.randn(M, generator=g)
    got = _run(head, cfg, hidden, targets, temperature, w_lp, w_ent, use, grads)
    ref_head = torch.nn.Linear(h_dim, V, bias=head.bias is not None)
    ref_head.load_state_dict(head.state_dict())
    h = hidden.clone().requires_grad_("h" in grads)
    ref_head.weight.requires_grad_("w" in grads)
    if ref_head.bias is not None:
        ref_head.bias.requires_grad_("b" in grads)
    lp, ent = _reference(h, ref_head.weight, ref_head.bias, targets, mult, cap, vocab, temperature)
    loss = _loss(lp, ent, w_lp, w_ent, use)
    loss.backward()
    want = (lp.detach(), ent.detach() if "ent" in use else None, h.grad, ref_head.weight.grad,
            None if ref_head.bias is None else ref_head.bias.grad)
    for name, a, b in zip(("lp", "ent", "h", "w", "b"), got, want):
        if name in ("h", "w", "b") and name not in grads:
            assert a is None, name
            continue
        assert _close(a, b), (name, a, b)


def _heads(bias=True, V=31, h=8, seed=0):
    torch.manual_seed(seed)
    fused = torch.nn.Linear(h, V, bias=bias)
    with torch.no_grad():
        fused.weight.mul_(3.0)
        if bias:
            fused.bias.uniform_(-0.5, 0.5)
    plain = _PlainHead(h, V, bias=bias)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def test_both_paths_equal_the_formula_for_every_transform_and_temperature():
    for cfg, mult, cap, vocab in _CASES:
        for temperature in (1.0, 0.7, 0.5, 2.0):
            for head in _heads():
                _check(head, cfg, mult, cap, vocab, temperature)


def test_both_paths_without_a_bias_and_with_one_output_or_some_gradients_only():
    for cfg, mult, cap, vocab in (_CASES[3], _CASES[4]):
        for head in _heads(bias=False):
            _check(head, cfg, mult, cap, vocab, 0.7)
        for use in (("lp",), ("ent",)):
            for grads in (("h",), ("w",), ("b",), ("h", "w", "b")):
                for head in _heads():
                    _check(head, cfg, mult, cap, vocab, 0.7, use=use, grads=grads)


def test_the_fused_head_works_in_row_chunks(monkeypatch):
    import grpo.engine.logprob_head as lh

    monkeypatch.setattr(lh, "_CHUNK_ELEMENTS", 31 * 4)  # 4 rows a chunk: 13 rows in 4 chunks, the last of one row
    for cfg, mult, cap, vocab in _CASES:
        _check(_heads()[0], cfg, mult, cap, vocab, 0.7)
    monkeypatch.setattr(lh, "_CHUNK_ELEMENTS", 5)  # fewer elements than one row: one row a chunk
    _check(_heads()[0], *_CASES[3], 1.0, use=("lp",))


def test_which_path_a_head_takes(monkeypatch):
    import grpo.engine.logprob_head as lh

    fused_calls = []
    real = lh._FusedLogProb.apply
    monkeypatch.setattr(lh._FusedLogProb, "apply", lambda *a: fused_calls.append(1) or real(*a))
    fused, plain = _heads()
    _check(fused, *_CASES[4], 1.0)
    assert fused_calls == [1]
    _check(plain, *_CASES[4], 1.0)
    fused.weight.ds_id = 3  # a ZeRO-3 partitioned weight: ordinary autograd
    _check(fused, *_CASES[4], 1.0)
    assert fused_calls == [1]
    lp, ent = head_logprobs(torch.randn(3, 8), _heads()[0], _Typed("llama"), torch.tensor([0, 1, 2]), 1.0, False)
    assert ent is None and lp.shape == (3,) and lp.dtype == torch.float32
    lp, ent = head_logprobs(torch.randn(3, 8), _heads()[1], _Typed("llama"), torch.tensor([0, 1, 2]), 1.0, False)
    assert ent is None and lp.shape == (3,) and lp.dtype == torch.float32


def test_a_bfloat16_head_gets_bfloat16_gradients_close_to_the_formulas():
    fused, plain = _heads()
    for head in (fused, plain):
        head.to(torch.bfloat16)
        g = torch.Generator().manual_seed(2)
        hidden = torch.randn(6, 8, generator=g).to(torch.bfloat16)
        targets = torch.randint(0, 31, (6,), generator=g)
        w = torch.randn(6, generator=g)
        lp, ent, gh, gw, gb = _run(head, _CASES[3][0], hidden, targets, 1.0, w, w)
        assert lp.dtype == ent.dtype == torch.float32 and gh.dtype == gw.dtype == gb.dtype == torch.bfloat16
        ref = torch.nn.Linear(8, 31).to(torch.bfloat16)
        ref.load_state_dict(head.state_dict())
        h = hidden.clone().requires_grad_(True)
        rlp, rent = _reference(h, ref.weight, ref.bias, targets, 1.0, 1.5, None, 1.0)
        ((w * rlp).sum() + (w * rent).sum()).backward()
        assert torch.allclose(lp, rlp, atol=2e-2) and torch.allclose(gh.float(), h.grad.float(), atol=5e-2)
        assert torch.allclose(gw.float(), ref.weight.grad.float(), atol=5e-2)


def test_each_familys_transform_from_its_config():
    from grpo.engine.logprob_head import HeadTransform, head_transform

    T = HeadTransform
    assert head_transform(_Typed("llama")) == T() == T(1.0, None, None)
    assert head_transform(_Typed("granitemoe", logits_scaling=8)) == T(mult=0.125)
    assert head_transform(_Typed("minicpm3", logits_scaling=2)) == T(mult=0.5)
    assert head_transform(_Typed("hyperclovax", logits_scaling=3)) == T(mult=3.0)
    assert head_transform(_Typed("cohere2", logit_scale=0.25)) == T(mult=0.25)
    assert head_transform(_Typed("cohere_compass_text", logit_scale=None)) == T()
    assert head_transform(_Typed("cohere_compass_text", logit_scale=2)) == T(mult=2.0)
    assert head_transform(_Typed("falcon_h1", lm_head_multiplier=0.039)) == T(mult=0.039)
    assert head_transform(_Typed("inkling_text", logits_mup_width_multiplier=4, unpadded_vocab_size=90)) == \
        T(mult=0.25, vocab=90)
    assert head_transform(_Typed("vaultgemma", final_logit_softcapping=30.0)) == T(cap=30.0)
    assert head_transform(_Typed("gemma2", final_logit_softcapping=0.0)) == T()  # 0: no soft-cap
    assert head_transform(_Typed("recurrent_gemma", logits_soft_cap=30.0)) == T(cap=30.0)
    assert head_transform(_Typed("xlstm", output_logit_soft_cap=15.0)) == T(cap=15.0)
    composite = _Typed("llava", get_text_config=lambda: _Typed("gemma2", final_logit_softcapping=5.0))
    assert head_transform(composite) == T(cap=5.0)
    assert type(head_transform(_Typed("granite", logits_scaling=2)).mult) is float
    assert type(head_transform(_Typed("cohere", logit_scale=2)).mult) is float


def test_one_row_and_an_entropy_asked_for_but_only_logged():
    for head in _heads():
        _check(head, *_CASES[3], 0.7, M=1)
        _check(head, *_CASES[3], 0.7, use=("ent",), M=1)
    g = torch.Generator().manual_seed(3)
    hidden, targets, w = torch.randn(5, 8, generator=g), torch.randint(0, 31, (5,), generator=g), torch.randn(5)
    fused, plain = _heads()
    got = _run(fused, _CASES[3][0], hidden, targets, 0.7, w, w, use=("lp",), want_entropy=True)
    want = _run(plain, _CASES[3][0], hidden, targets, 0.7, w, w, use=("lp",), want_entropy=True)
    assert all(_close(a, b) for a, b in zip(got, want)) and got[1] is not None
