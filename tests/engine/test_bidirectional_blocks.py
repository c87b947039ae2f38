"""Bidirectional blocks in the packed layout (grpo/engine/layout.py's ``blocks``: Gemma 3's image tokens): every kernel
equals attention written out in float64 over transformers' own mask functions applied to each sequence [P; R_i]
(``or_masks(causal, blockwise_overlay)``, and for a sliding-window layer ``and_masks(..., sliding_window_overlay)``),
forward and gradients; a block that is dropped, or a window applied before the blocks, is caught."""
import pytest
import torch
from transformers.masking_utils import (
    and_masks,
    blockwise_overlay,
    causal_mask_function,
    or_masks,
    sliding_window_overlay,
)

from grpo.engine.flex_kernel import build_block_mask, flex_attention_forward
from grpo.engine.grouped_attention import grouped_attention
from grpo.engine.layout import build_layout
from grpo.engine.score_attention import ScoreExtras, score_attention
from tests.engine.test_grouped_attention import reference  # float64 attention over a (T, T) mask

torch.set_num_threads(1)
# ragged prompts with blocks (two in the last, one at the prompt's end, one a single token), G = 2, 1, 2
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
SPANS = [[(1, 5)], [(3, 4)], [(2, 5), (6, 9)]]
COMPLETIONS = [[[21, 22], [23]], [[24, 25, 26]], [[27], [28, 29, 30, 31]]]
H, HKV, D, SCALE, WINDOW = 4, 2, 8, 0.3, 3


def hf_allowed(window: int | None, spans=SPANS, prompts=PROMPTS, completions=COMPLETIONS) -> torch.Tensor:
    """(T, T) bool on the packed row: each sequence [P; R_i]'s mask from transformers' mask functions (per-sequence
    indices), put where its tokens sit in the row."""
    T = sum(len(p) + sum(map(len, cs)) for p, cs in zip(prompts, completions))
    ok = torch.zeros(T, T, dtype=torch.bool)
    t = 0
    for p, cs, sp in zip(prompts, completions, spans):
        P, start = len(p), t
        t += P
        for r in cs:
            L = P + len(r)
            blocks = torch.full((1, L), -1)
            for n, (a, b) in enumerate(sp):
                blocks[0, a:b] = n
            fn = or_masks(causal_mask_function, blockwise_overlay(blocks))
            if window is not None:
                fn = and_masks(fn, sliding_window_overlay(window))
            q, k = torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij")
            m = fn(torch.zeros_like(q), 0, q, k)
            rows = list(range(start, start + P)) + list(range(t, t + len(r)))  # the sequence's tokens in the row
            idx = torch.tensor(rows)
            ok[idx[:, None], idx[None, :]] = m
            t += len(r)
    return ok


def inputs(spans=SPANS, prompts=PROMPTS, completions=COMPLETIONS):
    lay = build_layout(prompts, completions, torch.device("cpu"), bidirectional=spans)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, lay.n_tokens, D, generator=g).requires_grad_() for h in (H, HKV, HKV))
    return lay, q, k, v


def _grouped(q, k, v, lay):
    return grouped_attention(q, k, v, lay, SCALE, 0.0)


def _windowed(q, k, v, lay):
    return score_attention(q[0], k[0], v[0], lay, SCALE, 0.0, ScoreExtras(window=WINDOW))


@pytest.mark.parametrize("kernel, window", [(_grouped, None), (_windowed, WINDOW)])
def test_kernels_equal_transformers_masks_with_blocks(kernel, window):
    lay, q, k, v = inputs()
    assert lay.blocks is not None and lay.prompt_valid is not None
    ok = hf_allowed(window)
    assert ok[1, 4] and not ok[0, 1]  # an image token sees its block ahead; text does not see the block
    out, want = kernel(q, k, v, lay), reference(q, k, v, ok, SCALE)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)
    g_o = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g_o), torch.autograd.grad(want, (q, k, v), g_o.double())):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=1e-5)


# prompts of one length (no padding: the layout's prompt_valid is None), and a first prompt shorter than the others
# whose block starts at the row's first token (what a padded slot of its group reads)
EVEN = ([[1, 2, 3, 4], [5, 6, 7, 8]], [[(1, 3)], []], [[[9], [10, 11]], [[12, 13]]])
SHORT_FIRST = ([[1, 2, 3], [4, 5, 6, 7, 8]], [[(0, 2)], [(1, 4)]], [[[9, 10], [11]], [[12], [13, 14]]])


@pytest.mark.parametrize("prompts, spans, completions", [EVEN, SHORT_FIRST], ids=["one-length", "short-first"])
def test_the_grouped_kernel_equals_transformers_masks_with_prompts_of_one_length_or_a_short_first(
        prompts, spans, completions):
    lay, q, k, v = inputs(spans, prompts, completions)
    assert (lay.prompt_valid is None) == (prompts is EVEN[0])
    out = _grouped(q, k, v, lay)
    want = reference(q, k, v, hf_allowed(None, spans, prompts, completions), SCALE)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6)


def test_the_rule_is_caught_when_broken():
    """Dropping the blocks (causal everywhere), or windowing before the blocks (a block's keys far behind stay
    visible), differs from the reference."""
    lay, q, k, v = inputs()
    want = reference(q, k, v, hf_allowed(WINDOW), SCALE)
    assert (_windowed(q, k, v, inputs(spans=None)[0]).double() - want).abs().max() > 1e-2
    wrong = hf_allowed(WINDOW) | _same_block(lay)  # OR(AND(causal, window), block): block keys past the window kept
    assert not torch.equal(wrong, hf_allowed(WINDOW))
    assert (reference(q, k, v, wrong, SCALE) - want).abs().max() > 1e-2


def _same_block(lay) -> torch.Tensor:
    b = lay.blocks
    return (b[:, None] == b[None, :]) & (b[:, None] >= 0)


@pytest.mark.skipif(not hasattr(torch.nn.attention, "flex_attention"), reason="no FlexAttention in this torch")
def test_flex_kernel_honours_the_blocks():
    lay, q, k, v = inputs()
    lay.block_mask = build_block_mask(lay, block=16)
    with torch.no_grad():
        out = flex_attention_forward(q, k, v, lay, SCALE)
    torch.testing.assert_close(out.double(), reference(q, k, v, hf_allowed(None), SCALE), rtol=0, atol=2e-6)


@pytest.mark.parametrize("span", [(3, 5), (2, 2), (-1, 2)])
def test_a_span_outside_its_prompt_or_empty_is_refused(span):
    with pytest.raises(ValueError, match=rf"group 1: bidirectional span \[{span[0]}, {span[1]}\) is not inside its "
                                         "prompt of 4"):
        build_layout(PROMPTS, COMPLETIONS, "cpu", bidirectional=[[], [span], []])
