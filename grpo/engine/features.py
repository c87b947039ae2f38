"""Which families the shared layout serves: features detected on the model, not a list of names.

A decoder is served when every feature found on its config and modules is one the engine implements
(:data:`SERVED`), and refused, naming the feature, when one is not (:data:`REFUSED`). The served ones need:

* nothing in attention (per-token work, which the packed row runs once per prompt token): mixture-of-experts
  blocks (the router sees every token, as in the per-sequence forward), QK-norm, partial rotary, NoPE layers,
  multi-head latent attention (MLA: a value head size unlike the key's; grpo/engine/completion_attention.py),
  grouped-query attention;
* the score-level path (grpo/engine/score_attention.py): sliding-window layers (each layer's own window, honoured
  inside the shared layout), attention logit soft-capping, attention sinks;
* the state hand-over (grpo/engine/state_layers.py): recurrent layers (Gated DeltaNet, Mamba, short convolutions)
  that keep their state in transformers' linear-attention cache; each completion continues from its prompt's state.

Refused (the standard layout serves them): what would make the packed row attend differently from the
per-sequence forward, or bypass our attention function. See docs/prefix-engine.md for the family table.
"""

from __future__ import annotations

from grpo.engine.state_layers import forward_source, handed_over, not_handed_over, recurrent, state_layers

_ATTENTION_ENTRY = "ALL_ATTENTION_FUNCTIONS"  # what a layer calls when it goes through transformers' interface
_LAYER_TYPES = {"full_attention", "sliding_attention"}
_PER_TOKEN_TYPES = {"mlp", "moe"}  # layers without a token mixer (Nemotron-H): nothing to share or to switch


def attention_modules(model) -> list:
    """The model's softmax self-attention layers: modules of a class named ``*Attention`` that carry a
    ``layer_idx`` and keep no recurrent state (a linear attention named ``*Attention`` is not one)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and not recurrent(m)]


def mixing_layers(cfg) -> int:
    """How many decoder layers mix tokens (attention or a recurrent layer): all but Nemotron-H's MLP/MoE layers."""
    types = getattr(cfg, "layer_types", None) or ()
    return getattr(cfg, "num_hidden_layers", 1) - sum(t in _PER_TOKEN_TYPES for t in types)


def _uses_interface(cls) -> bool:
    return _ATTENTION_ENTRY in forward_source(cls)


def _moe(cfg, attn) -> bool:
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return any(n is not None and n > 1 for n in (getattr(cfg, k, None) for k in keys))


def _window(cfg, attn) -> bool:
    if not getattr(cfg, "sliding_window", None):
        return False
    types = getattr(cfg, "layer_types", None)
    return types is None or "sliding_attention" in types


def _partial_rotary(cfg, attn) -> bool:
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = getattr(cfg, "partial_rotary_factor", None) or (rope.get("partial_rotary_factor") if isinstance(rope, dict)
                                                             else None)
    return factor is not None and factor < 1


def _nope(cfg, attn) -> bool:
    no_rope = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 0 marks a layer without rotary
    return bool(no_rope) and 0 in no_rope


# served: the feature's name -> whether the model has it
SERVED = {
    "mixture of experts": _moe,
    "sliding-window layers": _window,
    "attention logit soft-capping": lambda cfg, attn: getattr(cfg, "attn_logit_softcapping", None) is not None,
    "attention sinks": lambda cfg, attn: any(hasattr(m, "sinks") for m in attn),
    "QK-norm": lambda cfg, attn: any(hasattr(m, n) for m in attn for n in ("q_norm", "q_layernorm", "query_norm")),
    "partial rotary": _partial_rotary,
    "NoPE layers": _nope,
    "multi-head latent attention": lambda cfg, attn: getattr(cfg, "kv_lora_rank", None) is not None,
    "grouped-query attention": lambda cfg, attn: bool(attn) and 1 < cfg.num_attention_heads // (
        getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
}


def _layer_types(cfg, attn, states, foreign) -> str | None:
    """Layers of a type other than softmax attention and MLP/MoE must each be a recurrent layer handed over."""
    served = {m.layer_idx for m in states}
    types = getattr(cfg, "layer_types", None) or ()
    other = {t for i, t in enumerate(types) if t not in _LAYER_TYPES | _PER_TOKEN_TYPES and i not in served}
    if not other and not foreign:
        return None
    why = f" ({'; '.join(foreign)})" if foreign else ""
    return f"layers of type {', '.join(sorted(other)) or 'recurrent'}{why}"


def _bypass(cfg, attn, states, foreign) -> str | None:
    n = mixing_layers(cfg)
    through = [m for m in attn if _uses_interface(type(m)) and getattr(m, "is_causal", True)]
    if len(through) < len(attn) or len(attn) + len(states) < n or not attn + states:
        return (f"attention that does not go through transformers' AttentionInterface in every layer ({len(through)} "
                f"of {n} layers do)")
    return None


def _flag(key: str, what: str):
    return lambda cfg, attn, states, foreign: what if getattr(cfg, key, None) else None


# refused: a check (config, softmax attention layers, recurrent layers handed over, the class names of recurrent
# layers that cannot be) that names the feature, or None
REFUSED = (
    _flag("is_encoder_decoder", "an encoder-decoder"),
    _layer_types,
    _bypass,
    _flag("attention_chunk_size", "chunked attention (attention_chunk_size)"),
    _flag("use_bidirectional_attention", "bidirectional attention"),
    _flag("alibi", "ALiBi position biases"),
    _flag("attn_temperature_tuning", "position-dependent attention temperature (attn_temperature_tuning)"),
)


def model_features(lm) -> tuple[list[str], str | None]:
    """(the served features ``lm`` has, the first feature the shared layout does not implement or None)."""
    cfg, attn, states = lm.config, attention_modules(lm), state_layers(lm)
    foreign = sorted({f"{type(m).__name__}: {not_handed_over(m)}" for m in lm.modules() if recurrent(m)
                      and not handed_over(m)})
    for check in REFUSED:
        reason = check(cfg, attn, states, foreign)
        if reason:
            return [], reason
    served = [name for name, has in SERVED.items() if has(cfg, attn)]
    return (["recurrent layers (state handed over from the prompt)"] if states else []) + served, None
