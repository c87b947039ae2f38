"""The policy's weights as the samplers take them: under the plain Hugging Face checkpoint names, one at a time,
LoRA merged or not (`hf_weights`). Used by every backend that holds its own copy of the weights (vLLM in-process,
``grpo-serve`` over gloo or nccl, the servers' generator thread)."""
from __future__ import annotations

import contextlib

import torch

from grpo.engine.unwrap import unwrap_model


@contextlib.contextmanager
def as_they_are(params):
    yield False


def hf_weights(model, full_weights=as_they_are, merge: bool = True):
    """(name, tensor) of every weight of the policy under the plain Hugging Face checkpoint names, one at a time.

    ``full_weights(params)`` (`grpo.runtime.base.Runtime.full_weights`): the parameters of one weight (a LoRA layer:
    its base weight and adapters) are made whole for the time it is read (ZeRO-3 gathers them, then gives them
    back: a copy is yielded, never the whole model at once). PEFT LoRA: each adapted layer's merged weight
    W + scale * B A (computed, the trainer's W left untouched), or with ``merge=False`` its base weight W (the
    adapters go on their own: `grpo.rollout.lora_sync`); the adapter's own tensors are not sent here."""
    model = unwrap_model(model, peft=False)  # under DeepSpeed's engine; PEFT's wrapper kept
    peft = hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    lora = {f"{name}.weight": m for name, m in base.named_modules()
            if peft and hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    for name, t in base.state_dict(keep_vars=True).items():
        if ".lora_" in name or "lora_embedding" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        layer = lora.get(plain)
        params = list(layer.parameters()) if layer is not None else \
            [t] if isinstance(t, torch.nn.Parameter) else []
        # no grad-mode context across the yield: a generator left suspended would restore it whenever collected
        with full_weights(params) as temporary:
            if layer is not None and not merge:
                layer, t = None, layer.base_layer.weight
            w = _merged(layer) if layer is not None else t.detach()
            yield plain, w.clone() if temporary and layer is None else w


def _merged(layer) -> torch.Tensor:
    """A PEFT LoRA layer's effective weight: its base weight plus each active adapter's scaled B A (a new tensor)."""
    active = [a for a in getattr(layer, "active_adapters", []) if a in getattr(layer, "lora_A", {})]
    with torch.no_grad():
        w = layer.base_layer.weight.detach()
        for a in active:
            w = w + layer.get_delta_weight(a).detach().to(w.dtype)
        return w if active else w.clone()


def counted(weights, tally: dict):
    """``weights`` ((name, tensor) pairs) streamed on, ``tally["tensors"]`` and ``tally["bytes"]`` counting what has
    passed; the source is closed when the stream ends or is closed (a gathered weight released at once)."""
    tally.update(tensors=0, bytes=0)
    try:
        for name, t in weights:
            tally["tensors"] += 1
            tally["bytes"] += t.numel() * t.element_size()
            yield name, t
    finally:
        if hasattr(weights, "close"):
            weights.close()
