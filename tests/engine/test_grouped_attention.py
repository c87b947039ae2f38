"""grpo/engine/grouped_attention.py against attention written out in float64 on the packed row: each prompt token
attends causally to its prompt, each completion token to its group's whole prompt and causally to itself."""
import pytest
import torch

import grpo.engine.grouped_attention as ga
from grpo.engine.grouped_attention import grouped_attention, joint_softmax
from grpo.engine.layout import build_layout

torch.set_num_threads(1)
# three groups: ragged prompts (one of one token), G = 1, 3, 2, ragged completions (ones of one token)
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
COMPLETIONS = [[[10, 11]], [[12, 13, 14], [15], [16, 17]], [[18], [19, 20, 21, 22]]]
H, HKV, D, SCALE = 4, 2, 8, 0.3  # GQA (two query heads per KV head), a scale not 1/sqrt(D)


def allowed(prompts, completions) -> torch.Tensor:
    """(T, T) bool: may token i (query) attend to token j (key), from the lengths alone."""
    spans = []  # (start, end, prompt start, prompt end) of every prompt and completion in the row
    t = 0
    for p, comps in zip(prompts, completions):
        p0, t = t, t + len(p)
        spans.append((p0, t, p0, p0))
        for r in comps:
            spans.append((t, t + len(r), p0, p0 + len(p)))
            t += len(r)
    ok = torch.zeros(t, t, dtype=torch.bool)
    for a, b, pa, pb in spans:
        ok[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        ok[a:b, pa:pb] = True
    return ok


def reference(q, k, v, ok, scale):
    """float64 attention over the mask: (1, H, T, D) x (1, Hkv, T, D) -> (1, T, H, Dv)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~ok, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def inputs(dtype=torch.float32, seed=0, dv=D):
    lay = build_layout(PROMPTS, COMPLETIONS, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    T = lay.n_tokens
    q, k, v = (torch.randn(1, h, T, d, generator=g).to(dtype).requires_grad_()
               for h, d in ((H, D), (HKV, D), (HKV, dv)))
    return lay, q, k, v


# the fused CPU kernels; the generic score-chunking one (also for a value head dim of its own, which the fused
# kernels do not serve)
@pytest.mark.parametrize("merged, dv", [(True, D), (False, D), (False, 6)])
def test_forward_and_gradients_equal_attention_written_out(monkeypatch, merged, dv):
    if not merged:
        monkeypatch.setattr(ga, "merged_attention_available", lambda q, v: False)
    calls = []
    real = ga.merged_attention
    monkeypatch.setattr(ga, "merged_attention", lambda *a: calls.append(1) or real(*a))
    lay, q, k, v = inputs(dv=dv)
    assert lay.prompt_valid is not None  # ragged prompts: the masked branch of the prompt attention
    out = grouped_attention(q, k, v, lay, SCALE, 0.0)
    want = reference(q, k, v, allowed(PROMPTS, COMPLETIONS), SCALE)
    assert out.shape == want.shape and bool(calls) == merged
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
    g_o = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), g_o)
    ref = torch.autograd.grad(want, (q, k, v), g_o.double())
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1e-5)


def test_prompts_of_equal_length_take_the_causal_branch_with_the_given_scale():
    prompts, comps = [[1, 2, 3], [4, 5, 6]], [[[7, 8], [9]], [[10, 11, 12]]]
    lay = build_layout(prompts, comps, torch.device("cpu"))
    assert lay.prompt_valid is None
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, lay.n_tokens, D, generator=g) for h in (H, HKV, HKV))
    want = reference(q, k, v, allowed(prompts, comps), SCALE)
    torch.testing.assert_close(grouped_attention(q, k, v, lay, SCALE, 0.0).double(), want, rtol=0, atol=2e-6)


def test_bfloat16_through_the_fused_kernels_keeps_the_dtype_and_is_close(monkeypatch):
    """bf16 activations: the merged kernel's forward and backward run in bf16 (its flash calls take one dtype) and
    stay within bf16's rounding of the float64 attention."""
    calls = []
    real = ga.merged_attention
    monkeypatch.setattr(ga, "merged_attention", lambda *a: calls.append(1) or real(*a))
    lay, q, k, v = inputs(torch.bfloat16)
    out = grouped_attention(q, k, v, lay, SCALE, 0.0)
    assert calls  # the fused kernels serve bf16
    assert out.dtype == torch.bfloat16
    want = reference(q, k, v, allowed(PROMPTS, COMPLETIONS), SCALE)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=3e-2)
    g_o = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), g_o.bfloat16())
    ref = torch.autograd.grad(want, (q, k, v), g_o.double())
    for a, b in zip(got, ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=6e-2)


def test_a_row_of_one_token_attends_to_itself():
    lay = build_layout([[5]], [[[]]], torch.device("cpu"))  # a one-token prompt, an empty completion
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 1, D, generator=g) for h in (H, HKV, HKV))
    out = grouped_attention(q, k, v, lay, SCALE, 0.0)
    torch.testing.assert_close(out, v.repeat_interleave(H // HKV, 1).transpose(1, 2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ragged", [True, False])
def test_dropout_reaches_the_prompt_tokens_and_keeps_the_expectation(ragged):
    """With attention dropout the prompt tokens' attention drops weights too (both SDPA branches), rescaled so
    that the mean over many draws is the attention without dropout."""
    prompts = PROMPTS if ragged else [[1, 2, 3], [4, 5, 6]]
    lay = build_layout(prompts, [[[7, 8]]] * len(prompts), torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, lay.n_tokens, D, generator=g) for h in (H, HKV, HKV))
    is_prompt = torch.zeros(lay.n_tokens, dtype=torch.bool)
    is_prompt[lay.prompt_idx.view(len(prompts), -1)[(lay.prompt_valid if ragged else True)]] = True
    plain = grouped_attention(q, k, v, lay, SCALE, 0.0)[0, is_prompt]
    torch.manual_seed(0)
    draws = torch.stack([grouped_attention(q, k, v, lay, SCALE, 0.5)[0, is_prompt] for _ in range(300)])
    assert (draws[0] - plain).abs().max() > 1e-2  # weights were dropped
    torch.testing.assert_close(draws.mean(0), plain, rtol=0.15, atol=0.1)


def test_joint_softmax_is_one_softmax_over_both_blocks_whatever_their_scale():
    """Rows whose scores sit near -800, 0 and +800, the larger ones in either block, some scores masked: the
    weights are softmax(cat(s_a, s_b)) in float64 (a maximum not shared by both blocks, or not taken per row,
    overflows or underflows here) and come back in the dtype asked for."""
    g = torch.Generator().manual_seed(4)
    s_a, s_b = torch.randn(2, 3, 4, generator=g) * 3, torch.randn(2, 3, 5, generator=g) * 3
    offsets = torch.tensor([[-800.0, 0.0, 800.0], [300.0, -300.0, 0.0]])
    s_a, s_b = s_a + offsets[..., None], s_b + offsets[..., None]
    s_a[0, 0] += 200.0  # the row's largest scores in the first block, far above the second
    s_b[1, 1] += 200.0  # and in the second
    s_a[1, 2, :2] = float("-inf")
    s_b[0, 2, 3:] = float("-inf")
    want = torch.cat([s_a, s_b], -1).double().softmax(-1)
    a, b = joint_softmax(s_a, s_b, torch.float32)
    torch.testing.assert_close(torch.cat([a, b], -1).double(), want, rtol=1e-5, atol=1e-7)
    a16, b16 = joint_softmax(s_a, s_b, torch.bfloat16)
    assert a16.dtype == b16.dtype == torch.bfloat16
