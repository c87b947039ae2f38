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


def build_layout(prompts: list[list[int]], completions: list[list[list[int]]], device) -> PrefixLayout:
    """Pack groups (prompt, completions) into one row and build the index tensors."""
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
    )
