"""The start-up check that the engine's log-probs are the model's own: no unlisted family trains on wrong ones.

The engine never asks a model for its logits: it applies the output head itself, at the positions that predict a
completion token (grpo/engine/logprob_head.py), and reproduces what each family does between its last hidden state
and its logits (``TRANSFORMS`` there). A model that does something else (a multiplier, a soft-cap, a bias the
engine does not know of) would train on silently wrong log-probs, ratios, KL and gradients. So before training the
run scores a few tokens both ways, under the runtime it trains with (a DeepSpeed engine, ZeRO-3 included: both are
ordinary forwards every rank runs; a peft model with its LoRA adapters), and stops when they disagree.

The engine's side is its standard layout: the same decoder call as the model's own forward, so the hidden states
agree and any gap is the head's (the shared layout's exactness is the equivalence tests' business).
"""

from __future__ import annotations

import torch

from grpo.engine.logprob_head import head_transform
from grpo.engine.logprobs import token_logprobs
from grpo.engine.unwrap import unwrap_model
from grpo.errors import SetupError

__all__ = ["check_head", "head_gap", "head_tolerance"]

PROMPT_TOKENS, COMPLETIONS, COMPLETION_TOKENS = 4, 2, 4  # 8 scored tokens: two forwards of a (2, 8) batch


def head_tolerance(dtype: torch.dtype) -> float:
    """The largest gap (in nats, log-prob or entropy) that rounding explains: the two sides round the same logits
    in a different order (the model multiplies in its own dtype, the engine in float32)."""
    return {torch.bfloat16: 0.25, torch.float16: 0.05}.get(dtype, 1e-3)


def _check_tokens(vocab: int) -> tuple[list[int], list[list[int]]]:
    ids = [(7 + 37 * k) % vocab for k in range(PROMPT_TOKENS + COMPLETIONS * COMPLETION_TOKENS)]
    rest = ids[PROMPT_TOKENS:]
    return ids[:PROMPT_TOKENS], [rest[i * COMPLETION_TOKENS:(i + 1) * COMPLETION_TOKENS] for i in range(COMPLETIONS)]


def _own_logprobs(model, prompt, comps, device):
    """log p(target) and entropy at the completion tokens, from the model's own forward and logits."""
    ids = torch.tensor([prompt + c for c in comps], device=device)  # pragma: no mutate
    mask = torch.ones_like(ids)  # pragma: no mutate
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)  # pragma: no mutate
    logits = out[0][:, len(prompt) - 1:-1].float()  # no labels, no loss: the logits, of a ModelOutput or a tuple
    logp = torch.log_softmax(logits, dim=-1)
    target = logp.gather(-1, ids[:, len(prompt):, None])[..., 0]
    return target.reshape(-1), -(logp.exp() * logp).sum(-1).reshape(-1)


def head_gap(model) -> float:
    """The largest difference between the engine's log-probs (and entropies) and those of the model's own forward,
    over a few tokens. ``model``: what the run trains (plain, peft, DDP or a DeepSpeed engine); it is put in eval
    mode for the two forwards (no dropout) and left as it was."""
    lm = unwrap_model(model)
    text = lm.config.get_text_config()  # a composite model's language model's (every config has one)
    emb = lm.get_input_embeddings()  # pragma: no mutate
    device = emb.weight.device if emb is not None else next(lm.parameters()).device  # pragma: no mutate
    out_features = getattr(lm.get_output_embeddings(), "out_features", None)  # pragma: no mutate
    sizes = (text.vocab_size, head_transform(text).vocab, out_features)
    prompt, comps = _check_tokens(min(int(n) for n in sizes if n))  # tokens the model and its head know
    modules = list(model.modules())
    training = [m.training for m in modules]
    model.eval()
    try:
        with torch.no_grad():
            own_lp, own_ent = _own_logprobs(model, prompt, comps, device)  # pragma: no mutate
            lps, ents = token_logprobs(model, [prompt], [comps], shared_prefix=False, return_entropy=True)
    finally:
        for m, was in zip(modules, training):
            m.training = was
    lp, ent = torch.cat(lps[0]), torch.cat(ents[0])
    return max((lp - own_lp).abs().max().item(), (ent - own_ent).abs().max().item())


def check_head(model, agree=lambda gap: gap) -> float:
    """Raise `SetupError` (one line naming the model class and the gap) unless the engine's log-probs of ``model``
    equal its own forward's within rounding; returns the gap. ``agree`` turns this process's gap into the one every
    process decides on (the largest over ranks), so that all of them stop or none does."""
    lm = unwrap_model(model)
    gap = agree(head_gap(model))
    dtype = next(lm.parameters()).dtype
    tol = head_tolerance(dtype)
    if not gap <= tol:  # NaN refuses too
        raise SetupError(
            f"the engine's log-probs of {type(lm).__name__} differ from the model's own forward by {gap:.3g} "
            f"(largest over {PROMPT_TOKENS + COMPLETIONS * COMPLETION_TOKENS} tokens; rounding in "
            f"{str(dtype).removeprefix('torch.')} explains {tol:g}): it changes its output head's result in a way "
            f"grpo/engine/logprob_head.py does not reproduce (add its model_type to TRANSFORMS there); not training"
        )
    return gap
