"""A Hugging Face sequence-classification model as the reward.

Score: the model's raw logit for one label (label 0 by default) on prompt + completion — an
unbounded real number whose scale is the reward model's own; higher is better.
"""
from __future__ import annotations

import threading

from grpo.rewards.registry import register

_cache: dict[tuple, tuple] = {}
_lock = threading.Lock()


def _device(device: str | None):
    import torch

    if device:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # this rank's GPU
    return torch.device("cpu")


def load(path: str, device: str | None = None, dtype: str | None = None) -> tuple:
    """``(model, tokenizer, device)`` for ``path`` (a hub id or a local directory), loaded once per
    path, device and dtype and kept for the life of the process."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    dev = _device(device)
    if dtype is None:
        use_bf16 = dev.type == "cuda" and torch.cuda.is_bf16_supported()
        torch_dtype = torch.bfloat16 if use_bf16 else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    key = (path, str(dev), str(torch_dtype))
    with _lock:
        if key not in _cache:
            tok = AutoTokenizer.from_pretrained(path)
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token or tok.unk_token
            tok.truncation_side = "left"  # keep the end of the completion when too long
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch_dtype)
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tok.pad_token_id
            model.to(dev).eval().requires_grad_(False)
            _cache[key] = (model, tok, dev)
        return _cache[key]


def clear_cache() -> None:
    """Drop every loaded reward model (frees its memory once nothing else refers to it)."""
    with _lock:
        _cache.clear()


def _texts(tok, prompts: list[str], completions: list[str], chat_template: bool) -> list[str]:
    if chat_template:
        return [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                        tokenize=False) for p, c in zip(prompts, completions)]
    filler = tok.eos_token or tok.pad_token  # an empty text would give a row without tokens
    return [(p + c) if (p + c).strip() else filler for p, c in zip(prompts, completions)]


@register("reward_model")
def reward_model(prompts: list[str], completions: list[str], path: str | None = None,
                 batch_size: int = 8, max_length: int = 2048, label_index: int = 0,
                 chat_template: bool = False, device: str | None = None, dtype: str | None = None,
                 **_) -> list[float]:
    """The logit of label ``label_index`` that the classifier at ``path`` gives prompt + completion.

    Scored in batches of ``batch_size``, truncated from the left to ``max_length`` tokens, on
    ``device`` (default: this process's GPU if there is one, else the CPU) in ``dtype`` (default
    bfloat16 on a GPU that supports it, else float32). ``chat_template=True`` formats each pair
    as a user/assistant conversation with the reward model's own chat template instead of
    concatenating the strings (most chat reward models expect that; the prompts must then be
    raw user messages, not already templated).
    """
    if not path:
        raise ValueError("reward_model needs path= (a hub id or a local directory)")
    from grpo.models import local_path_problem

    problem = local_path_problem(path)
    if problem:
        raise ValueError(f"path={path!r} {problem}")
    import torch

    model, tok, dev = load(path, device, dtype)
    texts = _texts(tok, [p if isinstance(p, str) else "" for p in prompts],
                   [c if isinstance(c, str) else "" for c in completions], chat_template)
    scores: list[float] = []
    for i in range(0, len(texts), max(1, int(batch_size))):
        enc = tok(texts[i:i + int(batch_size)], return_tensors="pt", padding=True, truncation=True,
                  max_length=int(max_length), add_special_tokens=not chat_template)
        with torch.inference_mode():
            logits = model(input_ids=enc["input_ids"].to(dev),
                           attention_mask=enc["attention_mask"].to(dev)).logits
        scores.extend(logits[:, int(label_index)].float().cpu().tolist())
    return scores
