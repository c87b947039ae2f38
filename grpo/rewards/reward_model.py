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


def reward_model(prompts: list[str], completions: list[str], path: str | None = None,
                 batch_size: int = 8, max_length: int = 2048, label_index: int = 0,
                 chat_template: bool = False, device: str | None = None, dtype: str | None = None,
                 share_prompt: bool = True, **_) -> list[float]:
    """The logit of label ``label_index`` that the classifier at ``path`` gives prompt + completion.

    Scored in batches of ``batch_size``, truncated from the left to ``max_length`` tokens, on
    ``device`` (default: this process's GPU if there is one, else the CPU) in ``dtype`` (default
    bfloat16 on a GPU that supports it, else float32). ``chat_template=True`` formats each pair
    as a user/assistant conversation with the reward model's own chat template instead of
    concatenating the strings (most chat reward models expect that; the prompts must then be
    raw user messages, not already templated).

    ``share_prompt`` (default): the rows of one prompt are scored as one group through the shared-prefix engine
    (grpo/engine/hidden_states.py), their common leading tokens encoded once, exactly the per-row scores; models the
    engine does not serve are scored row by row.
    """
    if not path:
        raise ValueError("reward_model needs path= (a hub id or a local directory)")
    from grpo.models import local_path_problem

    problem = local_path_problem(path)
    if problem:
        raise ValueError(f"path={path!r} {problem}")
    import torch

    model, tok, dev = load(path, device, dtype)
    prompts = [p if isinstance(p, str) else "" for p in prompts]
    texts = _texts(tok, prompts, [c if isinstance(c, str) else "" for c in completions], chat_template)
    if share_prompt and _engine_serves(model):
        rows = [tok(t, truncation=True, max_length=int(max_length), add_special_tokens=not chat_template)["input_ids"]
                for t in texts]
        return _shared_scores(model, rows, prompts, max(1, int(batch_size)), int(label_index))
    scores: list[float] = []
    step = max(1, int(batch_size))
    for i in range(0, len(texts), step):
        enc = tok(texts[i:i + step], return_tensors="pt", padding=True, truncation=True,
                  max_length=int(max_length), add_special_tokens=not chat_template)
        with torch.inference_mode():
            logits = model(input_ids=enc["input_ids"].to(dev),
                           attention_mask=enc["attention_mask"].to(dev)).logits
        scores.extend(logits[:, int(label_index)].float().cpu().tolist())
    return scores


register("reward_model")(reward_model)  # by a call, not a decorator: mutmut mutates only undecorated functions


def _engine_serves(model) -> bool:
    from grpo.engine.patch import shared_prefix_unsupported

    return callable(getattr(model, "score", None)) and shared_prefix_unsupported(model, 0) is None


def _pooled_position(row: list[int], pad: int | None) -> int:
    """Where a sequence-classification model pools a row: its rightmost token that is not padding (HF's rule)."""
    if pad is None:
        return len(row) - 1
    return max((i for i, t in enumerate(row) if t != pad), default=0)


def _common_prefix(rows: list[list[int]]) -> int:
    n = min(map(len, rows))
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return n


def _shared_scores(model, rows: list[list[int]], prompts: list[str], batch_size: int, label: int) -> list[float]:
    """Per-row scores, each prompt's rows as one group with their common leading tokens encoded once; groups are
    packed into forwards of about ``batch_size`` rows."""
    import torch

    from grpo.engine.hidden_states import shared_prefix_hidden

    groups: dict[str, list[int]] = {}
    for n, p in enumerate(prompts):
        groups.setdefault(p, []).append(n)
    units = []  # (row indices, common prefix length) per group; rows without a common first token go alone
    for members in groups.values():
        k = _common_prefix([rows[n] for n in members])
        units.extend([(members, k)] if k else [([n], len(rows[n])) for n in members])
    pad, scores = model.config.pad_token_id, [0.0] * len(rows)
    start = 0
    while start < len(units):
        end, size = start + 1, len(units[start][0])
        while end < len(units) and size + len(units[end][0]) <= batch_size:
            size += len(units[end][0])
            end += 1
        part = units[start:end]
        prefixes, suffixes = [rows[m[0]][:k] for m, k in part], [[rows[n][k:] for n in m] for m, k in part]
        with torch.inference_mode():
            h = shared_prefix_hidden(model, prefixes, suffixes,
                                     [[_pooled_position(rows[n], pad) for n in m] for m, _ in part])
            logits = model.score(h)[:, label].float().cpu().tolist()
        for n, v in zip([n for m, _ in part for n in m], logits):
            scores[n] = v
        start = end
    return scores
