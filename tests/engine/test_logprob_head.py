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
