"""Tiny random models of the hybrid families (recurrent layers mixed with attention) the shared-prefix engine serves
(docs/prefix-engine.md, "Recurrent layers").

Each is built with ``transformers.AutoConfig.for_model(<model_type>, ...)``: hidden 32, 3 or 4 layers with both
kinds of token mixer (Mamba2 alone: 2 recurrent layers), a convolution kernel of ``KERNEL`` and, where the family
lets one set it, a scan chunk of ``CHUNK`` tokens (Gated DeltaNet's torch reference chunks by 64: the tests'
longest prompt is longer).
"""

from __future__ import annotations

import torch
import transformers

from tests.prefix_families import random_model

VOCAB = 97
KERNEL = 4  # the short convolution: the tests' prompts are shorter and longer
CHUNK = 4  # Mamba2's scan chunk, where configurable
LIN, FULL = "linear_attention", "full_attention"

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=KERNEL)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=KERNEL,
               mamba_expand=2, mamba_chunk_size=CHUNK)
HYBRID = {
    "qwen3_5_text": dict(_GDN, num_hidden_layers=3, layer_types=[LIN, FULL, LIN]),
    "qwen3_next": dict(_GDN, num_hidden_layers=3, layer_types=[LIN, FULL, LIN], num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "bamba": dict(_MAMBA2, num_hidden_layers=3, attn_layer_indices=[1]),
    "falcon_h1": dict(_MAMBA2, num_hidden_layers=2, mamba_d_ssm=64, mamba_d_head=16),
    "granitemoehybrid": dict(_MAMBA2, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48),
    "nemotron_h": dict(num_hidden_layers=4, layers_block_type=[LIN, "moe", FULL, "mlp"], ssm_state_size=8,
                       mamba_num_heads=4, mamba_head_dim=16, n_groups=1, conv_kernel=KERNEL, chunk_size=CHUNK,
                       n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1),
    "zamba2": dict(num_hidden_layers=3, mamba_d_state=8, mamba_d_conv=KERNEL, mamba_expand=2, mamba_ngroups=1,
                   n_mamba_heads=4, chunk_size=CHUNK, attention_head_dim=8, num_key_value_heads=4,
                   layers_block_type=[LIN, "hybrid", LIN], num_mem_blocks=1),
    "jamba": dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=1, expert_layer_period=3,
                  expert_layer_offset=2, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=KERNEL,
                  mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False),
    "kimi_linear": dict(num_hidden_layers=3, layer_types=[LIN, FULL, LIN], linear_head_dim=8, linear_num_heads=4,
                        linear_conv_kernel_dim=KERNEL, num_key_value_heads=4, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=None, num_experts=4,
                        num_local_experts=4, num_experts_per_token=2, moe_intermediate_size=16,
                        first_k_dense_replace=1),
    "olmo_hybrid": dict(_GDN, num_hidden_layers=3, layer_types=[LIN, FULL, LIN]),
    "mamba2": dict(num_hidden_layers=2, num_heads=4, head_dim=16, expand=2, state_size=8, n_groups=1,
                   conv_kernel=KERNEL, chunk_size=CHUNK),  # no attention at all
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", FULL, "conv"], conv_L_cache=KERNEL, conv_bias=False,
                 block_auto_adjust_ff_dim=False),
}
FAMILIES = tuple(HYBRID)


def tiny_config(family: str, impl: str = "eager"):
    config = transformers.AutoConfig.for_model(family, **{**_COMMON, **HYBRID[family]})
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
