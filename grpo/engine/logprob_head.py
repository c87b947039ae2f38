"""log p(target) and entropy from decoder hidden states and the output head, without storing vocabulary logits.

Used by grpo/engine/logprobs.py at the positions that predict completion tokens only. A plain ``nn.Linear`` head
goes through a fused autograd function that works in row chunks and recomputes each chunk's logits in
backward; other heads (LoRA on lm_head, DeepSpeed ZeRO-3 partitioned weights) use ordinary autograd.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

__all__ = ["head_logprobs", "head_transform", "HeadTransform", "TRANSFORMS"]

_CHUNK_ELEMENTS = 1 << 24  # logits materialised at once (rows x vocab), forward and backward


@dataclasses.dataclass(frozen=True)
class HeadTransform:
    """What a model does to the output head's result before it is logits: ``logits = cap * tanh(mult * u / cap)``
    (no tanh when ``cap`` is None) over the first ``vocab`` entries of ``u = head(hidden)`` (all when None)."""

    mult: float = 1.0
    cap: float | None = None
    vocab: int | None = None


def _times(c, key):
    return HeadTransform(mult=float(getattr(c, key)))


def _divided(c, key):
    return HeadTransform(mult=1.0 / getattr(c, key))


def _capped(c, key):
    return HeadTransform(cap=getattr(c, key) or None)


# model_type (of the text config) -> its transform, as each *ForCausalLM.forward of transformers 5.24 computes its
# logits after the decoder (a head multiplying the hidden state instead, e.g. MiniCPM3's, is the same product). A
# model_type not listed has none; grpo/engine/head_check.py refuses a model whose own logits disagree.
TRANSFORMS = {
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoeshared", "granitemoehybrid",
                     "minicpm3"), partial(_divided, key="logits_scaling")),
    "hyperclovax": partial(_times, key="logits_scaling"),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), partial(_times, key="logit_scale")),
    "cohere_compass_text": lambda c: HeadTransform(mult=1.0 if c.logit_scale is None else float(c.logit_scale)),
    "falcon_h1": partial(_times, key="lm_head_multiplier"),  # real checkpoints: 0.039 or 0.078
    "inkling_text": lambda c: HeadTransform(mult=1.0 / c.logits_mup_width_multiplier, vocab=c.unpadded_vocab_size),
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "vaultgemma",
                     "nanochat", "beam", "inkling2_text", "inkling2_loop_text"),
                    partial(_capped, key="final_logit_softcapping")),
    "recurrent_gemma": partial(_capped, key="logits_soft_cap"),
    "xlstm": partial(_capped, key="output_logit_soft_cap"),
}


def head_transform(cfg) -> HeadTransform:
    """The transform of a model with config ``cfg`` (a composite model's: its text config's)."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    make = TRANSFORMS.get(getattr(text, "model_type", None))  # pragma: no mutate
    return make(text) if make is not None else HeadTransform()


class _FusedLogProb(torch.autograd.Function):
    """log p(target) (and entropy) from hidden states and a linear head, in row chunks; the (M, vocab) logits
    are never stored: backward recomputes them chunk by chunk (one extra matmul, far fewer full-vocab passes,
    and no vocab-sized activation memory)."""

    @staticmethod
    def _logits(h, weight, bias, mult, cap, temperature):
        u = torch.nn.functional.linear(h, weight, bias).float()
        if mult != 1.0:
            u = u * mult
        t = torch.tanh(u / cap) if cap else None
        z = t * cap if cap else u
        return (z / temperature if temperature != 1.0 else z), t  # pragma: no mutate

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, mult, cap, temperature, want_entropy):
        M = hidden.shape[0]
        # rows of logits at once: never more rows than there are
        rows = max(1, min(M, _CHUNK_ELEMENTS // weight.shape[0]))  # pragma: no mutate
        logp = torch.empty(M, dtype=torch.float32, device=hidden.device)  # pragma: no mutate
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if want_entropy else logp.new_empty(0)  # pragma: no mutate
        for s in range(0, M, rows):  # pragma: no mutate
            z, _ = _FusedLogProb._logits(hidden[s : s + rows], weight, bias, mult, cap, temperature)
            lse[s : s + rows] = torch.logsumexp(z, dim=-1)  # pragma: no mutate
            logp[s : s + rows] = z.gather(1, targets[s : s + rows, None])[:, 0] - lse[s : s + rows]
            if want_entropy:
                z.sub_(lse[s : s + rows, None])  # log p
                ent[s : s + rows] = -(z.exp() * z).sum(-1)  # pragma: no mutate
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.args = (mult, cap, temperature, rows)
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        # An output that no loss used arrives in backward as None instead of a zero tensor: the usual case is an
        # entropy that is only logged (detached), and its zero gradient would cost full-vocabulary passes.
        ctx.set_materialize_grads(False)  # pragma: no mutate
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        mult, cap, temperature, rows = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_h = torch.empty_like(hidden) if need_h else None  # pragma: no mutate
        g_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # pragma: no mutate
        g_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None  # pragma: no mutate
        use_ent = g_ent is not None and ent.numel() > 0  # pragma: no mutate
        use_lp = g_lp is not None
        if not (use_ent or use_lp):
            return None, None, None, None, None, None, None, None
        for s in range(0, hidden.shape[0], rows):
            sl = slice(s, s + rows)
            z, t = _FusedLogProb._logits(hidden[sl], weight, bias, mult, cap, temperature)
            z.sub_(lse[sl, None])  # log p
            p = z.exp()
            if use_ent:  # dH/dz = -p (log p + H)
                g = (z.add_(ent[sl, None])).mul_(p).mul_(-g_ent[sl, None])
                if use_lp:
                    g.sub_(p.mul_(g_lp[sl, None]))
            else:
                g = p.mul_(-g_lp[sl, None])
            if use_lp:
                at = torch.arange(g.shape[0], device=g.device)  # pragma: no mutate
                g[at, targets[sl]] += g_lp[sl]
            scale = mult / temperature
            if cap:
                g.mul_(1 - t * t)
            if scale != 1.0:
                g.mul_(scale)
            g = g.to(weight.dtype)
            if need_h:
                g_h[sl] = g @ weight
            if need_w:
                g_w.addmm_(g.t().float(), hidden[sl].float())
            if need_b:
                g_b += g.float().sum(0)
        g_w = g_w.to(weight.dtype) if need_w else None  # pragma: no mutate
        g_b = g_b.to(bias.dtype) if need_b else None  # pragma: no mutate
        return g_h, g_w, g_b, None, None, None, None, None


def head_logprobs(hidden, head, cfg, targets, temperature, want_entropy):
    """hidden (M, h) at predicting positions -> (log p(target), entropy or None), both (M,) float32, from the logits
    the model itself computes (``head`` and the config's :func:`head_transform`)."""
    tf = head_transform(cfg)
    mult, cap = tf.mult, tf.cap
    weight = getattr(head, "weight", None)  # pragma: no mutate
    if type(head) is torch.nn.Linear and not hasattr(weight, "ds_id"):  # plain head (not LoRA, not ZeRO-3)
        bias = head.bias
        if tf.vocab is not None:  # the rows past the model's vocabulary are padding it drops
            weight, bias = weight[: tf.vocab], None if bias is None else bias[: tf.vocab]
        logp, ent = _FusedLogProb.apply(hidden, weight, bias, targets, mult, cap, temperature, want_entropy)
        return logp, (ent if want_entropy else None)
    logits = head(hidden).float()
    if tf.vocab is not None:
        logits = logits[..., : tf.vocab]
    if mult != 1.0:
        logits = logits * mult
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # pragma: no mutate
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz  # pragma: no mutate
    entropy = None
    if want_entropy:
        entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # pragma: no mutate
    return logp, entropy
