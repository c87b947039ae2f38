"""The CPU completion attention (two fused flash-attention calls merged by log-sum-exp) against the generic,
score-chunking kernel and against the per-sequence reference."""

import pytest
import torch

import grpo.engine.grouped_attention as ga
from grpo.engine import token_logprobs
from grpo.engine.completion_attention import completion_attention
from grpo.engine.merged_attention import merged_attention, merged_attention_available
from tests.engine.test_logprobs import assert_grads_close, grads, make_data, make_model, max_err, reference_with_grads

torch.set_num_threads(1)


# B, Hkv, rep, G, S, P, D, ragged prompts
@pytest.mark.parametrize("shape", [(2, 2, 2, 3, 5, 7, 16, True), (1, 2, 2, 4, 6, 9, 8, False),
                                   (3, 1, 3, 2, 1, 1, 4, False), (2, 3, 1, 5, 4, 6, 8, True)])
def test_merged_equals_chunked_kernel(shape):
    B, Hkv, rep, G, S, P, D, ragged = shape
    g = torch.Generator().manual_seed(0)
    q, kp, vp, kc, vc = (torch.randn(*s, generator=g).requires_grad_() for s in
                         [(B, Hkv, rep, G, S, D), (B, Hkv, P, D), (B, Hkv, P, D), (B, Hkv, G, S, D), (B, Hkv, G, S, D)])
    valid = None
    if ragged:  # the first prompt is half padding; the kernel must not attend to it
        valid = torch.ones(B, P, dtype=torch.bool)
        valid[0, P // 2 :] = False
        with torch.no_grad():
            kp[0, :, P // 2 :] = 1e3
    assert merged_attention_available(q, vp)
    g_o = torch.randn(B, Hkv, rep, G, S, D, generator=g)
    got, want = ([fn(q, kp, vp, kc, vc, valid, 0.3)] for fn in (merged_attention, completion_attention))
    got += torch.autograd.grad(got[0], (q, kp, vp, kc, vc), g_o)
    want += torch.autograd.grad(want[0], (q, kp, vp, kc, vc), g_o)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 2e-6 * max(1.0, b.abs().max().item())


def test_merged_serves_cpu_float_only(monkeypatch):
    x = torch.zeros(1, 1, 1, 1, 1, 8)
    assert merged_attention_available(x, torch.zeros(1, 1, 1, 8))
    assert merged_attention_available(x.bfloat16(), torch.zeros(1, 1, 1, 8).bfloat16())
    assert not merged_attention_available(x, torch.zeros(1, 1, 1, 4))  # value head dim differs
    assert not merged_attention_available(x.double(), torch.zeros(1, 1, 1, 8).double())
    # a PyTorch without the fused kernel's backward: the generic kernel serves
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", object())
    assert not merged_attention_available(x, torch.zeros(1, 1, 1, 8))


@pytest.mark.parametrize("merged", [True, False])
def test_both_cpu_paths_match_reference(monkeypatch, merged):
    if not merged:
        monkeypatch.setattr(ga, "merged_attention_available", lambda q, v: False)
    calls = []
    real = ga.merged_attention
    monkeypatch.setattr(ga, "merged_attention", lambda *a: calls.append(1) or real(*a))
    model = make_model("llama").train()
    prompts, comps = make_data()
    ref, w, want = reference_with_grads(model, prompts, comps)
    out = token_logprobs(model, prompts, comps)
    assert max_err(out, ref) <= 1e-5
    assert_grads_close(grads(model, out, w), want)
    assert bool(calls) == merged
