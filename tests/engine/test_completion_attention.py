"""grpo/engine/completion_attention.py on its own: the joint softmax of completion queries over their group's prompt
keys and their own causal keys, against the same attention written out in float64 (forward and gradients), in
bfloat16, with rows whose scores lie far apart, and the pieces it works in (whole groups while they fit)."""
from __future__ import annotations

import pytest
import torch

import grpo.engine.completion_attention as ca

B, HKV, REP, G, S, P, D = 2, 2, 2, 3, 4, 5, 8


def _inputs(dtype=torch.float32, seed=0, q_scale=None):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q = r(B, HKV, REP, G, S, D)
    if q_scale is not None:
        q = q * torch.tensor(q_scale, dtype=torch.float64)[:, None, None, None, None, None]
    kp, vp, kc, vc = r(B, HKV, P, D), r(B, HKV, P, D), r(B, HKV, G, S, D), r(B, HKV, G, S, D)
    valid = torch.tensor([[True] * P, [True] * 3 + [False] * (P - 3)])  # the second prompt is 3 tokens long
    return [t.to(dtype).requires_grad_() for t in (q, kp, vp, kc, vc)], valid


def _reference(q, kp, vp, kc, vc, valid, scaling):
    """softmax over [valid prompt keys; own completion keys up to the query], written out."""
    s_p = torch.einsum("bhrgsd,bhpd->bhrgsp", q, kp) * scaling
    s_p = s_p.masked_fill(~valid[:, None, None, None, None, :], float("-inf"))
    s_c = torch.einsum("bhrgsd,bhgtd->bhrgst", q, kc) * scaling
    s_c = s_c.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    a = torch.cat([s_p, s_c], -1).softmax(-1)
    return torch.einsum("bhrgsp,bhpd->bhrgsd", a[..., :P], vp) + torch.einsum("bhrgst,bhgtd->bhrgsd", a[..., P:], vc)


def _run(fn, inputs, valid, grad_out):
    out = fn(*inputs, valid, 0.35)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return out, grads


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
def test_forward_and_gradients_equal_the_attention_written_out(dtype, tol):
    inputs, valid = _inputs(dtype)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    grad_out = torch.randn(B, HKV, REP, G, S, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out, grads = _run(ca.completion_attention, inputs, valid, grad_out)
    want, want_grads = _run(_reference, ref_inputs, valid, grad_out)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol)
    for got, ref in zip(grads, want_grads):
        assert torch.allclose(got.double(), ref, atol=tol * 4, rtol=tol * 4)


def test_rows_whose_scores_lie_far_apart_are_each_normalised_by_their_own_maximum():
    """Group 0's scores reach the hundreds, group 1's stay near 0: one shared maximum would underflow group 1's
    weights to 0 (a 0/0 softmax)."""
    inputs, valid = _inputs(q_scale=[150.0, 0.1])
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    grad_out = torch.ones(B, HKV, REP, G, S, D, dtype=torch.float64)
    out, grads = _run(ca.completion_attention, inputs, valid, grad_out)
    want, want_grads = _run(_reference, ref_inputs, valid, grad_out)
    assert torch.isfinite(out).all() and torch.allclose(out.double(), want, atol=1e-4, rtol=1e-4)
    assert all(torch.isfinite(g).all() for g in grads)


def _pieces(chunk, d=16, monkeypatch=None):
    monkeypatch.setattr(ca, "CHUNK_SCORES", chunk)
    q, kp = torch.zeros(3, HKV, REP, 4, S, d), torch.zeros(3, HKV, 7, d)  # 3 groups of 4, 7 prompt slots
    return [(list(range(3))[b], list(range(4))[g]) for b, g in ca._chunks(q, kp)]


def test_it_works_in_whole_groups_while_they_fit_else_in_a_groups_completions(monkeypatch):
    """One completion's scores: HKV * REP * S * (P + S) = 2 * 2 * 4 * 11 = 176; a group of 4: 704."""
    whole = [0, 1, 2], [0, 1, 2, 3]
    assert _pieces(3 * 704, monkeypatch=monkeypatch) == [whole]
    assert _pieces(2 * 704 + 1, monkeypatch=monkeypatch) == [([0, 1], whole[1]), ([2], whole[1])]
    assert _pieces(704, monkeypatch=monkeypatch) == [([b], whole[1]) for b in range(3)]  # exactly one group fits
    assert _pieces(2 * 176, monkeypatch=monkeypatch) == [([b], c) for b in range(3) for c in ([0, 1], [2, 3])]
    assert _pieces(3 * 176, monkeypatch=monkeypatch) == [([b], c) for b in range(3) for c in ([0, 1, 2], [3])]
    assert _pieces(100, monkeypatch=monkeypatch) == [([b], [c]) for b in range(3) for c in range(4)]  # too big
