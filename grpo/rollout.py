"""Rollout: sample G completions per prompt with the policy, batched, with a progress bar.

Completions end at the first EOS (kept: the model must learn to stop) or at ``max_new_tokens``
(marked truncated).
"""
from __future__ import annotations

import contextlib

import torch
from tqdm.auto import tqdm


def _unwrap(model):
    return getattr(model, "module", model)


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: list[list[int]], *, group_size: int, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, batch_size: int = 8,
             greedy: bool = False, desc: str = "rollout", progress: bool = True, share_prompt: bool = True):
    """Returns ``(completion_ids, truncated)``: per prompt, ``group_size`` token lists and flags.

    With ``share_prompt`` each prompt is prefilled once and its KV cache forked for the G samples
    (``num_return_sequences`` would prefill G copies)."""
    # A multi-process runtime may need every rank in every decoding step (DeepSpeed ZeRO-3: partitioned
    # weights): its model carries a context that prepares it and yields extra generate kwargs.
    ready = getattr(model, "grpo_generation_context", None)
    with ready() if ready is not None else contextlib.nullcontext({}) as extra:
        return _generate(_unwrap(model), tokenizer, prompt_ids, group_size=group_size, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, top_k=top_k, batch_size=batch_size, greedy=greedy,
                         desc=desc, progress=progress, extra=extra, share_prompt=share_prompt)


def _generate(model, tokenizer, prompt_ids, *, group_size, max_new_tokens, temperature, top_p, top_k, batch_size,
              greedy, desc, progress, extra, share_prompt):
    device = next(model.parameters()).device
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    was_training = model.training
    model.eval()
    completions, truncated = [], []
    n_samples = 1 if greedy else group_size
    bar = tqdm(total=len(prompt_ids) * n_samples, desc=desc, unit="seq", leave=False, disable=not progress)
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        width = max(len(p) for p in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long, device=device)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(chunk):  # left padding
            input_ids[i, width - len(p):] = torch.tensor(p, device=device)
            attention[i, width - len(p):] = 1
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) \
            if not greedy else dict(do_sample=False)
        if not greedy and share_prompt and group_size > 1 and width > 1 and not extra:
            input_ids, attention, cache = prefill_shared(model, input_ids, attention, group_size)
            sampling[_cache_kwarg(model)] = cache
        elif not greedy:
            sampling["num_return_sequences"] = group_size
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad_id, use_cache=True, **PURE_SAMPLING, **sampling,
                             **extra)
        new = out[:, width:].tolist()
        for i, p in enumerate(chunk):
            group, flags = [], []
            for j in range(n_samples):
                ids, cut = _cut_at_eos(new[i * n_samples + j], eos, max_new_tokens)
                group.append(ids)
                flags.append(cut)
            completions.append(group)
            truncated.append(flags)
        bar.update(len(chunk) * n_samples)
    bar.close()
    if was_training:
        model.train()
    return completions, truncated


# The loss scores samples with softmax(logits / T) only; every other logits processor a checkpoint's
# generation_config.json may switch on (Qwen ships repetition_penalty 1.05) would make the rollout
# off-policy without anything noticing. Turn them all off explicitly (explicit kwargs win).
PURE_SAMPLING = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0,
                     eta_cutoff=0.0, encoder_repetition_penalty=1.0, bad_words_ids=None, suppress_tokens=None,
                     begin_suppress_tokens=None, min_new_tokens=None, min_length=0, forced_bos_token_id=None,
                     forced_eos_token_id=None, sequence_bias=None, renormalize_logits=False)


def prefill_shared(model, input_ids, attention, group_size: int):
    """Run every prompt but its last token once, then fork the KV cache ``group_size`` times.

    Returns the G-fold repeated inputs and the cache; ``generate`` then feeds only the last prompt
    token per row. Rows are ordered like ``num_return_sequences`` (each prompt's G samples adjacent).
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    model(input_ids=input_ids[:, :-1], attention_mask=attention[:, :-1], position_ids=positions[:, :-1],
          use_cache=True, **{_cache_kwarg(model): cache})
    cache.batch_repeat_interleave(group_size)
    return input_ids.repeat_interleave(group_size, 0), attention.repeat_interleave(group_size, 0), cache


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache argument ``cache``; older releases ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the wrapped model's name
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _cut_at_eos(ids: list[int], eos: list[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first EOS; truncated when there is none."""
    for k, t in enumerate(ids):
        if t in eos:
            return ids[: k + 1], False
    return ids[:max_new_tokens], True
