"""The grouped kernel: attention on the packed row, prompt once per group, and the joint softmax it shares.

Per layer, on the layout of grpo/engine/layout.py:

* prompt self-attention once per group (causal, and both ways within a bidirectional block of the layout:
  Gemma 3's image tokens; scaled_dot_product_attention), and
* completion attention of every R_i over [prompt K/V of its group; its own K/V] as one joint softmax:
  the scores against the prompt are one matmul of all G completions' queries against the *single* prompt
  K/V (no copy per completion), the scores against its own tokens are a causal block per completion.

It is exact: the same softmax over the same keys as the per-sequence forward, only grouped differently. It runs
on any device. :func:`joint_softmax` (one softmax over two score blocks, shared max and denominator) is also what
the rollout's shared-prefix decoding uses (grpo/engine/decode_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.engine.completion_attention import completion_attention
from grpo.engine.layout import PrefixLayout, prompt_mask
from grpo.engine.merged_attention import merged_attention, merged_attention_available


def joint_softmax(s_a: torch.Tensor, s_b: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over the last dims of two score blocks taken together (shared max and denominator, in the
    scores' precision); returns both blocks' attention weights in ``dtype``. At least one score per row must be
    finite."""
    m = torch.maximum(s_a.amax(-1), s_b.amax(-1)).detach().unsqueeze(-1)
    e_a, e_b = torch.exp(s_a - m), torch.exp(s_b - m)
    denom = (e_a.sum(-1) + e_b.sum(-1)).unsqueeze(-1)
    return (e_a / denom).to(dtype), (e_b / denom).to(dtype)


def grouped_attention(query, key, value, layout: PrefixLayout, scaling: float, dropout: float) -> torch.Tensor:
    """query: (1, H, T, D); key/value: (1, Hkv, T, D), rotary already applied. Returns (1, T, H, Dv)."""
    _, H, T, D = query.shape
    Hkv, Dv = key.shape[1], value.shape[-1]
    rep = H // Hkv
    B, Gmax, Smax = layout.n_groups, layout.max_group, layout.max_completion
    q, k, v = query[0], key[0], value[0]  # (H, T, D)
    out_p, kp, vp = _prompt_attention(q, k, v, layout, rep, scaling, dropout)

    # ---- completion attention over [prompt K/V of the group; own K/V], one joint softmax ----
    qc = q.index_select(1, layout.comp_idx).view(Hkv, rep, B, Gmax, Smax, D)
    kc = k.index_select(1, layout.comp_idx).view(Hkv, B, Gmax, Smax, D)
    vc = v.index_select(1, layout.comp_idx).view(Hkv, B, Gmax, Smax, Dv)
    if dropout > 0.0:
        o = _completion_attention_with_dropout(qc, kp, vp, kc, vc, layout.prompt_valid, scaling, dropout)
    else:  # no score matrix kept for backward: fused flash kernels on CPU, else score chunks
        attend = merged_attention if merged_attention_available(qc, vc) else completion_attention
        o = attend(qc.permute(2, 0, 1, 3, 4, 5).contiguous(), kp.contiguous(), vp.contiguous(),
                   kc.transpose(0, 1).contiguous(), vc.transpose(0, 1).contiguous(), layout.prompt_valid, scaling)
    out_c = o.permute(0, 3, 4, 1, 2, 5).reshape(B * Gmax * Smax, H * Dv)  # (B, Gmax, Smax, Hkv, rep, Dv)

    out = torch.cat([out_p, out_c.to(out_p.dtype)], dim=0).index_select(0, layout.src)
    return out.view(1, T, H, Dv)


def _prompt_attention(q, k, v, layout: PrefixLayout, rep: int, scaling: float, dropout: float):
    """Causal self-attention of every prompt, once per group. q (H, T, D), k/v (Hkv, T, D) -> (the output in
    prompt-slot order (B*Pmax, H*Dv), the prompts' keys and values (B, Hkv, Pmax, D))."""
    H, D = q.shape[0], q.shape[-1]
    Hkv, Dv = k.shape[0], v.shape[-1]
    B, Pmax = layout.n_groups, layout.max_prompt
    qp = q.index_select(1, layout.prompt_idx).view(H, B, Pmax, D).transpose(0, 1)
    kp = k.index_select(1, layout.prompt_idx).view(Hkv, B, Pmax, D).transpose(0, 1)  # (B, Hkv, Pmax, D)
    vp = v.index_select(1, layout.prompt_idx).view(Hkv, B, Pmax, Dv).transpose(0, 1)
    kpr = kp if rep == 1 else kp.repeat_interleave(rep, dim=1)
    vpr = vp if rep == 1 else vp.repeat_interleave(rep, dim=1)
    mask = prompt_mask(layout)  # causal, ragged prompts' padding, bidirectional blocks (Gemma 3's images)
    if mask is None:
        out_p = F.scaled_dot_product_attention(qp, kpr, vpr, dropout_p=dropout, is_causal=True, scale=scaling)
    else:
        out_p = F.scaled_dot_product_attention(qp, kpr, vpr, attn_mask=mask[:, None], dropout_p=dropout,
                                               scale=scaling)
    return out_p.transpose(1, 2).reshape(B * Pmax, H * Dv), kp, vp


def _completion_attention_with_dropout(qc, kp, vp, kc, vc, prompt_valid, scaling, dropout):
    """The joint softmax recorded by autograd (scores kept for backward), for training with attention dropout.
    qc (Hkv, rep, B, G, S, D); kp, vp (B, Hkv, P, D); kc, vc (Hkv, B, G, S, D) -> (B, Hkv, rep, G, S, Dv)."""
    Hkv, rep, B, Gmax, Smax, D = qc.shape
    Pmax, Dv = kp.shape[2], vp.shape[-1]
    kc, vc = kc.permute(1, 2, 0, 3, 4), vc.permute(1, 2, 0, 3, 4)  # (B, G, Hkv, S, D)
    q_vs_p = qc.permute(2, 0, 1, 3, 4, 5).reshape(B, Hkv, rep * Gmax * Smax, D)
    s_p = torch.matmul(q_vs_p, kp.transpose(-1, -2)).float().mul_(scaling).view(B, Hkv, rep, Gmax, Smax, Pmax)
    if prompt_valid is not None:
        s_p = s_p.masked_fill(~prompt_valid[:, None, None, None, None, :], float("-inf"))
    q_vs_c = qc.permute(2, 3, 0, 1, 4, 5).reshape(B, Gmax, Hkv, rep * Smax, D)
    s_c = torch.matmul(q_vs_c, kc.transpose(-1, -2)).float().mul_(scaling).view(B, Gmax, Hkv, rep, Smax, Smax)
    causal_c = torch.ones(Smax, Smax, dtype=torch.bool, device=qc.device).tril()
    s_c = s_c.masked_fill(~causal_c, float("-inf")).permute(0, 2, 3, 1, 4, 5)  # (B, Hkv, rep, G, S, S)
    a_p, a_c = joint_softmax(s_p, s_c, vp.dtype)  # finite: P >= 1
    a_p = F.dropout(a_p, p=dropout, training=True)
    a_c = F.dropout(a_c, p=dropout, training=True)
    o_p = torch.matmul(a_p.view(B, Hkv, rep * Gmax * Smax, Pmax), vp).view(B, Hkv, rep, Gmax, Smax, Dv)
    a_c = a_c.permute(0, 3, 1, 2, 4, 5).reshape(B, Gmax, Hkv, rep * Smax, Smax)
    o_c = torch.matmul(a_c, vc).view(B, Gmax, Hkv, rep, Smax, Dv).permute(0, 2, 3, 1, 4, 5)
    return o_p + o_c
