"""The grouped kernel for layers whose scores are more than ``q k^T * scaling``: sliding windows, soft-capping, sinks.

Same layout and the same rule as grpo/engine/grouped_attention.py (prompt once per group; every completion over
[its group's prompt K/V; its own K/V] in one joint softmax, the prompt K/V never copied per completion), with the
scores written out so that each layer's extras apply exactly as in the model's own eager attention:

* **sliding window** of W tokens (Mistral, Gemma 2/3, GPT-OSS, Cohere 2, OLMo 3, ...): a query at position i sees
  keys at positions j with ``i - j < W`` (transformers' ``sliding_window_overlay``). Positions are the per-sequence
  ones: a completion's token k sits at ``len(P) + k``, so against its prompt it sees the slots
  ``j > len(P) + k - W`` and against itself ``k - k' < W``, the keys the per-sequence forward keeps. Within a
  prompt's bidirectional block (Gemma 3's image tokens) a query also sees the block's later keys, and the window
  still cuts the keys ``W`` or more behind it (transformers' ``and_masks(or_masks(causal, blockwise), window)``).
* **attention logit soft-capping** (Gemma 2): ``s = cap * tanh(s / cap)`` before the mask.
* **attention sinks** (GPT-OSS, ``s_aux``): one learned logit per head joins every row's softmax denominator and
  is dropped from the weights.
* attention dropout while training (the weights are dropped after the joint softmax).

Autograd records these scores (``H x G*S x (P + S)`` fp32 per layer while it runs backward), unlike the fused paths
of the plain layers. Shapes: q (H, T, D); k (Hkv, T, D); v (Hkv, T, Dv). Returns (1, T, H, Dv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo.engine.layout import PrefixLayout, prompt_mask


@dataclass
class ScoreExtras:
    """What a layer adds to ``q k^T * scaling``: an active window (tokens), a soft-cap, per-head sink logits."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (H,)

    def any(self) -> bool:
        return self.window is not None or self.softcap is not None or self.sinks is not None


def _softmax(scores: torch.Tensor, allowed: torch.Tensor, extras: ScoreExtras, dtype) -> torch.Tensor:
    """softmax over the last dim of ``scores`` (fp32; soft-capped, masked, with a sink column per head when the
    layer has them), the sink's weight dropped. ``scores`` has its head dim at position 1."""
    if extras.softcap is not None:
        scores = torch.tanh(scores / extras.softcap) * extras.softcap
    scores = scores.masked_fill(~allowed, -torch.inf)
    if extras.sinks is None:
        return torch.softmax(scores, dim=-1).to(dtype)
    shape = [1] * scores.dim()
    shape[1] = -1
    sink = extras.sinks.float().view(shape).expand(*scores.shape[:-1], 1)
    joint = torch.cat([scores, sink], dim=-1)  # torch.softmax subtracts the row's max itself
    return torch.softmax(joint, dim=-1)[..., :-1].to(dtype)


def score_attention(q, k, v, layout: PrefixLayout, scaling: float, dropout: float, extras: ScoreExtras):
    """The shared layout's attention with the score-level extras of one layer (see the module doc)."""
    H, T, D = q.shape
    Hkv, Dv = k.shape[0], v.shape[-1]
    rep = H // Hkv
    B, Pmax, Gmax, Smax = layout.n_groups, layout.max_prompt, layout.max_group, layout.max_completion
    idx = layout.prompt_idx  # (long, on the layout's device: what the index tensors below are made like)
    plen = idx.new_full((B,), Pmax) if layout.prompt_valid is None else layout.prompt_valid.sum(1)
    valid = idx.new_ones(B, Pmax, dtype=torch.bool) if layout.prompt_valid is None else layout.prompt_valid
    j = torch.arange(Pmax, device=idx.device)  # pragma: no mutate  (made on the device: no copy from the host)
    s_idx = torch.arange(Smax, device=idx.device)  # pragma: no mutate

    # ---- prompts: causal (and windowed) self-attention, once per group ----
    qp = q.index_select(1, layout.prompt_idx).view(Hkv, rep, B, Pmax, D).permute(2, 0, 1, 3, 4)
    kp = k.index_select(1, layout.prompt_idx).view(Hkv, B, Pmax, D).transpose(0, 1)  # (B, Hkv, Pmax, D)
    vp = v.index_select(1, layout.prompt_idx).view(Hkv, B, Pmax, Dv).transpose(0, 1)
    allowed = prompt_mask(layout)  # (B, Pmax, Pmax): causal or in one bidirectional block, valid keys
    if allowed is None:
        allowed = (j[None, :] <= j[:, None])[None].repeat(B, 1, 1)
    if extras.window is not None:  # after the blocks: AND(window, OR(causal, block)), as Gemma 3's masks compose
        allowed &= (j[:, None] - j[None, :] < extras.window)[None]
    allowed[..., :1] |= ~allowed.any(-1, keepdim=True)  # padded prompt slots past a window: a finite row (dropped)
    s = torch.matmul(qp.reshape(B, Hkv, rep * Pmax, D), kp.transpose(2, 3)).float() * scaling
    a = _dropped(_softmax(s.view(B, H, Pmax, Pmax), allowed[:, None], extras, v.dtype), dropout)
    out_p = torch.matmul(a.view(B, Hkv, rep * Pmax, Pmax), vp).view(B, H, Pmax, Dv)
    out_p = out_p.transpose(1, 2).reshape(B * Pmax, H * Dv)

    # ---- completions: one joint softmax over [prompt K/V of the group; own K/V] ----
    qc = q.index_select(1, layout.comp_idx).view(Hkv, rep, B, Gmax, Smax, D).permute(2, 0, 1, 3, 4, 5)
    kc = k.index_select(1, layout.comp_idx).view(Hkv, B, Gmax, Smax, D).transpose(0, 1)  # (B, Hkv, G, S, D)
    vc = v.index_select(1, layout.comp_idx).view(Hkv, B, Gmax, Smax, Dv).transpose(0, 1)
    s_p = torch.matmul(qc.reshape(B, Hkv, rep * Gmax * Smax, D), kp.transpose(2, 3)).float() * scaling
    s_c = torch.matmul(qc, kc.unsqueeze(2).transpose(-1, -2)).float() * scaling  # (B, Hkv, rep, G, S, S)
    a_pr = valid[:, None, :].expand(B, Smax, Pmax)  # (B, S, P): completion token k against prompt slot j
    a_own = s_idx[None, :] <= s_idx[:, None]  # (S, S)
    if extras.window is not None:
        a_pr = a_pr & (plen[:, None, None] + s_idx[None, :, None] - j[None, None, :] < extras.window)
        a_own = a_own & (s_idx[:, None] - s_idx[None, :] < extras.window)
    scores = torch.cat([s_p.view(B, H, Gmax, Smax, Pmax), s_c.view(B, H, Gmax, Smax, Smax)], dim=-1)
    allowed = torch.cat([a_pr, a_own[None].expand(B, Smax, Smax)], dim=-1)[:, None, None]  # (B, 1, 1, S, P+S)
    a = _dropped(_softmax(scores, allowed, extras, v.dtype), dropout)  # finite: a token always sees itself
    a_p, a_c = a[..., :Pmax], a[..., Pmax:]
    o_p = torch.matmul(a_p.reshape(B, Hkv, rep * Gmax * Smax, Pmax), vp).view(B, Hkv, rep, Gmax, Smax, Dv)
    o_c = torch.matmul(a_c.reshape(B, Hkv, rep, Gmax, Smax, Smax), vc.unsqueeze(2))
    out_c = (o_p + o_c).permute(0, 3, 4, 1, 2, 5).reshape(B * Gmax * Smax, H * Dv)

    out = torch.cat([out_p, out_c]).index_select(0, layout.src)  # both in v's dtype
    return out.view(1, T, H, Dv)


def _dropped(a: torch.Tensor, dropout: float) -> torch.Tensor:
    return F.dropout(a, p=dropout)  # the caller's p is 0 unless the layer trains: then the weights as they are
