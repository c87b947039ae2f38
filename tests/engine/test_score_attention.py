"""grpo/engine/score_attention.py against attention written out in float64 on the packed row, per-sequence positions:
a sliding window, Gemma 2's soft-cap, GPT-OSS's sinks, each alone and together, over ragged and equal prompts, GQA and
a value head dim of its own; forward and gradients; dropout. No model: the family tests (tests/engine/test_families.py)
run whole models through it."""
import pytest
import torch

from grpo.engine.layout import build_layout
from grpo.engine.score_attention import ScoreExtras, _dropped, score_attention
from tests.engine.test_grouped_attention import allowed

torch.set_num_threads(1)
# ragged prompts (one of one token, one longer than the window), G = 1, 3, 2, ragged completions
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11]]
COMPLETIONS = [[[12, 13]], [[14, 15, 16, 17], [18], [19, 20]], [[21], [22, 23, 24]]]
EQUAL = [[1, 2, 3], [4, 5, 6]], [[[7, 8, 9, 10], [11]], [[12, 13]]]
H, HKV, D, SCALE = 4, 2, 8, 0.3


def reference(q, k, v, ok, scale, softcap=None, sinks=None):
    """float64: (H, T, D) x (Hkv, T, D) x (Hkv, T, Dv) -> (1, T, H, Dv); soft-cap before the mask, one sink logit per
    head in every row's denominator."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(rep, 0), v.double().repeat_interleave(rep, 0)
    s = q.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
    a = s.softmax(-1)[..., : ok.shape[-1]]
    return (a @ v).transpose(0, 1)[None]


def mask(lay, prompts, comps, window=None):
    ok = allowed(prompts, comps)
    if window is not None:
        pos = lay.position_ids[0]
        ok &= pos[:, None] - pos[None, :] < window
    return ok


def inputs(prompts=PROMPTS, comps=COMPLETIONS, dv=D, seed=0):
    lay = build_layout(prompts, comps, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(h, lay.n_tokens, d, generator=g).requires_grad_() for h, d in ((H, D), (HKV, D), (HKV, dv)))
    return lay, q, k, v


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
CASES = {
    "window": (ScoreExtras(window=3), dict(window=3)),
    "window 2": (ScoreExtras(window=2), dict(window=2)),
    "softcap": (ScoreExtras(softcap=1.5), dict(softcap=1.5)),
    "sinks": (ScoreExtras(sinks=SINKS), dict(sinks=SINKS)),
    "all": (ScoreExtras(window=4, softcap=2.0, sinks=SINKS), dict(window=4, softcap=2.0, sinks=SINKS)),
    "none": (ScoreExtras(), {}),
}


@pytest.mark.parametrize("equal", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradients_equal_attention_written_out(case, equal):
    extras, ref = CASES[case]
    prompts, comps = EQUAL if equal else (PROMPTS, COMPLETIONS)
    lay, q, k, v = inputs(prompts, comps, dv=6)
    assert (lay.prompt_valid is None) == equal
    out = score_attention(q, k, v, lay, SCALE, 0.0, extras)
    ok = mask(lay, prompts, comps, ref.get("window"))
    want = reference(q, k, v, ok, SCALE, ref.get("softcap"), ref.get("sinks"))
    assert out.shape == want.shape == (1, lay.n_tokens, H, 6) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
    g_o = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), g_o)
    for a, b in zip(got, torch.autograd.grad(want, (q, k, v), g_o.double())):
        assert torch.isfinite(a).all()  # a padded prompt slot past the window has no key, yet no NaN comes back
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1e-5)


def test_each_extra_matters_and_the_reference_sees_it():
    """Each extra changes the attention (so the equality above is not that of plain attention)."""
    lay, q, k, v = inputs()
    plain = score_attention(q, k, v, lay, SCALE, 0.0, ScoreExtras())
    for extras, _ in CASES.values():
        if extras.any():
            assert (score_attention(q, k, v, lay, SCALE, 0.0, extras) - plain).abs().max() > 1e-3


def test_any_is_true_with_any_one_extra():
    assert not ScoreExtras().any()
    assert ScoreExtras(window=1).any() and ScoreExtras(softcap=1.0).any() and ScoreExtras(sinks=SINKS).any()


def test_a_bfloat16_layer_gets_bfloat16_out_of_fp32_scores():
    lay, q, k, v = inputs()
    q16, k16, v16 = (x.detach().bfloat16() for x in (q, k, v))
    out = score_attention(q16, k16, v16, lay, SCALE, 0.0, ScoreExtras(window=3, sinks=SINKS.bfloat16()))
    want = reference(q16, k16, v16, mask(lay, PROMPTS, COMPLETIONS, 3), SCALE, sinks=SINKS)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=0, atol=3e-2)


def test_a_bfloat16_layer_without_sinks_gets_bfloat16_too():
    lay, q, k, v = inputs()
    q16, k16, v16 = (x.detach().bfloat16() for x in (q, k, v))
    out = score_attention(q16, k16, v16, lay, SCALE, 0.0, ScoreExtras(window=3))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(q16, k16, v16, mask(lay, PROMPTS, COMPLETIONS, 3), SCALE),
                               rtol=0, atol=3e-2)


def test_dropout_drops_weights_of_prompts_and_completions_and_keeps_the_expectation():
    lay, q, k, v = inputs()
    q, k, v = q.detach(), k.detach(), v.detach()
    extras = ScoreExtras(window=3)
    want = score_attention(q, k, v, lay, SCALE, 0.0, extras)
    torch.manual_seed(0)
    runs = torch.stack([score_attention(q, k, v, lay, SCALE, 0.3, extras) for _ in range(400)])
    assert torch.equal(score_attention(q, k, v, lay, SCALE, 0.0, extras), want)
    torch.manual_seed(1)
    dropped = _dropped(torch.ones(20000), 0.3)  # 30 % of the weights gone, the others scaled by 1 / 0.7
    assert abs((dropped == 0).float().mean().item() - 0.3) < 0.02
    torch.testing.assert_close(dropped[dropped != 0], torch.full_like(dropped[dropped != 0], 1 / 0.7))
    prompt_rows, comp_rows = lay.src < lay.n_groups * lay.max_prompt, lay.src >= lay.n_groups * lay.max_prompt
    for rows in (prompt_rows, comp_rows):
        assert (runs[0][:, rows] - want[:, rows]).abs().max() > 0.1  # dropped: this run differs
        torch.testing.assert_close(runs.mean(0)[:, rows], want[:, rows], rtol=0, atol=0.25)
