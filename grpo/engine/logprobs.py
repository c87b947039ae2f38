"""``token_logprobs``: per-token log-probabilities of GRPO completions, with the prompt encoded once per group.

The public entry of the engine (``grpo.token_logprobs``). It checks the inputs, unwraps the model, picks the
layout (shared prefix, or the standard right-padded rows for models the shared one cannot serve) and the
attention kernel, runs the decoder micro-batch by micro-batch and applies the log-prob head at the positions
that predict completion tokens only. See docs/prefix-engine.md.
"""

from __future__ import annotations

import warnings

import torch

from grpo.engine.flex_kernel import build_block_mask, flex_available
from grpo.engine.layout import build_layout
from grpo.engine.logprob_head import head_logprobs
from grpo.engine.micro_batches import plan_micro_batches, scatter
from grpo.engine.patch import check_every_layer, placeholder_mask, shared_prefix_unsupported, switched_attention
from grpo.engine.prefix_attention import LAYOUT_KWARG
from grpo.engine.unwrap import unwrap_chain, unwrap_model
from grpo.engine.vision_logprobs import NOT_SERVED, VISION_FAMILIES, vision_token_logprobs
from grpo.errors import GRPOWarning

__all__ = ["token_logprobs", "ATTENTION_KERNELS"]

ATTENTION_KERNELS = ("auto", "grouped", "flex")


def token_logprobs(
    model,
    prompt_ids,
    completion_ids,
    *,
    shared_prefix: bool = True,
    temperature: float = 1.0,
    max_tokens_per_micro_batch: int | None = None,
    return_entropy: bool = False,
    attention_kernel: str = "auto",
):
    """Per-token log p(completion token | prompt, earlier completion tokens) for GRPO groups.

    prompt_ids: list (one per group) of token lists; completion_ids: list (per group) of list (per completion)
    of token lists. Everything may be ragged, G may differ per group. Returns the same nesting of 1-D float32
    tensors (one value per completion token), computed from logits / temperature, differentiable when grad is
    enabled. With ``return_entropy=True`` returns ``(logps, entropies)``.

    ``shared_prefix=True`` encodes each prompt once per group (exact; see docs/prefix-engine.md);
    ``shared_prefix=False`` is the standard right-padded layout. Models the shared layout cannot serve exactly
    fall back to the standard one with a warning.

    ``attention_kernel`` picks how the shared layout's attention is computed: ``grouped`` (any device),
    ``flex`` (FlexAttention block mask, compiled; CUDA, or CPU without grad) or ``auto`` (grouped for now:
    flex becomes the CUDA default once it has been measured on a GPU).
    """
    if getattr(unwrap_model(model).config, "model_type", None) in (*VISION_FAMILIES, *NOT_SERVED):  # images; refusals
        return vision_token_logprobs(model, prompt_ids, completion_ids, shared_prefix=shared_prefix,
                                     temperature=temperature, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                                     return_entropy=return_entropy)
    prompts, comps = _as_groups(prompt_ids, completion_ids, temperature)
    lm, decoder, head = _model_parts(model)
    kernel = _resolve_kernel(attention_kernel, lm)
    shared_prefix = shared_prefix and _shared_prefix_serves(lm, prompts, comps)
    plan = plan_micro_batches(
        [len(p) for p in prompts], [[len(r) for r in cs] for cs in comps], max_tokens_per_micro_batch,
        shared_prefix=shared_prefix,
    )
    logps: list[list] = [[None] * len(cs) for cs in comps]
    ents: list[list] = [[None] * len(cs) for cs in comps]
    for mb in plan:
        sub_p = [prompts[g] for g, _ in mb]
        sub_c = [comps[g][sl] for g, sl in mb]
        if shared_prefix:
            lp, ent = _forward_shared_prefix(lm, decoder, head, sub_p, sub_c, temperature, return_entropy, kernel)
        else:
            lp, ent = _forward_standard(lm, decoder, head, sub_p, sub_c, temperature, return_entropy)
        scatter(mb, comps, lp, ent, logps, ents)
    return (logps, ents) if return_entropy else logps


# --------------------------------------------------------------------------------------------- inputs and choices
def _as_groups(prompt_ids, completion_ids, temperature):
    """Check the inputs; returns (prompts, completions) as lists of token lists."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completion groups")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    prompts = [_as_list(p) for p in prompt_ids]
    comps = [[_as_list(r) for r in cs] for cs in completion_ids]
    for g, p in enumerate(prompts):
        if not p:
            raise ValueError(f"group {g} has an empty prompt: the first completion token needs a context")
    return prompts, comps


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(t) for t in x]  # pragma: no mutate  (no tensor made)


def _model_parts(model):
    """(causal LM, decoder stack, output embedding) of a plain, peft-wrapped or DDP/DeepSpeed model."""
    chain = unwrap_chain(model)
    if torch.is_grad_enabled() and any(type(m).__name__ == "DistributedDataParallel" for m in chain):
        warnings.warn(
            "token_logprobs calls the decoder inside DistributedDataParallel directly, so DDP does not "
            "all-reduce these gradients; all-reduce them yourself (or use DeepSpeed/FSDP)", stacklevel=3
        )
    m = chain[-1]
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(m).__name__} has no output embeddings: token_logprobs needs a causal LM")
    decoder = m.get_decoder() if hasattr(m, "get_decoder") else None
    if decoder is None or decoder is m:
        decoder = getattr(m, "model", None)
    if decoder is None:
        raise ValueError(f"cannot find the decoder stack of {type(m).__name__}")
    return m, decoder, head


def _shared_prefix_serves(lm, prompts, comps) -> bool:
    """Whether the shared layout serves ``lm`` for these groups exactly; warns (naming the reason) when not."""
    max_len = max([len(p) + max([0] + [len(r) for r in cs]) for p, cs in zip(prompts, comps)] + [0])
    reason = shared_prefix_unsupported(lm, max_len)
    if reason is not None:
        warnings.warn(f"shared-prefix forward disabled, using the standard layout: {reason}", GRPOWarning, stacklevel=3)
    return reason is None


def _resolve_kernel(kernel: str, lm) -> str:
    """'grouped' or 'flex' for this call; see token_logprobs."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
    device = _device(lm)
    dropout = lm.training and (getattr(lm.config, "attention_dropout", None) or 0.0) > 0
    if kernel == "auto":  # flex stays opt-in until it has been measured on a GPU (docs/prefix-engine.md)
        return "grouped"
    if kernel == "flex":
        if not flex_available():
            raise ValueError("attention_kernel='flex' needs torch.nn.attention.flex_attention "
                             f"(torch {torch.__version__} "
                             "has none); use 'grouped' or 'auto'")
        if device.type == "cpu" and torch.is_grad_enabled():
            raise ValueError("attention_kernel='flex' cannot run backward on CPU (PyTorch's FlexAttention has no CPU "
                             "backward); use 'grouped' or 'auto' there, or call under torch.no_grad()")
        if dropout:
            raise ValueError("attention_kernel='flex' has no attention dropout and the model trains with "
                             "attention_dropout > 0; use 'grouped' or 'auto'")
    return kernel


def _device(lm) -> torch.device:
    emb = lm.get_input_embeddings()
    return emb.weight.device if emb is not None else next(lm.parameters()).device


# --------------------------------------------------------------------------------------------- forwards
def _forward_standard(lm, decoder, head, prompts, comps, temperature, want_entropy):
    device = _device(lm)  # pragma: no mutate
    rows = [(p, r) for p, cs in zip(prompts, comps) for r in cs if len(r)]
    if not rows:
        return _empty(device), _empty(device)  # pragma: no mutate
    L = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)  # pragma: no mutate
    pred, targets = [], []
    for n, (p, r) in enumerate(rows):
        seq = list(p) + list(r)
        ids[n, : len(seq)] = torch.tensor(seq)
        mask[n, : len(seq)] = 1  # pragma: no mutate
        pred.extend(n * L + len(p) - 1 + k for k in range(len(r)))
        targets.extend(r)
    out = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)  # pragma: no mutate
    hidden = _hidden(out)
    idx = torch.tensor(pred, device=hidden.device)  # pragma: no mutate
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)
    tgt = torch.tensor(targets, dtype=torch.long, device=h.device)  # pragma: no mutate
    return head_logprobs(h, head, lm.config, tgt, temperature, want_entropy)


def _forward_shared_prefix(lm, decoder, head, prompts, comps, temperature, want_entropy, kernel):
    device = _device(lm)  # pragma: no mutate
    if not any(len(r) for cs in comps for r in cs):
        return _empty(device), _empty(device)  # pragma: no mutate
    layout = build_layout(prompts, comps, device)
    if kernel == "flex":
        layout.block_mask = build_block_mask(layout)
    inputs = {"input_ids": layout.input_ids, "position_ids": layout.position_ids}
    # the layout also reaches our attention through the switch's state, our attention ignores the mask, and no cache
    # is what the forward would build otherwise: each of these alone changes no output (a guard, and work saved)
    mask = placeholder_mask(device)  # pragma: no mutate
    inputs.update(attention_mask=mask, use_cache=False, **{LAYOUT_KWARG: layout})  # pragma: no mutate
    with switched_attention(lm, state=layout):
        out = decoder(**inputs)
    check_every_layer(layout.calls, lm)
    hidden = _hidden(out)[0]
    h = hidden.index_select(0, layout.pred_idx)
    return head_logprobs(h, head, lm.config, layout.targets, temperature, want_entropy)


def _hidden(out) -> torch.Tensor:
    return out[0]  # a ModelOutput's first field is its last_hidden_state (a tuple's first element too)


def _empty(device):
    return torch.zeros(0, device=device)
