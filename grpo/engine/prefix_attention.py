"""The attention function ``grpo_prefix`` that every layer calls during a shared-prefix forward.

It has the signature of transformers' AttentionInterface (grpo/engine/patch.py registers it and switches a
model to it). It takes the packed layout (grpo/engine/layout.py) from its keyword argument, refuses what the
shared layout does not implement (attention logit soft-capping, an active sliding window), counts the call so
that the caller can check that every layer came through here, and runs one of the two kernels:

* ``grouped`` (grpo/engine/grouped_attention.py; any device): the prompt K/V is never copied, the
  completion-to-prompt scores of a layer are computed chunk by chunk;
* ``flex`` (grpo/engine/flex_kernel.py: PyTorch FlexAttention on the packed row, compiled on CUDA), selected by
  a block mask on the layout: blocks of one completion against another are skipped, no score matrix is stored.
"""

from __future__ import annotations

from grpo.engine.flex_kernel import flex_attention_forward
from grpo.engine.grouped_attention import grouped_attention
from grpo.engine.layout import PrefixLayout

ATTN_NAME = "grpo_prefix"
LAYOUT_KWARG = "grpo_prefix_layout"


def prefix_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function with the signature of transformers' AttentionInterface.

    query: (1, H, T, D); key/value: (1, Hkv, T, D), rotary already applied. Returns ((1, T, H, D), None).
    """
    layout: PrefixLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} was called without a packed layout; it is only meant to be "
            "active inside grpo.token_logprobs"
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
        return flex_attention_forward(query, key, value, layout, scaling), None
    return grouped_attention(query, key, value, layout, scaling, dropout), None
