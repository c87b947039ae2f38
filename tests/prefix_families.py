"""Tiny random models of the 28 decoder families the shared-prefix engine is tested on (docs/prefix-engine.md).

The configs come from grpo/tiny_models.py (what ``tiny:<family>`` builds), at the tests' smaller sizes: 2 layers (3
for families whose layer types alternate, so that both kinds occur), hidden 32, 4 query heads over 2 KV heads, 2-4
experts, and a sliding window of ``WINDOW`` tokens (shorter than the test sequences) on every family that has
sliding-window layers.
"""

from __future__ import annotations

import warnings

import torch
import transformers

from grpo.tiny_models import ATTENTION_FAMILIES, EAGER_ONLY
from grpo.tiny_models import tiny_config as _tiny_config

VOCAB = 97
WINDOW = 5  # shorter than most test prompt + completion lengths: the window is active
FAMILIES = ATTENTION_FAMILIES
__all__ = ["EAGER_ONLY", "FAMILIES", "VOCAB", "WINDOW", "tiny_config", "tiny_model"]
_SIZES = dict(hidden_size=32, intermediate_size=48, max_position_embeddings=128)


def tiny_config(family: str, impl: str = "eager", window: bool = True):
    """A tiny config of ``family`` (``window``: an active sliding window where the family has one)."""
    sizes = {k: v for k, v in _SIZES.items() if hasattr(transformers.AutoConfig.for_model(family), k)}
    if getattr(transformers.AutoConfig.for_model(family), "attn_logit_softcapping", None) is not None:
        sizes["attn_logit_softcapping"] = 0.05  # tiny random scores are far below Gemma 2's 50: make the cap bite
    config = _tiny_config(family, VOCAB, window=WINDOW if window else None, **sizes)
    config._attn_implementation = impl
    return config


def tiny_model(family: str, impl: str = "eager", window: bool = True, seed: int = 0, dtype=torch.float32):
    """A tiny random causal LM of ``family``, in eval mode; biases (zero at init) and routers made to count."""
    return random_model(tiny_config(family, impl, window), impl, seed, dtype)


def random_model(config, impl: str = "eager", seed: int = 0, dtype=torch.float32):
    """The causal LM of ``config`` with random weights, in eval mode; biases (zero at init), sinks and routers
    drawn so that they count."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "sinks" in name or "router" in name or name.endswith(".gate.weight"):
                p.normal_(0, 0.5)
    return model.eval()
