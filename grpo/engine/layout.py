"""The packed layout of one micro-batch: which tokens exist, where they sit in the row, their position ids.

One micro-batch is packed into a single row without padding::

    [P_1; R_11; ...; R_1G; P_2; R_21; ...]

with position ids restarting at len(P_b) for every completion. :func:`build_layout` returns the index tensors
the attention kernels (grpo/engine/grouped_attention.py, grpo/engine/flex_kernel.py) and the log-prob head need:
prompt and completion slots, each token's segment, and the positions that predict a completion token.
See docs/prefix-engine.md.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch

# The layout (training) or shared prompt K/V (decoding) of the forward running now, for decoder layers that do not
# pass their keyword arguments on to attention (StableLM): set by grpo.engine.patch.switched_attention.
ACTIVE: contextvars.ContextVar = contextvars.ContextVar("grpo_engine_active", default=None)


@dataclass
class PrefixLayout:
    """Index tensors describing one packed micro-batch (all on the model's device)."""

    n_tokens: int  # T, length of the packed row
    n_groups: int  # B
    max_prompt: int  # Pmax
    max_group: int  # Gmax
    max_completion: int  # Smax
    max_seq_len: int  # longest P + S_i (what a sliding window would have to cover)
    prompt_lens: list  # len(P_b) per group (recurrent layers run prompts of one length together)
    prompt_idx: torch.Tensor  # (B*Pmax,) flat token index of each prompt slot (0 for padding)
    prompt_valid: torch.Tensor | None  # (B, Pmax) bool, None when every prompt has length Pmax
    comp_idx: torch.Tensor  # (B*Gmax*Smax,) flat token index of each completion slot (0 for padding)
    src: torch.Tensor  # (T,) slot of every token in cat([prompt slots, completion slots])
    position_ids: torch.Tensor  # (1, T)
    input_ids: torch.Tensor  # (1, T)
    pred_idx: torch.Tensor  # (M,) token whose hidden state predicts each completion token, (group, completion, k)
    targets: torch.Tensor  # (M,) the completion tokens, same order
    segment: torch.Tensor  # (T,) one id per prompt and per completion, unique in the row
    prompt_segment: torch.Tensor  # (T,) the segment id of the token's group prompt
    # (T,) the bidirectional block of every token (-1: none), unique in the row: tokens of one block attend to each
    # other both ways (Gemma 3's image tokens), everything else causally; None when the row has no block
    blocks: torch.Tensor | None = None
    block_mask: object = None  # FlexAttention BlockMask over the row padded to a bucket length; selects flex
    calls: int = 0  # attention calls seen in forward (to verify every layer went through us)


@dataclass
class _Packing:
    """The layout as Python lists, filled group by group (see :func:`_pack`)."""

    prompt_idx: list[int]
    comp_idx: list[int]
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    src: list[int] = field(default_factory=list)
    seg: list[int] = field(default_factory=list)
    pseg: list[int] = field(default_factory=list)
    pred: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)


def _pack(prompts: list[list[int]], completions: list[list[list[int]]], Pmax: int, Gmax: int, Smax: int) -> _Packing:
    """Lay the groups out one after the other: each prompt, then its completions."""
    B = len(prompts)
    out = _Packing(prompt_idx=[0] * (B * Pmax), comp_idx=[0] * (B * Gmax * Smax))
    n_prompt_slots = B * Pmax
    for b, (p, comps) in enumerate(zip(prompts, completions)):
        P = len(p)
        for j in range(P):
            out.prompt_idx[b * Pmax + j] = len(out.ids)
            out.src.append(b * Pmax + j)
            out.ids.append(p[j])
            out.pos.append(j)
        out.seg.extend([b * (Gmax + 1)] * P)
        for i, r in enumerate(comps):
            base = (b * Gmax + i) * Smax
            for k, tok in enumerate(r):
                out.pred.append(len(out.ids) - 1 if k else out.prompt_idx[b * Pmax + P - 1])
                out.targets.append(tok)
                out.comp_idx[base + k] = len(out.ids)
                out.src.append(n_prompt_slots + base + k)
                out.ids.append(tok)
                out.pos.append(P + k)
            out.seg.extend([b * (Gmax + 1) + i + 1] * len(r))
        out.pseg.extend([b * (Gmax + 1)] * (P + sum(len(r) for r in comps)))
    return out


def build_layout(prompts: list[list[int]], completions: list[list[list[int]]], device,
                 bidirectional: list[list[tuple[int, int]]] | None = None) -> PrefixLayout:
    """Pack groups (prompt, completions) into one row and build the index tensors. ``bidirectional``: per prompt,
    the spans ``[start, end)`` of its tokens that attend to each other both ways (a family's own rule, e.g. one
    image's tokens in Gemma 3; grpo/engine/vision_families.py); they lie inside the prompt, so every completion
    still sees the whole prompt and the prompt never sees a completion."""
    B = len(prompts)
    Pmax = max(len(p) for p in prompts)
    Gmax = max(max(len(c), 1) for c in completions)
    Smax = max([1] + [len(r) for c in completions for r in c])
    packed = _pack(prompts, completions, Pmax, Gmax, Smax)
    lens = [len(p) for p in prompts]
    prompt_valid = None
    if min(lens) != Pmax:
        prompt_valid = torch.arange(Pmax)[None, :] < torch.tensor(lens)[:, None]
        prompt_valid = prompt_valid.to(device)

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    return PrefixLayout(
        n_tokens=len(packed.ids),
        n_groups=B,
        max_prompt=Pmax,
        max_group=Gmax,
        max_completion=Smax,
        max_seq_len=max(len(p) + max([0] + [len(r) for r in c]) for p, c in zip(prompts, completions)),
        prompt_lens=lens,
        prompt_idx=t(packed.prompt_idx),
        prompt_valid=prompt_valid,
        comp_idx=t(packed.comp_idx),
        src=t(packed.src),
        position_ids=t(packed.pos)[None, :],
        input_ids=t(packed.ids)[None, :],
        pred_idx=t(packed.pred),
        targets=t(packed.targets),
        segment=t(packed.seg),
        prompt_segment=t(packed.pseg),
        blocks=_blocks(packed, bidirectional, lens, Pmax, device),
    )


def _blocks(packed: _Packing, spans, lens: list[int], Pmax: int, device) -> torch.Tensor | None:
    """(T,) block id per token of the packed row (-1: none), from each prompt's bidirectional spans."""
    if not spans or not any(spans):
        return None
    blocks = [-1] * len(packed.ids)
    n = 0
    for b, (prompt_spans, P) in enumerate(zip(spans, lens)):
        for start, end in prompt_spans:
            if not 0 <= start < end <= P:
                raise ValueError(f"group {b}: bidirectional span [{start}, {end}) is not inside its prompt of {P}")
            for j in range(start, end):
                blocks[packed.prompt_idx[b * Pmax + j]] = n
            n += 1
    return torch.tensor(blocks, dtype=torch.long, device=device)


def prompt_mask(layout: PrefixLayout) -> torch.Tensor | None:
    """(B, Pmax, Pmax) bool, who each prompt slot attends to within its prompt: earlier slots and its own
    bidirectional block (transformers' ``or_masks(causal, blockwise_overlay)``), valid slots only; None when that
    is plain causal over prompts of one length (then a kernel may use its causal fast path)."""
    if layout.blocks is None and layout.prompt_valid is None:
        return None
    P, device = layout.max_prompt, layout.prompt_idx.device
    allowed = torch.ones(P, P, dtype=torch.bool, device=device).tril()[None]
    valid = layout.prompt_valid
    if layout.blocks is not None:
        blk = layout.blocks.index_select(0, layout.prompt_idx).view(layout.n_groups, P)
        if valid is not None:
            blk = blk.masked_fill(~valid, -1)  # a padded slot reads token 0's block: none
        allowed = allowed | ((blk[:, :, None] == blk[:, None, :]) & (blk[:, :, None] >= 0))
    return allowed if valid is None else allowed & valid[:, None, :]
