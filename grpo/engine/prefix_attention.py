"""The attention function ``grpo_prefix`` that every layer calls during a shared-prefix forward.

It has the signature of transformers' AttentionInterface (grpo/engine/patch.py registers it and switches a
model to it). It takes the packed layout (grpo/engine/layout.py) from its keyword argument, counts the call so
that the caller can check that every layer came through here, and runs one of the kernels:

* ``score`` (grpo/engine/score_attention.py), for a layer with an active sliding window, attention logit
  soft-capping or attention sinks (whatever kernel was asked for): the scores written out, each extra applied;

* ``grouped`` (grpo/engine/grouped_attention.py; any device): the prompt K/V is never copied, the
  completion-to-prompt scores of a layer are computed chunk by chunk;
* ``flex`` (grpo/engine/flex_kernel.py: PyTorch FlexAttention on the packed row, compiled on CUDA), selected by
  a block mask on the layout: blocks of one completion against another are skipped, no score matrix is stored.
"""

from __future__ import annotations

from grpo.engine.flex_kernel import flex_attention_forward
from grpo.engine.grouped_attention import grouped_attention
from grpo.engine.layout import ACTIVE, PrefixLayout
from grpo.engine.score_attention import ScoreExtras, score_attention

ATTN_NAME = "grpo_prefix"
LAYOUT_KWARG = "grpo_prefix_layout"


def prefix_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function with the signature of transformers' AttentionInterface.

    query: (1, H, T, D); key/value: (1, Hkv, T, D), rotary already applied. Returns ((1, T, H, D), None).
    """
    layout: PrefixLayout | None = kwargs.get(LAYOUT_KWARG) or ACTIVE.get()
    if not isinstance(layout, PrefixLayout):
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} was called without a packed layout; it is only meant to be "
            "active inside grpo.token_logprobs"
        )
    layout.calls += 1
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if not module.training:
        dropout = 0.0
    extras = layer_extras(module, kwargs, layout.max_seq_len)
    if extras.any():  # scores beyond q k^T: written out, whichever kernel was asked for
        return score_attention(query[0], key[0], value[0], layout, scaling, dropout, extras), None
    if layout.block_mask is not None:
        if dropout > 0.0:
            raise RuntimeError("the flex kernel has no attention dropout; use attention_kernel='grouped'")
        return flex_attention_forward(query, key, value, layout, scaling), None
    return grouped_attention(query, key, value, layout, scaling, dropout), None


def layer_extras(module, kwargs, max_seq_len: int | None = None) -> ScoreExtras:
    """What this layer's attention adds to ``q k^T * scaling``, as the model's own eager attention applies it: the
    sliding window the layer passes (or, for families that window through the mask alone, its ``sliding_window``
    attribute), when shorter than the longest sequence; the soft-cap; the sink logits (``s_aux``)."""
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if not window or (max_seq_len is not None and window >= max_seq_len):  # sees <= max_seq_len - 1 back: inactive
        window = None
    return ScoreExtras(window=window, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
