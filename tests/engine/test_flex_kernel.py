"""The FlexAttention kernel of the shared layout: its block mask, its outputs, and how it is chosen.

On CPU PyTorch runs FlexAttention forward-only (its reference implementation), so outputs are checked here
without grad; the gradient test needs CUDA and is skipped elsewhere.
"""

import warnings

import pytest
import torch

from grpo.engine import logprobs, token_logprobs
from grpo.engine.flex_kernel import build_block_mask, flex_available, flex_length, segment_mask_mod
from grpo.engine.layout import build_layout
from tests.engine.test_logprobs import (
    FAMILIES,
    assert_grads_close,
    grads,
    make_data,
    make_model,
    max_err,
    reference,
    weights_like,
)

flex = pytest.importorskip("torch.nn.attention.flex_attention")  # this torch has no FlexAttention: all skipped

# long enough for several 128-token blocks: skipped completion-vs-completion blocks, full prompt blocks
LONG_PROMPTS = [130, 1, 40]
LONG_COMPLETIONS = [[50, 3, 70], [5], [1, 2, 90, 30, 4]]


def dense_mask(layout):
    """The layout's token mask written out by hand: causal, own segment or own group's prompt."""
    T = layout.n_tokens
    seg, pseg = layout.segment.tolist(), layout.prompt_segment.tolist()
    m = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for k in range(q + 1):
            m[q, k] = seg[k] == seg[q] or seg[k] == pseg[q]
    return m


def test_mask_is_the_per_sequence_visibility():
    prompts, comps = make_data([3, 2], [[2, 1], [3]])
    layout = build_layout(prompts, comps, "cpu")
    m = dense_mask(layout)
    # group 0: prompt 0-2, completion 3-4, completion 5; group 1: prompt 6-7, completion 8-10
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert m[5].nonzero().flatten().tolist() == [0, 1, 2, 5]
    assert m[10].nonzero().flatten().tolist() == [6, 7, 8, 9, 10]
    q, k = torch.meshgrid(torch.arange(layout.n_tokens), torch.arange(layout.n_tokens), indexing="ij")
    assert torch.equal(segment_mask_mod(layout.segment, layout.prompt_segment)(0, 0, q, k), m)
    # the flex kernel's row is padded to a bucket length; its mask is the same on the real tokens and keeps
    # real queries off the padding
    bm = build_block_mask(layout, block=16)
    T = bm.seq_lengths[0]
    assert T == flex_length(layout.n_tokens, 16) == 16
    q, k = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    padded = bm.mask_mod(0, 0, q, k)
    assert torch.equal(padded[: layout.n_tokens, : layout.n_tokens], m)
    assert not padded[: layout.n_tokens, layout.n_tokens:].any()
    assert padded.any(-1).all()  # every padding query sees something (itself): no empty softmax


@pytest.mark.parametrize("block,band", [(128, 1 << 25), (16, 1), (16, 1 << 25), (32, 5000)])
def test_block_mask_equals_pytorch_construction(block, band):
    """Our banded block classification against PyTorch's dense create_block_mask of the same mask_mod."""
    prompts, comps = make_data(LONG_PROMPTS, LONG_COMPLETIONS)
    layout = build_layout(prompts, comps, "cpu")
    mine = build_block_mask(layout, block=block, band_elements=band)
    T = mine.seq_lengths[0]
    assert T == flex_length(layout.n_tokens, block) and T >= layout.n_tokens and T & (T - 1) == 0
    want = flex.create_block_mask(mine.mask_mod, None, None, T, T, device="cpu", BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(want, name)), name
    assert torch.equal(mine.to_dense(), want.to_dense())
    if block == 16:
        assert mine.sparsity() > 50  # completions do not see each other: most blocks are skipped


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("lens", ["short", "long"])
def test_flex_forward_matches_reference(family, lens):
    model = make_model(family, "sdpa")
    prompts, comps = make_data() if lens == "short" else make_data(LONG_PROMPTS, LONG_COMPLETIONS)
    with torch.no_grad():
        want, want_ent = reference(model, prompts, comps, temperature=0.7)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            got, ent = token_logprobs(model, prompts, comps, attention_kernel="flex", temperature=0.7,
                                      return_entropy=True, max_tokens_per_micro_batch=300)
    assert max_err(got, want) <= 1e-5
    assert max_err(ent, want_ent) <= 1e-5


def test_kernel_choice_and_errors():
    model = make_model()
    prompts, comps = make_data()
    assert logprobs._resolve_kernel("auto", model) == "grouped"  # flex is opt-in until measured on a GPU
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        token_logprobs(model, prompts, comps, attention_kernel="fast")
    with pytest.raises(ValueError, match="cannot run backward on CPU"):
        token_logprobs(model, prompts, comps, attention_kernel="flex")
    dropout_model = make_model(attention_dropout=0.1).train()
    with torch.no_grad(), pytest.raises(ValueError, match="attention dropout"):
        token_logprobs(dropout_model, prompts, comps, attention_kernel="flex")


def test_flex_lengths_are_few():
    """Micro-batches of any size map to a handful of row lengths (one compiled kernel each at most)."""
    assert {flex_length(n) for n in range(1, 16385)} == {1 << k for k in range(7, 15)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flex_gradients_on_cuda(family):
    model = make_model(family, "sdpa").cuda()
    prompts, comps = make_data(LONG_PROMPTS, LONG_COMPLETIONS)
    want, _ = reference(model.cpu(), prompts, comps)
    w = weights_like(want)
    want_grads = grads(model, want, w)
    model.cuda()
    got = token_logprobs(model, prompts, comps, attention_kernel="flex")
    assert max_err([[x.cpu() for x in r] for r in got], want) <= 1e-4
    got_grads = {n: g.cpu() for n, g in grads(model, got, [[x.cuda() for x in r] for r in w]).items()}
    assert_grads_close(got_grads, want_grads, rel=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs CUDA")
def test_flex_bf16_on_cuda_over_several_lengths():
    """bf16, compiled, several micro-batch sizes (different padded lengths) against the standard layout run by
    the model's own SDPA attention in bf16: within 2e-2."""
    model = make_model("llama", "sdpa").cuda().to(torch.bfloat16)
    prompts, comps = make_data(LONG_PROMPTS, LONG_COMPLETIONS)
    with torch.no_grad():
        want = token_logprobs(model, prompts, comps, shared_prefix=False)
        for budget in (None, 400, 200):
            got = token_logprobs(model, prompts, comps, attention_kernel="flex", max_tokens_per_micro_batch=budget)
            assert max_err(got, want) <= 2e-2


# many short segments: at small block sizes, blocks with exactly one visible pair, rows with several partial
# blocks, and a row of 35 tokens padded to 64 (or 128) beyond its last block
SHORT_PROMPTS = [5, 1, 3]
SHORT_COMPLETIONS = [[4, 1, 6], [2], [1, 7, 2, 3]]


def short_layout():
    return build_layout(*make_data(SHORT_PROMPTS, SHORT_COMPLETIONS), "cpu")


def eager_attention(q, k, v, mask, scale):
    """Attention written out: q (1, H, T, D), k/v (1, Hkv, T, D), query head h on kv head h // (H / Hkv)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)


def qkv(n, heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, dim, generator=g) for h in (heads, kv_heads, kv_heads))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("block", [2, 4, 16, 128])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_flex_forward_equals_eager_attention(block, kv_heads):
    """GQA (4 query heads on 2 kv heads) and not, a scale other than 1/sqrt(D), the row padded beyond its last
    token to the bucket (35 -> 64 or 128): the packed row's attention is the hand-written masked softmax."""
    from grpo.engine.flex_kernel import flex_attention_forward

    layout = short_layout()
    layout.block_mask = build_block_mask(layout, block=block)
    assert layout.block_mask.seq_lengths[0] > layout.n_tokens
    q, k, v = qkv(layout.n_tokens, kv_heads=kv_heads)
    got = flex_attention_forward(q, k, v, layout, 0.3)
    want = eager_attention(q, k, v, dense_mask(layout), 0.3)
    assert got.shape == (1, layout.n_tokens, 4, 8)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [1, 2, 4, 8])
def test_small_blocks_equal_pytorch_construction_and_its_order(block):
    """Block sizes down to one token on many short segments, against PyTorch's create_block_mask: the same
    partial and full blocks, listed in the same order (the set columns first, ascending) and type (int32)."""
    layout = short_layout()
    mine = build_block_mask(layout, block=block)
    T = mine.seq_lengths[0]
    assert T == flex_length(layout.n_tokens, block) == 64
    want = flex.create_block_mask(mine.mask_mod, None, None, T, T, device="cpu", BLOCK_SIZE=block)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "full_q_num_blocks"):
        assert torch.equal(getattr(mine, name), getattr(want, name)), name
        assert getattr(mine, name).dtype == getattr(want, name).dtype == torch.int32, name  # the kernels' index type
    assert torch.equal(mine.to_dense(), want.to_dense())


@pytest.mark.parametrize("block", [4, 16, 128])
def test_padding_is_a_segment_of_its_own(block):
    """The padding tokens after the row see the padding before them and nothing else; no real token sees them."""
    layout = short_layout()
    bm = build_block_mask(layout, block=block)
    n, T = layout.n_tokens, bm.seq_lengths[0]
    q, k = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    want = torch.zeros(T, T, dtype=torch.bool)
    want[:n, :n] = dense_mask(layout)
    want[n:, n:] = torch.ones(T - n, T - n, dtype=torch.bool).tril()
    assert torch.equal(bm.mask_mod(0, 0, q, k), want)


def test_block_must_be_a_power_of_two():
    layout = short_layout()
    for bad in (0, -4, 3, 6, 12):
        with pytest.raises(ValueError, match="power of two"):
            build_block_mask(layout, block=bad)
    assert build_block_mask(layout, block=1).seq_lengths == (64, 64)


def test_flex_length_is_the_smallest_power_of_two_bucket():
    for block in (1, 4, 16, 128):
        for n in range(1, 600):
            T = flex_length(n, block)
            assert T & (T - 1) == 0 and T >= max(n, block), (n, block)
            assert T == block or T // 2 < n, (n, block)  # no smaller bucket holds the row
    assert flex_length(1) == flex_length(128) == 128 and flex_length(129) == 256  # one block of 128 by default


@pytest.mark.parametrize("blocks_per_band,extra", [(1, -1), (2, 0), (2, -1), (3, 0), (100, 0)])
def test_bands_are_whole_blocks_within_the_element_budget(monkeypatch, blocks_per_band, extra):
    """The token mask is evaluated a band of query rows at a time: the most whole blocks of rows whose T-wide mask
    fits band_elements (one block at least), the last band what is left; the block mask is the same."""
    from grpo.engine import flex_kernel

    layout, block = short_layout(), 4
    T = flex_length(layout.n_tokens, block)
    band = blocks_per_band * T * block + extra
    rows = []

    def recording(seg, pseg, blocks=None):
        inner = segment_mask_mod(seg, pseg, blocks)

        def mask_mod(b, h, q, kv):
            rows.append(q.numel())
            return inner(b, h, q, kv)
        return mask_mod

    monkeypatch.setattr(flex_kernel, "segment_mask_mod", recording)
    bm = build_block_mask(layout, block=block, band_elements=band)
    per_band = max(1, band // (T * block)) * block
    assert per_band * T <= max(band, block * T)
    want = [per_band] * (T // per_band) + ([T % per_band] if T % per_band else [])
    assert rows == want
    assert torch.equal(bm.to_dense(), build_block_mask(layout, block=block).to_dense())


def test_flex_available_says_whether_torch_has_flex_attention(monkeypatch):
    import sys

    assert flex_available()
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)  # its import now fails
    assert not flex_available()
