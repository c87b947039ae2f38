"""Tiny random models of the hybrid families (recurrent layers mixed with attention) the shared-prefix engine serves
(docs/prefix-engine.md, "Recurrent layers"), and Jamba, which it refuses.

The configs come from grpo/tiny_models.py's ``HYBRID_FAMILIES`` (what ``tiny:<family>`` builds): hidden 32, 3 or 4
layers with both kinds of token mixer (Mamba2 alone: 2 recurrent layers), a convolution kernel of ``KERNEL`` and,
where the family lets one set it, a scan chunk of ``CHUNK`` tokens (Gated DeltaNet's torch reference chunks by 64:
the tests' longest prompt is longer).
"""

from __future__ import annotations

import torch
import transformers

from grpo.tiny_models import CHUNK, HYBRID_FAMILIES, KERNEL
from grpo.tiny_models import tiny_config as _tiny_config
from tests.prefix_families import random_model

VOCAB = 97
__all__ = ["CHUNK", "FAMILIES", "KERNEL", "VOCAB", "tiny_config", "tiny_model"]
FAMILIES = (*HYBRID_FAMILIES, "jamba")  # Jamba: refused (its Mamba scan takes no initial state), decoded by the fork
_JAMBA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=3,
              expert_layer_offset=2, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=KERNEL,
              mamba_expand=2, mamba_dt_rank=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_config(family: str, impl: str = "eager"):
    if family == "jamba":
        config = transformers.AutoConfig.for_model("jamba", **_JAMBA)
    else:
        config = _tiny_config(family, VOCAB)
    config._attn_implementation = impl
    return config

def tiny_model(family: str, impl: str = "eager", seed: int = 0, dtype=torch.float32):
    """A tiny random causal LM of ``family`` in eval mode (biases and routers made to count), every recurrent
    layer's decay rate drawn slow, so that the prompt's state still matters at the completion's end."""
    model = random_model(tiny_config(family, impl), impl, seed, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-3, -1)
    return model
