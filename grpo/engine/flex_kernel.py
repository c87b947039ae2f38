"""The flex kernel of the shared layout: PyTorch FlexAttention on the packed row with an exact block mask.

A token sees earlier tokens of its own segment (a prompt, or one completion) and its group's prompt (and, within a
prompt, its whole bidirectional block: grpo/engine/layout.py's ``blocks``). The
BlockMask is built from the layout in bands of query rows; the row is padded to a power-of-two length so that
micro-batches of any size meet a handful of compiled kernels. PyTorch's FlexAttention has no backward on CPU:
there it serves no-grad forwards and the tests. See docs/prefix-engine.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.engine.layout import PrefixLayout


def flex_attention_forward(query, key, value, layout: PrefixLayout, scaling: float) -> torch.Tensor:
    """The packed row's attention under ``layout.block_mask``. query: (1, H, T, D); key/value: (1, Hkv, T, D),
    padded here to the mask's length. Returns (1, T, H, Dv)."""
    pad = (0, 0, 0, layout.block_mask.seq_lengths[0] - query.shape[2])
    out = flex_fn(query.device)(F.pad(query, pad), F.pad(key, pad), F.pad(value, pad),
                                 block_mask=layout.block_mask, scale=scaling,
                                 enable_gqa=query.shape[1] != key.shape[1])
    return out[:, :, : query.shape[2]].transpose(1, 2)


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def segment_mask_mod(seg: torch.Tensor, pseg: torch.Tensor, blocks: torch.Tensor | None = None):
    """mask_mod of the packed row: a token sees earlier tokens of its own segment and its group's prompt, and every
    token of its own bidirectional block (``blocks``: one id per token, -1 for none; a block lies in one prompt)."""

    def mask_mod(b, h, q, kv):
        seen = kv <= q
        if blocks is not None:
            seen = seen | ((blocks[kv] == blocks[q]) & (blocks[q] >= 0))
        return seen & ((seg[kv] == seg[q]) | (seg[kv] == pseg[q]))

    return mask_mod


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nQ, nK) bool block matrix -> (count per row, column indices with the set ones first), BlockMask's form."""
    count = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


def build_block_mask(layout: PrefixLayout, block: int = 128, band_elements: int = 1 << 25):
    """The layout's BlockMask over its row padded to ``flex_length``, exact and in bounded memory: the token mask
    is evaluated a band of query rows at a time (never T x T at once) and reduced to empty / partial / full
    blocks. ``block`` is a power of two, so the padded length is a whole number of blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    n, device = layout.n_tokens, layout.segment.device
    T = flex_length(n, block)  # padding tokens: a segment of their own, after every real token
    seg = F.pad(layout.segment, (0, T - n), value=-1)
    pseg = F.pad(layout.prompt_segment, (0, T - n), value=-1)
    blocks = None if layout.blocks is None else F.pad(layout.blocks, (0, T - n), value=-1)
    mask_mod = segment_mask_mod(seg, pseg, blocks)
    nb = T // block
    kv = torch.arange(T, device=device)
    rows = max(1, band_elements // (T * block)) * block  # query rows per band, a whole number of blocks
    partial, full = [], []
    for s in range(0, T, rows):
        q = torch.arange(s, min(T, s + rows), device=device)
        count = mask_mod(0, 0, q[:, None], kv[None]).view(-1, block, nb, block).sum((1, 3))
        full.append(count == block * block)
        partial.append((count > 0) & (count < block * block))
    partial, full = torch.cat(partial), torch.cat(full)
    count, idx = _ordered(partial)
    fcount, fidx = _ordered(full)
    return BlockMask.from_kv_blocks(count, idx, fcount, fidx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(T, T))


def flex_length(n: int, block: int = 128) -> int:
    """The packed row's length for the flex kernel: the next power of two (at least one block), so that
    micro-batches of every size compile to a handful of kernels; padding costs only its blocks against padding
    (a segment of its own, it sees no real token)."""
    return max(block, 1 << (n - 1).bit_length())


_compiled_flex = None


def flex_fn(device: torch.device):
    """flex_attention, compiled (once, lazily) on CUDA; eager elsewhere (PyTorch's reference implementation)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex
