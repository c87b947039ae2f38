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
             greedy: bool = False, desc: str = "rollout", progress: bool = True):
    """Returns ``(completion_ids, truncated)``: per prompt, ``group_size`` token lists and flags."""
    # A multi-process runtime may need every rank in every decoding step (DeepSpeed ZeRO-3: partitioned
    # weights): its model carries a context that prepares it and yields extra generate kwargs.
    ready = getattr(model, "grpo_generation_context", None)
    with ready() if ready is not None else contextlib.nullcontext({}) as extra:
        return _generate(_unwrap(model), tokenizer, prompt_ids, group_size=group_size, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, top_k=top_k, batch_size=batch_size, greedy=greedy,
                         desc=desc, progress=progress, extra=extra)


def _generate(model, tokenizer, prompt_ids, *, group_size, max_new_tokens, temperature, top_p, top_k, batch_size,
              greedy, desc, progress, extra):
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
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k,
                        num_return_sequences=group_size) if not greedy else dict(do_sample=False)
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad_id, use_cache=True, **sampling, **extra)
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
