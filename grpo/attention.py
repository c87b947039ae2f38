"""Shared-prefix attention for the packed GRPO layout (see docs/prefix-engine.md).

One micro-batch is packed into a single row without padding::

    [P_1; R_11; ...; R_1G; P_2; R_21; ...]

with position ids restarting at len(P_b) for every completion. The attention function registered here
(name ``grpo_prefix``) computes, per layer,

* prompt self-attention once per group (causal, scaled_dot_product_attention), and
* completion attention of every R_i over [prompt K/V of its group; its own K/V] as one joint softmax:
  the scores against the prompt are one matmul of all G completions' queries against the *single* prompt
  K/V (no copy per completion), the scores against its own tokens are a causal block per completion.

It is exact: the same softmax over the same keys as the per-sequence forward, only grouped differently.

Two kernels compute it (``attention_kernel``):

* ``grouped`` (above; any device): the prompt K/V is never copied, but the completion-to-prompt scores of a
  layer are materialised (H x G*S x P).
* ``flex`` (grpo/flex_kernel.py: PyTorch FlexAttention on the packed row, compiled on CUDA): a block-sparse
  mask in which a completion token sees its group's prompt and its own earlier tokens; blocks of one
  completion against another are skipped and no score matrix is stored.

This module also switches a model's attention implementation for the duration of a call
(``prefix_attention``), for this layout and for the rollout's shared-prompt decoding (grpo/decode_attention.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpo.completion_attention import completion_attention
from grpo.flex_kernel import flex_fn

ATTN_NAME = "grpo_prefix"
LAYOUT_KWARG = "grpo_prefix_layout"


@dataclass
class PrefixLayout:
    """Index tensors describing one packed micro-batch (all on the model's device)."""

    n_tokens: int  # T, length of the packed row
    n_groups: int  # B
    max_prompt: int  # Pmax
    max_group: int  # Gmax
    max_completion: int  # Smax
    max_seq_len: int  # longest P + S_i (what a sliding window would have to cover)
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


def build_layout(prompts: list[list[int]], completions: list[list[list[int]]], device) -> PrefixLayout:
    """Pack groups (prompt, completions) into one row and build the index tensors."""
    B = len(prompts)
    Pmax = max(len(p) for p in prompts)
    Gmax = max(max(len(c), 1) for c in completions)
    Smax = max([1] + [len(r) for c in completions for r in c])
    ids: list[int] = []
    pos: list[int] = []
    prompt_idx = [0] * (B * Pmax)
    comp_idx = [0] * (B * Gmax * Smax)
    src: list[int] = []
    seg: list[int] = []
    pseg: list[int] = []
    pred: list[int] = []
    targets: list[int] = []
    n_prompt_slots = B * Pmax
    for b, (p, comps) in enumerate(zip(prompts, completions)):
        P = len(p)
        for j in range(P):
            prompt_idx[b * Pmax + j] = len(ids)
            src.append(b * Pmax + j)
            ids.append(p[j])
            pos.append(j)
        seg.extend([b * (Gmax + 1)] * P)
        for i, r in enumerate(comps):
            base = (b * Gmax + i) * Smax
            for k, tok in enumerate(r):
                pred.append(len(ids) - 1 if k else prompt_idx[b * Pmax + P - 1])
                targets.append(tok)
                comp_idx[base + k] = len(ids)
                src.append(n_prompt_slots + base + k)
                ids.append(tok)
                pos.append(P + k)
            seg.extend([b * (Gmax + 1) + i + 1] * len(r))
        pseg.extend([b * (Gmax + 1)] * (P + sum(len(r) for r in comps)))
    lens = [len(p) for p in prompts]
    prompt_valid = None
    if min(lens) != Pmax:
        prompt_valid = torch.arange(Pmax)[None, :] < torch.tensor(lens)[:, None]
        prompt_valid = prompt_valid.to(device)
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return PrefixLayout(
        n_tokens=len(ids),
        n_groups=B,
        max_prompt=Pmax,
        max_group=Gmax,
        max_completion=Smax,
        max_seq_len=max(len(p) + max([0] + [len(r) for r in c]) for p, c in zip(prompts, completions)),
        prompt_idx=t(prompt_idx),
        prompt_valid=prompt_valid,
        comp_idx=t(comp_idx),
        src=t(src),
        position_ids=t(pos)[None, :],
        input_ids=t(ids)[None, :],
        pred_idx=t(pred),
        targets=t(targets),
        segment=t(seg),
        prompt_segment=t(pseg),
    )


def joint_softmax(s_a: torch.Tensor, s_b: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over the last dims of two score blocks taken together (shared max and denominator, in the
    scores' precision); returns both blocks' attention weights in ``dtype``. At least one score per row must be
    finite."""
    m = torch.maximum(s_a.amax(-1), s_b.amax(-1)).detach().unsqueeze(-1)
    e_a, e_b = torch.exp(s_a - m), torch.exp(s_b - m)
    denom = (e_a.sum(-1) + e_b.sum(-1)).unsqueeze(-1)
    return (e_a / denom).to(dtype), (e_b / denom).to(dtype)


def prefix_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function with the signature of transformers' AttentionInterface.

    query: (1, H, T, D); key/value: (1, Hkv, T, D), rotary already applied. Returns ((1, T, H, D), None).
    """
    layout: PrefixLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} was called without a packed layout; it is only meant to be "
            "active inside grpo.prefix_engine.token_logprobs"
        )
    if kwargs.get("softcap") is not None:
        raise RuntimeError("shared-prefix attention does not implement attention logit soft-capping")
    window = kwargs.get("sliding_window")
    if window is not None and window < layout.max_seq_len:
        raise RuntimeError("shared-prefix attention does not implement an active sliding window")
    layout.calls += 1
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if not module.training:
        dropout = 0.0
    if layout.block_mask is not None:
        if dropout > 0.0:
            raise RuntimeError("the flex kernel has no attention dropout; use attention_kernel='grouped'")
        pad = (0, 0, 0, layout.block_mask.seq_lengths[0] - query.shape[2])
        out = flex_fn(query.device)(F.pad(query, pad), F.pad(key, pad), F.pad(value, pad),
                                     block_mask=layout.block_mask, scale=scaling,
                                     enable_gqa=query.shape[1] != key.shape[1])
        return out[:, :, : query.shape[2]].transpose(1, 2), None

    _, H, T, D = query.shape
    Hkv, Dv = key.shape[1], value.shape[-1]
    rep = H // Hkv
    B, Pmax, Gmax, Smax = layout.n_groups, layout.max_prompt, layout.max_group, layout.max_completion
    q, k, v = query[0], key[0], value[0]  # (H, T, D)

    # ---- prompt self-attention, once per group ----
    qp = q.index_select(1, layout.prompt_idx).view(H, B, Pmax, D).transpose(0, 1)
    kp = k.index_select(1, layout.prompt_idx).view(Hkv, B, Pmax, D).transpose(0, 1)  # (B, Hkv, Pmax, D)
    vp = v.index_select(1, layout.prompt_idx).view(Hkv, B, Pmax, Dv).transpose(0, 1)
    kpr = kp if rep == 1 else kp.repeat_interleave(rep, dim=1)
    vpr = vp if rep == 1 else vp.repeat_interleave(rep, dim=1)
    if layout.prompt_valid is None:
        out_p = F.scaled_dot_product_attention(qp, kpr, vpr, dropout_p=dropout, is_causal=True, scale=scaling)
    else:
        causal = torch.ones(Pmax, Pmax, dtype=torch.bool, device=q.device).tril()
        mask = (causal[None] & layout.prompt_valid[:, None, :])[:, None]  # (B, 1, Pmax, Pmax)
        out_p = F.scaled_dot_product_attention(qp, kpr, vpr, attn_mask=mask, dropout_p=dropout, scale=scaling)
    out_p = out_p.transpose(1, 2).reshape(B * Pmax, H * Dv)

    # ---- completion attention over [prompt K/V of the group; own K/V], one joint softmax ----
    qc = q.index_select(1, layout.comp_idx).view(Hkv, rep, B, Gmax, Smax, D)
    kc = k.index_select(1, layout.comp_idx).view(Hkv, B, Gmax, Smax, D)
    vc = v.index_select(1, layout.comp_idx).view(Hkv, B, Gmax, Smax, Dv)
    if dropout > 0.0:
        o = _completion_attention_with_dropout(qc, kp, vp, kc, vc, layout.prompt_valid, scaling, dropout)
    else:  # no score matrix kept for backward (grpo/completion_attention.py)
        o = completion_attention(qc.permute(2, 0, 1, 3, 4, 5).contiguous(), kp.contiguous(), vp.contiguous(),
                                 kc.transpose(0, 1).contiguous(), vc.transpose(0, 1).contiguous(),
                                 layout.prompt_valid, scaling)
    out_c = o.permute(0, 3, 4, 1, 2, 5).reshape(B * Gmax * Smax, H * Dv)  # (B, Gmax, Smax, Hkv, rep, Dv)

    out = torch.cat([out_p, out_c.to(out_p.dtype)], dim=0).index_select(0, layout.src)
    return out.view(1, T, H, Dv), None


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


_registered = False


def register() -> None:
    """Register ``grpo_prefix`` in transformers' AttentionInterface (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        from grpo.decode_attention import DECODE_ATTN_NAME, shared_decode_attention_forward

        AttentionInterface.register(ATTN_NAME, prefix_attention_forward)
        AttentionInterface.register(DECODE_ATTN_NAME, shared_decode_attention_forward)
        _registered = True


def _configs(model) -> list:
    seen: dict[int, object] = {}
    stack = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    while stack:
        cfg = stack.pop()
        if id(cfg) in seen:
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            sub = getattr(cfg, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                stack.append(sub)
    return list(seen.values())


def _set_impl(configs, values) -> None:
    for cfg, val in zip(configs, values):
        if "_attn_implementation_internal" in vars(cfg):
            cfg._attn_implementation_internal = val  # no recursion into sub-configs
        else:
            cfg._attn_implementation = val


def _with_impl(fn, configs, name):
    """Run ``fn`` with attention ``name`` active: used for the recompute of gradient checkpointing, which happens
    in backward, after ``prefix_attention`` has restored the configs."""

    def run(*args, **kwargs):
        saved = [c._attn_implementation for c in configs]
        _set_impl(configs, [name] * len(configs))
        try:
            return fn(*args, **kwargs)
        finally:
            _set_impl(configs, saved)

    return run


def checkpointing_is_wrappable(model) -> bool:
    """True unless some module checkpoints in a way we cannot see (then the recompute would not use us)."""
    for m in model.modules():
        hidden = not callable(getattr(m, "_gradient_checkpointing_func", None))
        if getattr(m, "gradient_checkpointing", False) and hidden:
            return False
    return True


@contextlib.contextmanager
def prefix_attention(model, name: str = ATTN_NAME):
    """Switch every config of ``model`` to attention ``name`` (``grpo_prefix``, or ``grpo_prefix_decode`` for the
    rollout) for the duration, and make gradient-checkpointing recomputes switch too. Everything is restored on
    exit, also on exception."""
    register()
    configs = _configs(model)
    saved = [c._attn_implementation for c in configs]
    wrapped = []
    try:
        for m in model.modules():
            func = getattr(m, "_gradient_checkpointing_func", None)
            if getattr(m, "gradient_checkpointing", False) and callable(func):
                had_own = "_gradient_checkpointing_func" in vars(m)
                wrapped.append((m, func, had_own))
                m._gradient_checkpointing_func = (
                    lambda fn, *a, _f=func, **kw: _f(_with_impl(fn, configs, name), *a, **kw)
                )
        _set_impl(configs, [name] * len(configs))
        yield
    finally:
        _set_impl(configs, saved)
        for m, func, had_own in wrapped:
            if had_own:
                m._gradient_checkpointing_func = func
            else:
                del m._gradient_checkpointing_func
