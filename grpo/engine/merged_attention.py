"""The completion half of the grouped kernel on CPU: two fused flash-attention calls merged by their log-sum-exps.

Every completion token attends to its group's prompt keys and causally to its own completion's keys, in one joint
softmax. A softmax over the union of two key sets is the two partial softmaxes merged by their log-sum-exps::

    lse = logaddexp(lse_p, lse_c),   o = exp(lse_p - lse) * o_p + exp(lse_c - lse) * o_c

so the joint attention is two calls of PyTorch's fused CPU flash-attention kernel (which return their log-sum-exp):
all G completions' queries against the single prompt K/V in one call (G and the query heads of a KV head folded
into the query rows; no mask but the padding of ragged prompts), and every completion causally against its own
K/V. Neither call materialises a score matrix: the kernel works in cache-sized blocks with an online softmax.

Backward is exact with the same two kernels: flash-attention's backward needs only the output and the
log-sum-exp of the softmax its block belongs to. Given the *joint* output and log-sum-exp, each call's backward
recomputes the joint attention weights of its key block (``exp(s - lse)``) and the shared ``rowsum(dO * O)``,
so it returns that block's exact share of the joint gradient; the query gradients of the two blocks add up.

Shapes as in grpo/engine/completion_attention.py (the generic, any-device version this one replaces on CPU):
q (B, Hkv, rep, G, S, D); kp, vp (B, Hkv, P, D); kc, vc (B, Hkv, G, S, D); prompt_valid (B, P) bool or None.
Returns o (B, Hkv, rep, G, S, D).
"""
from __future__ import annotations

import torch


def _flash(*args, **kwargs):
    """PyTorch's fused CPU flash attention: (output, log-sum-exp)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(*args, **kwargs)


def _flash_backward(*args, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(*args, **kwargs)


def merged_attention_available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this path serves these inputs: PyTorch's CPU flash kernel, equal query and value head dims."""
    if q.device.type != "cpu" or q.shape[-1] != v.shape[-1] or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default  # noqa: B018
    except (AttributeError, RuntimeError):  # a PyTorch without it
        return False
    return True


def _prompt_mask(valid, dtype):
    """Additive mask (B, 1, 1, P) hiding the padded slots of ragged prompts, or None."""
    if valid is None:
        return None
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, float("-inf"))[:, None, None]


def _own_rows(x, rep):
    """(B, Hkv, [rep,] G, S, D) -> (B*G, Hkv*rep, S, D): one attention batch per completion, heads expanded."""
    if x.dim() == 5:  # keys/values: repeat per query head of the KV head (S x D per completion: small)
        x = x.unsqueeze(2).expand(-1, -1, rep, -1, -1, -1)
    B, Hkv, _, G, S, D = x.shape
    return x.permute(0, 3, 1, 2, 4, 5).reshape(B * G, Hkv * rep, S, D)


def _from_own(x, B, Hkv, rep, G):
    """Inverse of _own_rows for queries: (B*G, Hkv*rep, S, ...) -> (B, Hkv, rep, G, S, ...)."""
    x = x.reshape(B, G, Hkv, rep, *x.shape[2:])
    return x.permute(0, 2, 3, 1, *range(4, x.dim()))


class _MergedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kp, vp, kc, vc, valid, scaling):
        B, Hkv, rep, G, S, D = q.shape
        mask = _prompt_mask(valid, q.dtype)
        q_rows = q.reshape(B, Hkv, rep * G * S, D)
        o_p, lse_p = _flash(q_rows, kp, vp, 0.0, False, attn_mask=mask, scale=scaling)
        q_own = _own_rows(q, rep)
        o_c, lse_c = _flash(q_own, _own_rows(kc, rep), _own_rows(vc, rep), 0.0, True, scale=scaling)
        lse_p = lse_p.view(B, Hkv, rep, G, S)
        lse_c = _from_own(lse_c, B, Hkv, rep, G)
        lse = torch.logaddexp(lse_p, lse_c)
        o = o_p.view(B, Hkv, rep, G, S, D) * (lse_p - lse).exp_().unsqueeze(-1).to(q.dtype)
        o.add_(_from_own(o_c, B, Hkv, rep, G) * (lse_c - lse).exp_().unsqueeze(-1).to(q.dtype))
        ctx.save_for_backward(q, kp, vp, kc, vc, valid, o, lse)
        ctx.scaling = scaling
        return o

    @staticmethod
    def backward(ctx, g_o):
        q, kp, vp, kc, vc, valid, o, lse = ctx.saved_tensors
        B, Hkv, rep, G, S, D = q.shape
        scaling = ctx.scaling
        g_o = g_o.to(q.dtype).contiguous()
        rows = (B, Hkv, rep * G * S, D)
        # the kernels read the log-sum-exp in the layout their forward returns it: (batch, query, head) in memory
        lse_rows = lse.reshape(B, Hkv, rep * G * S).transpose(1, 2).contiguous().transpose(1, 2)
        g_q, g_kp, g_vp = _flash_backward(g_o.reshape(rows), q.reshape(rows), kp, vp, o.reshape(rows), lse_rows,
                                          0.0, False, attn_mask=_prompt_mask(valid, q.dtype), scale=scaling)
        lse_own = _own_rows(lse.unsqueeze(-1), rep)[..., 0].transpose(1, 2).contiguous().transpose(1, 2)
        g_qo, g_kc, g_vc = _flash_backward(_own_rows(g_o, rep), _own_rows(q, rep), _own_rows(kc, rep),
                                           _own_rows(vc, rep), _own_rows(o, rep), lse_own, 0.0, True, scale=scaling)
        g_q = g_q.view(B, Hkv, rep, G, S, D) + _from_own(g_qo, B, Hkv, rep, G)
        g_kc = _from_own(g_kc, B, Hkv, rep, G).sum(2)  # summed over the query heads sharing the KV head
        g_vc = _from_own(g_vc, B, Hkv, rep, G).sum(2)
        return g_q, g_kp, g_vp, g_kc, g_vc, None, None


def merged_attention(q, kp, vp, kc, vc, valid, scaling: float) -> torch.Tensor:
    """Joint softmax attention of completion queries over [prompt keys; own causal keys]; see the module doc.
    Call only where :func:`merged_attention_available` is true."""
    return _MergedAttention.apply(q, kp, vp, kc, vc, valid, scaling)
