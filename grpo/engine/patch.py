"""Switching a model's attention to ours: the one place that does it, checks it may, and checks that it happened.

* :func:`shared_prefix_unsupported`: why a model cannot be served exactly by the shared-prefix attention (a feature
  the engine does not implement, detected on the model by grpo/engine/features.py, or a gradient checkpointing
  the engine cannot follow), or None.
* :func:`switched_attention`: for the duration of a call, every config of the model names our attention function
  (``grpo_prefix`` for training forwards, ``grpo_prefix_decode`` for the rollout), gradient-checkpointing
  recomputes switch too, and everything is restored on exit, also on exception. The model code is not modified.
* :func:`placeholder_mask`: the 4-D ``attention_mask`` passed alongside: transformers forwards it untouched and our
  attention ignores it; its zero width broadcasts against nothing, so a stock eager/SDPA attention that ever saw
  the packed input would fail on its shape instead of silently attending across completions.
* :func:`check_every_layer`: after a forward, every attention layer must have come through our function. The
  failure policy is to raise, with one line that says how to turn the sharing off.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from grpo.engine.decode_attention import DECODE_ATTN_NAME, prefix_decode_attention_forward
from grpo.engine.features import attention_modules, mixing_layers, model_features
from grpo.engine.layout import ACTIVE
from grpo.engine.prefix_attention import ATTN_NAME, prefix_attention_forward
from grpo.engine.state_layers import state_layers, switched_state_layers
from grpo.engine.unwrap import unwrap_model

# what to do when some layer did not come through our attention, per attention function
_TURN_OFF = {
    ATTN_NAME: "call token_logprobs with shared_prefix=False (trainer: engine.shared_prefix=false)",
    DECODE_ATTN_NAME: "set rollout.share_prompt=false",
}


# --------------------------------------------------------------------------------------------- may we switch
def shared_prefix_unsupported(model, max_seq_len: int) -> str | None:
    """Why the shared-prefix attention cannot serve ``model`` (plain, peft or engine-wrapped) exactly for sequences
    of up to ``max_seq_len`` tokens, or None."""
    lm = unwrap_model(model)
    _, missing = model_features(lm)
    if missing is not None:
        return f"{missing} is not implemented by the shared layout"
    if not _checkpointing_is_wrappable(lm):
        return "gradient checkpointing is applied by a mechanism the engine cannot follow"
    return None


def shared_decode_unsupported(model, max_seq_len: int) -> str | None:
    """Why the rollout cannot decode ``model``'s rows against one shared copy of each prompt's K/V, or None: what
    the shared layout refuses, and attention blocks shared between decoder layers (Zamba2), whose one module
    serves several layers' K/V."""
    reason = shared_prefix_unsupported(model, max_seq_len)
    if reason is None and any("layer_idx" in inspect.signature(type(m).forward).parameters
                              for m in attention_modules(unwrap_model(model))):
        return "attention blocks shared between decoder layers"
    return reason


def _checkpointing_is_wrappable(model) -> bool:
    """True unless some module checkpoints in a way we cannot see (then the recompute would not use us)."""
    for m in model.modules():
        hidden = not callable(getattr(m, "_gradient_checkpointing_func", None))
        if getattr(m, "gradient_checkpointing", False) and hidden:
            return False
    return True


# --------------------------------------------------------------------------------------------- the switch
_registered = False


def register() -> None:
    """Register ``grpo_prefix`` and ``grpo_prefix_decode`` in transformers' AttentionInterface (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface  # transformers loads only when a model is switched

        AttentionInterface.register(ATTN_NAME, prefix_attention_forward)
        AttentionInterface.register(DECODE_ATTN_NAME, prefix_decode_attention_forward)
        _registered = True


def _configs(model) -> list:
    seen: dict[int, object] = {}
    todo = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    for cfg in todo:  # the list grows while it is read: each config's sub-configs are read in their turn
        if id(cfg) in seen:
            continue
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", None) or {}:
            sub = getattr(cfg, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                todo.append(sub)
    return list(seen.values())


def _set_impl(configs, values) -> None:
    for cfg, val in zip(configs, values):
        if "_attn_implementation_internal" in vars(cfg):
            cfg._attn_implementation_internal = val  # no recursion into sub-configs
        else:
            cfg._attn_implementation = val


def _with_impl(fn, configs, name, state, layers):
    """Run ``fn`` with attention ``name`` (and its ``state``) active and the recurrent ``layers`` switched: used for
    the recompute of gradient checkpointing, which happens in backward, after ``switched_attention`` has restored
    the configs."""

    def run(*args, **kwargs):
        saved = [c._attn_implementation for c in configs]
        _set_impl(configs, [name] * len(configs))
        token = ACTIVE.set(state)
        try:
            with switched_state_layers(layers):
                return fn(*args, **kwargs)
        finally:
            ACTIVE.reset(token)
            _set_impl(configs, saved)

    return run


def switched_attention(model, name: str = ATTN_NAME, state=None):
    """Switch every config of ``model`` to attention ``name`` (``grpo_prefix``, or ``grpo_prefix_decode`` for the
    rollout) for the duration, and make gradient-checkpointing recomputes switch too. ``state`` (the layout, or
    the shared prompt K/V) is what our attention reads where a decoder layer does not pass its keyword arguments
    on. Recurrent layers (grpo/engine/state_layers.py) continue each completion from its prompt's state inside a
    training forward. Everything is restored on exit, also on exception."""
    register()
    configs = _configs(model)
    saved = [c._attn_implementation for c in configs]
    layers = state_layers(model)
    wrapped = []
    token = ACTIVE.set(state)
    try:
        for m in model.modules():
            func = getattr(m, "_gradient_checkpointing_func", None)
            if getattr(m, "gradient_checkpointing", False) and callable(func):
                had_own = "_gradient_checkpointing_func" in vars(m)
                wrapped.append((m, func, had_own))
                m._gradient_checkpointing_func = (
                    lambda fn, *a, _f=func, **kw: _f(_with_impl(fn, configs, name, state, layers), *a, **kw)
                )
        _set_impl(configs, [name] * len(configs))
        with switched_state_layers(layers):
            yield
    finally:
        ACTIVE.reset(token)
        _set_impl(configs, saved)
        for m, func, had_own in wrapped:
            if had_own:
                m._gradient_checkpointing_func = func
            else:
                del m._gradient_checkpointing_func


switched_attention = contextlib.contextmanager(switched_attention)  # by a call: mutmut skips decorated functions


# --------------------------------------------------------------------------------------------- around the forward
def placeholder_mask(device) -> torch.Tensor:
    """The zero-width 4-D ``attention_mask`` passed with our attention switched on (see the module doc)."""
    mask = torch.ones(1, 1, 1, 0, dtype=torch.bool)
    return mask.to(device)  # pragma: no mutate


def check_every_layer(calls: int, model, name: str = ATTN_NAME) -> None:
    """Raise (one line) unless ``calls`` calls, counted by our function ``name`` in one forward, cover every layer
    of ``model`` that mixes tokens (in training: attention and recurrent layers; in decoding: attention layers)."""
    lm = unwrap_model(model)
    cfg = lm.config
    layers = mixing_layers(cfg)
    if name != ATTN_NAME:  # decoding: the layers whose only token mixer is recurrent do not call us
        attention = {m.layer_idx for m in attention_modules(lm)}
        layers -= len({m.layer_idx for m in state_layers(lm)} - attention)
    if calls < layers:
        raise RuntimeError(
            f"only {calls} of {layers} attention layers of this {cfg.model_type!r} model went through the "
            f"shared-prefix attention {name!r} (the others bypass transformers' AttentionInterface, so their output "
            f"would be wrong); {_TURN_OFF[name]}"
        )
