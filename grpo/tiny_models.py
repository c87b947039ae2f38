"""Tiny random configs of every family the engine serves: the one source for ``tiny:<family>`` and the tests.

``tiny_config(family, vocab_size, **overrides)`` builds ``transformers.AutoConfig.for_model(family, ...)`` with
a few small layers (:data:`SIZES`), the parts some families need at a small size (experts, latent attention:
:data:`PARTS`, applied where the family's config has the key), the special-token ids of the character tokenizer
(pad 0, bos 1, eos 2, inside the vocabulary) and, with ``window``, an active sliding window on the families that
have one. The families: :data:`ATTENTION_FAMILIES` (the 28 softmax-attention decoders of docs/prefix-engine.md) and
:data:`HYBRID_FAMILIES`, a name -> config-kwargs table the engine's hybrid (recurrent-layer) support extends with
each family it serves (the kwargs that make that family's layers small).
"""

from __future__ import annotations

ATTENTION_FAMILIES = (
    "llama qwen2 qwen3 mistral qwen3_moe qwen2_moe mixtral gemma gemma2 gemma3_text smollm3 olmo2 olmo3 phi3 granite "
    "gpt_oss glm4 cohere2 exaone4 ernie4_5 seed_oss apertus arcee helium internlm3 starcoder2 stablelm deepseek_v3"
).split()
LIN, FULL = "linear_attention", "full_attention"
KERNEL = 4  # the short convolution
CHUNK = 4  # Mamba2's scan chunk, where configurable
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=KERNEL)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=KERNEL,
               mamba_expand=2, mamba_chunk_size=CHUNK)
# family (model_type) -> config kwargs of its tiny model beyond SIZES and PARTS: the hybrid families the engine
# serves (recurrent layers mixed with attention; grpo/engine/state_layers.py), hidden 32, both kinds of layer
_HYBRID_SIZES = dict(hidden_size=32, intermediate_size=48, max_position_embeddings=256)
HYBRID_FAMILIES: dict[str, dict] = {k: {**_HYBRID_SIZES, **v} for k, v in {
    "qwen3_5_text": dict(_GDN, num_hidden_layers=3, layer_types=[LIN, FULL, LIN]),
    "qwen3_next": dict(_GDN, num_hidden_layers=3, layer_types=[LIN, FULL, LIN], num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "bamba": dict(_MAMBA2, num_hidden_layers=3, attn_layer_indices=[1]),
    "falcon_h1": dict(_MAMBA2, num_hidden_layers=2, mamba_d_ssm=64, mamba_d_head=16),
    "granitemoehybrid": dict(_MAMBA2, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48),
    "nemotron_h": dict(num_hidden_layers=4, layers_block_type=[LIN, FULL, "moe", "mlp"], ssm_state_size=8,
                       mamba_num_heads=4, mamba_head_dim=16, n_groups=1, conv_kernel=KERNEL, chunk_size=CHUNK,
                       n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1),
    "zamba2": dict(num_hidden_layers=3, mamba_d_state=8, mamba_d_conv=KERNEL, mamba_expand=2, mamba_ngroups=1,
                   n_mamba_heads=4, chunk_size=CHUNK, attention_head_dim=8, num_key_value_heads=4,
                   layers_block_type=[LIN, "hybrid", LIN], num_mem_blocks=1),
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
}.items()}

# families whose SSM width (heads x head size) must equal expand x hidden size: (heads, head size, expand) keys
_SSM_WIDTH = {f: [("mamba_n_heads", "mamba_d_head", "mamba_expand")] for f in ("bamba", "granitemoehybrid")}
_SSM_WIDTH["mamba2"] = [("num_heads", "head_dim", "expand")]

EAGER_ONLY = frozenset({"gemma2", "gpt_oss"})  # their models refuse sdpa

SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024)
PARTS = dict(
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
    # multi-head latent attention (deepseek_v3)
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
)
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # grpo.models.char_tokenizer's

# families with sliding-window layers; with a window, 3 layers whose types alternate where the masks follow them
# (both kinds occur). Qwen3-MoE windows every layer when it has a window (its masks ignore layer_types).
WINDOWED = frozenset({"mistral", "mixtral", "starcoder2", "phi3", "gemma2", "gemma3_text", "olmo3", "gpt_oss",
                      "cohere2", "exaone4", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "smollm3"})
WINDOW_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def families() -> list[str]:
    """Every family ``tiny:`` builds."""
    return [*ATTENTION_FAMILIES, *HYBRID_FAMILIES]


def tiny_config(family: str, vocab_size: int, *, window: int | None = None, **overrides):
    """A tiny config of ``family`` (a name of :func:`families`). ``window``: an active sliding window of that many
    tokens on a family that has one (None: the family's own, far longer than a tiny model's inputs). ``overrides``
    (e.g. ``model.tiny``) win over everything and are passed whether the family's config knows them or not."""
    import transformers

    if family not in families():
        raise KeyError(family)
    default = transformers.AutoConfig.for_model(family)
    kwargs = {k: v for k, v in {**SIZES, **PARTS}.items() if hasattr(default, k)}
    kwargs.update(HYBRID_FAMILIES.get(family, {}), vocab_size=vocab_size, **SPECIAL_IDS)
    heads = overrides.get("num_attention_heads", kwargs.get("num_attention_heads"))
    if hasattr(default, "head_dim") and heads:
        kwargs["head_dim"] = overrides.get("hidden_size", kwargs["hidden_size"]) // heads
    if window is not None and family in WINDOWED:
        kwargs.update(sliding_window=window, num_hidden_layers=3)
        if getattr(default, "layer_types", None) is not None:  # (qwen2, qwen3, qwen2_moe: theirs too)
            kwargs["layer_types"] = list(WINDOW_LAYER_TYPES)
        if hasattr(default, "use_sliding_window"):
            kwargs.update(use_sliding_window=True, max_window_layers=3)
    canon = (getattr(default, "attribute_map", None) or {}).get  # pragma: no mutate (every config has a map)
    taken = {canon(k, k) for k in overrides}  # pragma: no mutate (aliases: num_experts is num_local_experts)
    kwargs = {k: v for k, v in kwargs.items() if canon(k, k) not in taken}  # pragma: no mutate
    kwargs.update(overrides)
    for key in ("layer_types", "layers_block_type"):  # a hybrid family's layer pattern, cycled to the layer count
        pattern = kwargs.get(key) if key not in overrides else None
        if pattern and "num_hidden_layers" in kwargs and len(pattern) != kwargs["num_hidden_layers"]:
            kwargs[key] = [pattern[i % len(pattern)] for i in range(kwargs["num_hidden_layers"])]
    for heads, dim, expand in _SSM_WIDTH.get(family, ()):  # the SSM's heads x head size follow the width
        if dim not in overrides and heads in kwargs:
            kwargs[dim] = kwargs[expand] * kwargs["hidden_size"] // kwargs[heads]
    if family in ("deepseek_v3", "kimi_linear"):  # MLA: the rotary part is the head, a K/V head per query head
        per_query = kwargs["num_attention_heads"]  # pragma: no mutate (None: the configs' default, the same)
        kwargs.update(head_dim=kwargs["qk_rope_head_dim"], num_key_value_heads=per_query)  # pragma: no mutate
    return transformers.AutoConfig.for_model(family, **kwargs)


def attention_implementation(family: str, wanted: str) -> str:
    """The attention implementation a tiny ``family`` model gets when ``wanted`` is asked for."""
    return "eager" if family in EAGER_ONLY and wanted == "sdpa" else wanted
