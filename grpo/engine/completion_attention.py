"""The completion half of the grouped kernel, with flash-style memory: no score matrix is kept for backward.

Every completion token attends to its group's prompt keys and causally to its own completion's keys, in one joint
softmax (grpo/engine/grouped_attention.py). Letting autograd record that stores several fp32 score-sized tensors per
layer (the scores, their masked copy, the exponentials, the weights: ``H x G*S x (P + S)`` each), which for
256-token completions was about 40% of all activation memory of an update. This function keeps only the inputs, the
output and one log-sum-exp per query row, and recomputes the scores in backward, one chunk at a time (whole groups
while they fit in CHUNK_SCORES, else a group's completions a few at a time).

Shapes (B groups in the micro-batch, Hkv key/value heads, ``rep`` query heads per KV head, G completions (padded
to the largest group), S completion slots, P prompt slots, D head dim):
q (B, Hkv, rep, G, S, D); kp, vp (B, Hkv, P, D); kc, vc (B, Hkv, G, S, D); prompt_valid (B, P) bool or None.
Returns o (B, Hkv, rep, G, S, Dv) in v's dtype. Padded prompt slots are masked; padded completion slots produce
outputs that the caller discards (their output gradient is zero, so they contribute no gradient).
"""
from __future__ import annotations

import torch

CHUNK_SCORES = 1 << 24  # score elements of one chunk of groups (forward and backward): 64 MiB in fp32


def _scores(q, kp, kc, valid, scaling):
    """fp32 scores against the prompt (B, Hkv, rep, G, S, P) and against the own completion (..., S, S)."""
    B, Hkv, rep, G, S, D = q.shape
    s_p = torch.matmul(q.reshape(B, Hkv, rep * G * S, D), kp.transpose(-1, -2)).float().mul_(scaling)
    s_p = s_p.view(B, Hkv, rep, G, S, kp.shape[2])
    if valid is not None:
        s_p.masked_fill_(~valid[:, None, None, None, None, :], float("-inf"))
    s_c = torch.matmul(q, kc.unsqueeze(2).transpose(-1, -2)).float().mul_(scaling)
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    s_c.masked_fill_(~causal, float("-inf"))
    return s_p, s_c


def _chunks(q, kp):
    """(group slice, completion slice) pieces of about CHUNK_SCORES scores: whole groups while they fit, a long
    group split by its completions."""
    B, Hkv, rep, G, S, _ = q.shape
    per_completion = max(1, Hkv * rep * S * (kp.shape[2] + S))
    if per_completion * G <= CHUNK_SCORES:
        step = max(1, CHUNK_SCORES // (per_completion * G))
        return [(slice(b, min(b + step, B)), slice(0, G)) for b in range(0, B, step)]
    step = max(1, CHUNK_SCORES // per_completion)
    return [(slice(b, b + 1), slice(g, min(g + step, G))) for b in range(B) for g in range(0, G, step)]


def _sl(valid, sl):
    return None if valid is None else valid[sl]


class _CompletionAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kp, vp, kc, vc, valid, scaling):
        B, Hkv, rep, G, S, _ = q.shape
        o = q.new_empty(B, Hkv, rep, G, S, vp.shape[-1], dtype=vp.dtype)
        lse = torch.empty(B, Hkv, rep, G, S, dtype=torch.float32, device=q.device)
        for b, g in _chunks(q, kp):
            qs = q[b, :, :, g]
            s_p, s_c = _scores(qs, kp[b], kc[b, :, g], _sl(valid, b), scaling)
            m = torch.maximum(s_p.amax(-1), s_c.amax(-1)).unsqueeze_(-1)  # finite: every prompt has a valid slot
            e_p, e_c = s_p.sub_(m).exp_(), s_c.sub_(m).exp_()
            denom = e_p.sum(-1, keepdim=True).add_(e_c.sum(-1, keepdim=True))
            a_p, a_c = e_p.div_(denom).to(vp.dtype), e_c.div_(denom).to(vp.dtype)
            n, ng = qs.shape[0], qs.shape[3]
            o_p = torch.matmul(a_p.view(n, Hkv, rep * ng * S, -1), vp[b]).view(n, Hkv, rep, ng, S, -1)
            o[b, :, :, g] = o_p + torch.matmul(a_c, vc[b, :, g].unsqueeze(2))
            lse[b, :, :, g] = (m + denom.log()).squeeze(-1)
        ctx.save_for_backward(q, kp, vp, kc, vc, valid, o, lse)
        ctx.scaling = scaling
        ctx.mark_non_differentiable(lse)
        return o

    @staticmethod
    def backward(ctx, g_o):
        q, kp, vp, kc, vc, valid, o, lse = ctx.saved_tensors
        scaling = ctx.scaling
        B, Hkv, rep, G, S, D = q.shape
        P = kp.shape[2]
        g_q, g_kc, g_vc = torch.empty_like(q), torch.empty_like(kc), torch.empty_like(vc)
        g_kp, g_vp = torch.zeros_like(kp), torch.zeros_like(vp)  # summed over the completion pieces of a group
        for b, g in _chunks(q, kp):
            qs, do = q[b, :, :, g], g_o[b, :, :, g].to(vp.dtype)
            n, ng = qs.shape[0], qs.shape[3]
            s_p, s_c = _scores(qs, kp[b], kc[b, :, g], _sl(valid, b), scaling)
            ls = lse[b, :, :, g].unsqueeze(-1)
            p_p, p_c = s_p.sub_(ls).exp_(), s_c.sub_(ls).exp_()  # the forward's attention weights
            delta = (do.float() * o[b, :, :, g].float()).sum(-1, keepdim=True)  # rowsum(dO * O)
            do_rows = do.reshape(n, Hkv, rep * ng * S, -1)
            dp_p = torch.matmul(do_rows, vp[b].transpose(-1, -2)).float().view_as(p_p)
            dp_c = torch.matmul(do, vc[b, :, g].unsqueeze(2).transpose(-1, -2)).float()
            g_vp[b] += torch.matmul(p_p.to(vp.dtype).view(n, Hkv, rep * ng * S, P).transpose(-1, -2), do_rows)
            g_vc[b, :, g] = torch.matmul(p_c.to(vc.dtype).transpose(-1, -2), do).sum(2)
            ds_p = dp_p.sub_(delta).mul_(p_p).mul_(scaling).to(q.dtype)  # d softmax, then d (q k^T * scaling)
            ds_c = dp_c.sub_(delta).mul_(p_c).mul_(scaling).to(q.dtype)
            ds_p_rows = ds_p.view(n, Hkv, rep * ng * S, P)
            g_q[b, :, :, g] = (torch.matmul(ds_p_rows, kp[b]).view(n, Hkv, rep, ng, S, D)
                               + torch.matmul(ds_c, kc[b, :, g].unsqueeze(2)))
            g_kp[b] += torch.matmul(ds_p_rows.transpose(-1, -2), qs.reshape(n, Hkv, rep * ng * S, D))
            g_kc[b, :, g] = torch.matmul(ds_c.transpose(-1, -2), qs).sum(2)
        return g_q, g_kp, g_vp, g_kc, g_vc, None, None


def completion_attention(q, kp, vp, kc, vc, valid, scaling: float) -> torch.Tensor:
    """Joint softmax attention of completion queries over [prompt keys; own causal keys]; see the module doc."""
    return _CompletionAttention.apply(q, kp, vp, kc, vc, valid, scaling)
