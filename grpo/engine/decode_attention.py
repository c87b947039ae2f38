"""The attention function ``grpo_prefix_decode``: G sampled rows decode against one shared copy of their prompt's K/V.

Registered and switched on (grpo/engine/patch.py) around the rollout's decode loop (grpo/rollout/hf.py): cascade
attention. Each row attends to its prompt's K/V, held once per prompt, and to its own tokens (the
last prompt token and what it generated), held in the ordinary per-row cache, with one joint softmax: the same
keys and the same softmax as decoding from G copies of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.engine.grouped_attention import joint_softmax

DECODE_ATTN_NAME = "grpo_prefix_decode"
DECODE_KWARG = "grpo_shared_prefix"


@dataclass
class SharedPrefixKV:
    """The rollout's prompt K/V, stored once per prompt while its G samples decode (cascade attention).

    keys/values: per layer (B, Hkv, W, D), the prefilled prompt tokens but the last, left-padded to W;
    valid: (B, W) bool, False at padding. Each decoding row r belongs to prompt r // group."""

    keys: list
    values: list
    valid: torch.Tensor
    group: int
    calls: int = 0


def prefix_decode_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One decoding step of B*G rows: each row attends to its prompt's shared K/V and to its own tokens (the
    last prompt token and what it generated so far, held in the ordinary cache), one joint softmax.

    query: (B*G, H, 1, D); key/value: (B*G, Hkv, t, D), the row's own tokens. Returns ((B*G, 1, H, Dv), None)."""
    prefix: SharedPrefixKV | None = kwargs.get(DECODE_KWARG)
    if prefix is None:
        raise RuntimeError(f"attention implementation {DECODE_ATTN_NAME!r} was called without the shared-prefix K/V")
    if query.shape[2] != 1:
        raise RuntimeError(f"{DECODE_ATTN_NAME!r} decodes one token per row, got {query.shape[2]}")
    prefix.calls += 1
    layer = module.layer_idx
    kp, vp = prefix.keys[layer], prefix.values[layer]  # (B, Hkv, W, D)
    R, H, _, D = query.shape
    B, Hkv, W, Dv = kp.shape[0], kp.shape[1], kp.shape[2], vp.shape[-1]
    G, rep = prefix.group, H // Hkv
    if scaling is None:
        scaling = D ** -0.5
    q = query.view(B, G, Hkv, rep, D)
    # scores against the prompt: all G rows of a prompt in one matmul against its single K
    s_p = torch.matmul(q.permute(0, 2, 1, 3, 4).reshape(B, Hkv, G * rep, D), kp.transpose(-1, -2)).float() * scaling
    s_p = s_p.masked_fill(~prefix.valid[:, None, None, :], float("-inf")).view(B, Hkv, G, rep, W)
    s_p = s_p.permute(0, 2, 1, 3, 4).reshape(R, Hkv, rep, W)
    # scores against its own tokens
    s_o = torch.matmul(query.view(R, Hkv, rep, D), key.transpose(-1, -2)).float() * scaling  # (R, Hkv, rep, t)
    a_p, a_o = joint_softmax(s_p, s_o, value.dtype)  # finite: every row has its own last prompt token
    a_p = a_p.view(B, G, Hkv, rep, W).permute(0, 2, 1, 3, 4).reshape(B, Hkv, G * rep, W)
    o_p = torch.matmul(a_p, vp).view(B, Hkv, G, rep, Dv).permute(0, 2, 1, 3, 4).reshape(R, Hkv, rep, Dv)
    o_o = torch.matmul(a_o, value)  # (R, Hkv, rep, Dv)
    return (o_p + o_o).reshape(R, 1, H, Dv), None
