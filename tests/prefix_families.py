"""Tiny random models of the 28 decoder families the shared-prefix engine is tested on (docs/prefix-engine.md).

Each is built with ``transformers.AutoConfig.for_model(<model_type>, ...)``: 2 layers (3 for families whose layer
types alternate, so that both kinds occur), hidden 32, 4 query heads over 2 KV heads, 2-4 experts, and a sliding
window of ``WINDOW`` tokens (shorter than the test sequences) on every family that has sliding-window layers.
"""

from __future__ import annotations

import warnings

import torch
import transformers

VOCAB = 97
WINDOW = 5  # shorter than most test prompt + completion lengths: the window is active
FAMILIES = (
    "llama qwen2 qwen3 mistral qwen3_moe qwen2_moe mixtral gemma gemma2 gemma3_text smollm3 olmo2 olmo3 phi3 granite "
    "gpt_oss glm4 cohere2 exaone4 ernie4_5 seed_oss apertus arcee helium internlm3 starcoder2 stablelm deepseek_v3"
).split()
# the attention implementations a family's model accepts (gemma2 and gpt_oss refuse sdpa)
EAGER_ONLY = {"gemma2", "gpt_oss"}

_TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # MoE
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
    # MLA (deepseek_v3)
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
)
# layer types that alternate, for the families whose masks follow them (3 layers: both kinds occur); Qwen3-MoE
# windows every layer when it has a window (its masks ignore layer_types)
_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
_WINDOWED = {"mistral", "mixtral", "starcoder2", "phi3", "gemma2", "gemma3_text", "olmo3", "gpt_oss", "cohere2",
             "exaone4", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "smollm3"}


def tiny_config(family: str, impl: str = "eager", window: bool = True):
    """A tiny config of ``family`` (``window``: an active sliding window where the family has one)."""
    default = transformers.AutoConfig.for_model(family)
    kwargs = {k: v for k, v in _TINY.items() if hasattr(default, k)}
    if getattr(default, "attn_logit_softcapping", None) is not None:
        kwargs["attn_logit_softcapping"] = 0.05  # tiny random scores are far below Gemma 2's 50: make the cap bite
    if family == "deepseek_v3":
        kwargs.update(head_dim=kwargs["qk_rope_head_dim"], num_key_value_heads=4)  # MLA: a K/V head per query head
    if window and family in _WINDOWED:
        kwargs.update(sliding_window=WINDOW, num_hidden_layers=3)
        if getattr(default, "layer_types", None) is not None or family in {"qwen2", "qwen3", "qwen2_moe"}:
            kwargs["layer_types"] = list(_LAYER_TYPES)
        if hasattr(default, "use_sliding_window"):
            kwargs["use_sliding_window"] = True
            kwargs["max_window_layers"] = 3
    config = transformers.AutoConfig.for_model(family, **kwargs)
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
