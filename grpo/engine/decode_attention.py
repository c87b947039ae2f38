"""The attention function ``grpo_prefix_decode``: G sampled rows decode against one shared copy of their prompt's K/V.

Registered and switched on (grpo/engine/patch.py) around the rollout's decode loop (grpo/rollout/hf.py): cascade
attention. Each row attends to its prompt's K/V, held once per prompt, and to its own tokens (the
last prompt token and what it generated), held in the ordinary per-row cache, with one joint softmax: the same
keys and the same softmax as decoding from G copies of the prompt, with the layer's sliding window, attention
logit soft-cap and sinks applied as its eager attention applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo.engine.grouped_attention import joint_softmax
from grpo.engine.layout import ACTIVE
from grpo.engine.prefix_attention import layer_extras

DECODE_ATTN_NAME = "grpo_prefix_decode"
DECODE_KWARG = "grpo_shared_prefix"


@dataclass
class SharedPrefixKV:
    """The rollout's prompt K/V, stored once per prompt while its G samples decode (cascade attention).

    keys/values: per layer (B, Hkv, W, D), the prefilled prompt tokens but the last, left-padded to W (a
    sliding-window layer's cache may keep only the last of those slots); valid: (B, W) bool, False at padding.
    Each decoding row r belongs to prompt r // group."""

    keys: list
    values: list
    valid: torch.Tensor
    group: int
    calls: int = 0
    expanded: dict = field(default_factory=dict)  # MLA: per layer, the prompt's keys and values expanded once


def prefix_decode_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One decoding step of B*G rows: each row attends to its prompt's shared K/V and to its own tokens (the
    last prompt token and what it generated so far, held in the ordinary cache), one joint softmax.

    query: (B*G, H, 1, D); key/value: (B*G, Hkv, t, D), the row's own tokens. Returns ((B*G, 1, H, Dv), None)."""
    prefix: SharedPrefixKV | None = kwargs.get(DECODE_KWARG) or ACTIVE.get()
    if not isinstance(prefix, SharedPrefixKV):
        raise RuntimeError(f"attention implementation {DECODE_ATTN_NAME!r} was called without the shared-prefix K/V")
    if query.shape[2] != 1:
        raise RuntimeError(f"{DECODE_ATTN_NAME!r} decodes one token per row, got {query.shape[2]}")
    prefix.calls += 1
    layer = module.layer_idx
    kp, vp = prefix.keys[layer], prefix.values[layer]  # (B, Hkv, W, D); W: the prompt slots this layer's cache kept
    if hasattr(module, "expand_kv"):  # MLA (DeepSeek-V3) caches compressed latents: expand the prompt's once
        if layer not in prefix.expanded:
            prefix.expanded[layer] = module.expand_kv(kp, vp)
        kp, vp = prefix.expanded[layer]
    R, H, _, D = query.shape
    B, Hkv, W, Dv = kp.shape[0], kp.shape[1], kp.shape[2], vp.shape[-1]
    G, rep = prefix.group, H // Hkv
    if scaling is None:
        scaling = D ** -0.5
    extras = layer_extras(module, kwargs)
    q = query.view(B, G, Hkv, rep, D)
    # scores against the prompt: all G rows of a prompt in one matmul against its single K
    s_p = torch.matmul(q.permute(0, 2, 1, 3, 4).reshape(B, Hkv, G * rep, D), kp.transpose(-1, -2)).float() * scaling
    s_p = s_p.view(B, Hkv, G, rep, W).permute(0, 2, 1, 3, 4).reshape(R, Hkv, rep, W)
    # scores against its own tokens
    s_o = torch.matmul(query.view(R, Hkv, rep, D), key.transpose(-1, -2)).float() * scaling  # (R, Hkv, rep, t)
    if extras.softcap is not None:
        s_p, s_o = (torch.tanh(s / extras.softcap) * extras.softcap for s in (s_p, s_o))
    seen_p, seen_o = _visible(prefix, W, key.shape[2], extras.window)
    s_p = s_p.masked_fill(~seen_p.repeat_interleave(G, 0)[:, None, None, :], float("-inf"))
    if seen_o is not None:
        s_o = s_o.masked_fill(~seen_o, float("-inf"))
    if extras.sinks is not None:  # one more logit per head in the denominator, its weight dropped
        s_o = torch.cat([s_o, extras.sinks.float().view(1, Hkv, rep, 1).expand(R, -1, -1, 1)], dim=-1)
    a_p, a_o = joint_softmax(s_p, s_o, value.dtype)  # finite: every row has its own last prompt token
    if extras.sinks is not None:
        a_o = a_o[..., :-1]
    a_p = a_p.view(B, G, Hkv, rep, W).permute(0, 2, 1, 3, 4).reshape(B, Hkv, G * rep, W)
    o_p = torch.matmul(a_p, vp).view(B, Hkv, G, rep, Dv).permute(0, 2, 1, 3, 4).reshape(R, Hkv, rep, Dv)
    o_o = torch.matmul(a_o, value)  # (R, Hkv, rep, Dv)
    return (o_p + o_o).reshape(R, 1, H, Dv), None


def _visible(prefix: SharedPrefixKV, slots: int, own: int, window: int | None):
    """Which of the layer's ``slots`` prompt slots (B, slots) and ``own`` tokens (own,) or None (all) the query
    sees. A sliding-window layer's cache keeps only the last window - 1 tokens (then ``own`` = window and no prompt
    token is in reach); below that ``own`` tokens since the last prompt token put the query at position
    ``len(prompt) - 1 + own - 1``, and it sees the positions less than ``window`` back."""
    valid = prefix.valid[:, -slots:]
    if window is None:
        return valid, None
    query_pos = prefix.valid.sum(-1, keepdim=True) + own - 1  # (B, 1)
    slot_pos = (prefix.valid.cumsum(-1) - 1)[:, -slots:]
    back = torch.arange(own - 1, -1, -1, device=valid.device)
    return valid & (query_pos - slot_pos < window), back < window
