"""Rollout: sample G completions per prompt with the policy, batched, with a progress bar.

Completions end at the first EOS (kept: the model must learn to stop) or at ``max_new_tokens``
(marked truncated).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable

import torch
from tqdm.auto import tqdm

from grpo.engine.decode_attention import DECODE_ATTN_NAME, DECODE_KWARG, SharedPrefixKV
from grpo.engine.patch import check_every_layer, placeholder_mask, shared_decode_unsupported, switched_attention
from grpo.engine.state_layers import fork_states, has_recurrent_layers
from grpo.engine.unwrap import unwrap_model
from grpo.errors import GRPOWarning
from grpo.rollout.base import Sampling, cut_at_eos, eos_ids
from grpo.rollout.turn_cache import TurnCache, batched, layer_tensors, plain_layers


def generate(model, tokenizer, prompt_ids: list[list[int]], sampling: Sampling, *, group_size: int = 1,
             batch_size: int = 8, desc: str = "rollout", progress: bool = True, share_prompt: bool = True,
             min_new_tokens: int = 0, suffixes: list[list[list[int]]] | None = None, context: Callable | None = None,
             turns: TurnCache | None = None):
    """Returns ``(completion_ids, truncated)``: per prompt, ``group_size`` token lists and flags, sampled as
    ``sampling`` says (`grpo.rollout.base.Sampling`: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``;
    ``greedy``: one argmax completion per prompt).

    With ``share_prompt`` each prompt is prefilled once and its G samples decode against one copy of its K/V
    (families the prefix engine does not serve: the cache is forked G times); without it every sample
    prefills its own copy, as HF ``generate`` with ``num_return_sequences`` does. Sampling is exactly
    softmax(logits / T), the distribution the loss, old and reference log-probs use: no other logits processor
    runs, whatever the checkpoint's generation_config says. With ``top_k`` > 0 or ``top_p`` < 1 the sample comes
    from the truncated, renormalised distribution while the log-probs stay those of the full softmax, so the
    rollout is then not exactly on-policy (TRL does the same); a warning says so once per process.
    ``min_new_tokens`` forbids EOS before that many tokens (benchmarks use it for fixed-length completions; it
    biases sampling, so training leaves it at 0).

    ``suffixes`` (multi-turn episodes after their first turn): per prompt, the contexts to continue it with, one
    sample each, returned in their order (``group_size`` is then unused). With ``share_prompt`` each prompt is
    prefilled once, its K/V forked to its rows (copied, not held once as above), and each row prefills only its
    own suffix; without it (and for models with recurrent layers, whose state would run through the padding
    between a prompt and a shorter suffix) every prompt + suffix is prefilled whole.

    ``context``: the runtime's ``generation_context`` (`grpo.runtime.base.Runtime`), entered around the decode loop:
    a multi-process runtime may need every rank in every decoding step (DeepSpeed ZeRO-3: partitioned weights),
    and yields the options that take (``{"synced_gpus": any_rank}``).

    ``turns`` (multi-turn episodes): the K/V kept from the previous call (`grpo.rollout.turn_cache`): a later turn's
    context that continues a kept row prefills only its new tokens (the sampled turn's last token, the tool text);
    this call's rows are kept in turn. Not used with ``share_prompt=False`` or a synced runtime (ZeRO-3: every
    rank must run the same forwards)."""
    if suffixes is not None and (not share_prompt or has_recurrent_layers(unwrap_model(model, peft=False))):
        # a recurrent layer's state would run through the padding between a prompt and a shorter row's suffix
        ids, cut = generate(model, tokenizer, flatten(prompt_ids, suffixes), sampling, batch_size=batch_size,
                            desc=desc, progress=progress, min_new_tokens=min_new_tokens, context=context)
        return regroup([g[0] for g in ids], suffixes), regroup([g[0] for g in cut], suffixes)
    if not sampling.greedy:
        warn_truncated_sampling(sampling.top_p, sampling.top_k)
    # no_grad not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
    with torch.no_grad(), context() if context is not None else contextlib.nullcontext({}) as extra:
        return _generate(unwrap_model(model, peft=False), tokenizer, prompt_ids, sampling, group_size=group_size,
                         batch_size=batch_size, desc=desc, progress=progress, extra=extra, share_prompt=share_prompt,
                         min_new_tokens=min_new_tokens, suffixes=suffixes,
                         turns=None if extra.get("synced_gpus") else turns)


def flatten(prompt_ids: list[list[int]], suffixes: list[list[list[int]]]) -> list[list[int]]:
    """Every prompt + suffix as its own context, in order."""
    return [p + s for p, ss in zip(prompt_ids, suffixes) for s in ss]


def regroup(flat: list, suffixes: list[list]) -> list[list]:
    """One item per suffix, nested per prompt like ``suffixes``."""
    it = iter(flat)
    return [[next(it) for _ in ss] for ss in suffixes]


_warned_truncated = False


def warn_truncated_sampling(top_p: float, top_k: int) -> None:
    global _warned_truncated
    if (top_p < 1.0 or top_k > 0) and not _warned_truncated:
        _warned_truncated = True
        warnings.warn(f"rollout.top_p={top_p} / rollout.top_k={top_k}: completions are sampled from the truncated "
                      "distribution, but the loss, old and reference log-probs use the full softmax(logits / T), so "
                      "the rollout is not exactly on-policy (as in TRL); top_p=1 and top_k=0 sample on-policy",
                      GRPOWarning, stacklevel=3)


def _generate(model, tokenizer, prompt_ids, sampling: Sampling, *, group_size, batch_size, desc, progress, extra,
              share_prompt, min_new_tokens, suffixes, turns):
    device, greedy, max_new_tokens = next(model.parameters()).device, sampling.greedy, sampling.max_new_tokens
    synced = extra.get("synced_gpus")  # None, or the runtime's any_rank: decode until every rank is done
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    was_training = model.training
    model.eval()
    completions, truncated = [], []
    n_samples = 1 if greedy else group_size
    pick = greedy_pick if greedy else functools.partial(sample_tokens, temperature=sampling.temperature,
                                                          top_p=sampling.top_p, top_k=sampling.top_k)
    total = len(prompt_ids) * n_samples if suffixes is None else sum(map(len, suffixes))
    bar = tqdm(total=total, desc=desc, unit="seq", leave=False, disable=not progress)
    if turns is not None:
        turns.begin(first_turn=suffixes is None)
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        shared, counts = None, [n_samples] * len(chunk)
        tails = suffixes[start:start + batch_size] if suffixes is not None else [[[]] * n_samples] * len(chunk)
        contexts = [p + s for p, ss in zip(chunk, tails) for s in ss]  # each row's tokens (before decoding)
        kept = [turns.take(c) for c in contexts] if turns is not None and suffixes is not None else None
        if kept is not None and all(row is not None for row, _ in kept):  # each row prefills only its new tokens
            counts = [len(ss) for ss in tails]
            new = _decode_kept(model, kept, contexts, turns, counts, pick, max_new_tokens=max_new_tokens, eos=eos,
                               pad_id=pad_id, min_new_tokens=min_new_tokens, synced=synced)
            _collect(new.tolist(), counts, eos, max_new_tokens, completions, truncated)
            bar.update(sum(counts))
            continue
        input_ids, attention = _left_padded(chunk, pad_id, device)
        width = input_ids.shape[1]
        if not (share_prompt or greedy):  # the baseline: G copies of each prompt, each prefilled
            input_ids, attention = input_ids.repeat_interleave(n_samples, 0), attention.repeat_interleave(n_samples, 0)
        cache = prefill(model, input_ids, attention, synced=synced is not None)
        if suffixes is not None:  # each prompt's K/V forked to its rows; each row runs its last prompt token + suffix
            counts = [len(ss) for ss in tails]
            owner = torch.tensor([i for i, n in enumerate(counts) for _ in range(n)], device=device)
            cache = _forked(cache, owner)
            input_ids, own = _left_padded([[p[-1], *s] for p, ss in zip(chunk, tails) for s in ss], pad_id, device)
            attention = torch.cat([attention[owner, :-1], own], dim=1)
            cache = prefill(model, input_ids, attention, synced=synced is not None, cache=cache)
        elif share_prompt and not greedy and n_samples > 1:  # prefilled once; G rows decode from it
            if width > 1:
                shared, cache = _share_or_fork(model, cache, attention, n_samples, width + max_new_tokens)
            input_ids, attention = input_ids.repeat_interleave(n_samples, 0), attention.repeat_interleave(n_samples, 0)
        new = decode(model, input_ids[:, -1], attention, cache, pick, max_new_tokens=max_new_tokens, eos=eos,
                     pad_id=pad_id, min_new_tokens=min_new_tokens, synced=synced, shared=shared)
        if turns is not None:
            _keep(turns, cache, shared, attention, contexts, new, counts)
        _collect(new.tolist(), counts, eos, max_new_tokens, completions, truncated)
        bar.update(sum(counts))
    bar.close()
    if turns is not None:
        turns.end()
    if was_training:
        model.train()
    return completions, truncated


def _decode_kept(model, kept, contexts, turns: TurnCache, counts, pick, *, pad_id: int, **decoding) -> torch.Tensor:
    """Decode rows that continue kept ones: the kept K/V batched, each row's tokens after them prefilled."""
    device = next(model.parameters()).device
    cache, held = batched(model, kept, device)
    input_ids, own = _left_padded([c[n:] for c, (_, n) in zip(contexts, kept)], pad_id, device)
    attention = torch.cat([held, own], dim=1)
    cache = prefill(model, input_ids, attention, cache=cache)
    new = decode(model, input_ids[:, -1], attention, cache, pick, pad_id=pad_id, **decoding)
    _keep(turns, cache, None, attention, contexts, new, counts)
    return new


def _collect(new: list[list[int]], counts: list[int], eos, max_new_tokens, completions: list, truncated: list):
    cuts = iter([cut_at_eos(row, eos, max_new_tokens) for row in new])
    for n in counts:
        group = [next(cuts) for _ in range(n)]
        completions.append([ids for ids, _ in group])
        truncated.append([cut for _, cut in group])


def _keep(turns: TurnCache, cache, shared: SharedPrefixKV | None, attention, contexts, new: torch.Tensor, counts):
    """Keep the decoded rows' K/V for the next turn: every context token, then the sampled tokens decoding fed (all
    but the last). ``attention``: the rows' mask when decoding started; ``shared``: the prompts' K/V held once
    (the cache then holds each row's own tokens: its last prompt token, then the fed samples)."""
    if not plain_layers(cache):  # a sliding-window or quantised layer: its columns are not every position
        return
    fed = new.shape[1] - 1
    tokens = [c + row[:fed] for c, row in zip(contexts, new.tolist())]
    keys, values = layer_tensors(cache)
    ones = torch.ones(len(contexts), fed + (shared is not None), dtype=torch.bool, device=new.device)
    if shared is None:
        turns.keep(tokens, keys, values, torch.cat([attention.bool(), ones], dim=1))
        return
    owner = torch.tensor([i for i, n in enumerate(counts) for _ in range(n)], device=new.device)
    keys = [torch.cat([pk[owner], k], dim=2) for pk, k in zip(shared.keys, keys)]
    values = [torch.cat([pv[owner], v], dim=2) for pv, v in zip(shared.values, values)]
    turns.keep(tokens, keys, values, torch.cat([shared.valid[owner], ones], dim=1))


def _left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (len(rows), longest), each row right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, device=device)
        mask[i, width - len(r):] = 1
    return ids, mask


def prefill(model, input_ids, attention, synced: bool = False, cache=None):
    """Run every token of ``input_ids`` but the last through the model, after the tokens ``cache`` holds (if any;
    ``attention`` covers them, then ``input_ids``); returns the KV cache (empty for 1-token prompts and no cache).
    ``synced``: every process must run the same forwards (ZeRO-3), so 1-token prompts still run one, discarded."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if cache is None else cache
    n = input_ids.shape[1]
    if n > 1:
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, -n:]
        model(input_ids=input_ids[:, :-1], attention_mask=attention[:, :-1], position_ids=positions[:, :-1],
              use_cache=True, logits_to_keep=1, **{_cache_kwarg(model): cache})
    elif synced:
        model(input_ids=input_ids, attention_mask=attention, use_cache=False, logits_to_keep=1)
    return cache


def _cascade_ok(model, max_len: int) -> bool:
    """Whether decoding can attend to one shared copy of each prompt's K/V (the prefix engine's families)."""
    try:
        return shared_decode_unsupported(model, max_len) is None
    except NotImplementedError:  # e.g. prompt-learning PEFT: the fork path serves it
        return False


def _share_or_fork(model, cache, attention, group: int, max_len: int):
    """After one prefill per prompt: (the prompts' K/V held once, a cache of each row's own tokens holding a copy
    of its prompt's recurrent states) where the cascade serves the model, else (None, the prefilled cache with
    G copies of each prompt's K/V and states)."""
    rows = torch.arange(attention.shape[0], device=attention.device).repeat_interleave(group)  # each row's prompt
    if _cascade_ok(model, max_len):
        return _shared_prompt(cache, attention[:, :-1], group), fork_states(cache, type(cache)(config=model.config),
                                                                             rows)
    return None, _forked(cache, rows)


def _forked(cache, rows: torch.Tensor):
    """The prefilled cache, in place, with prompt ``rows[r]``'s K/V and recurrent states copied to row r."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers releases before the per-layer cache
        cache.batch_select_indices(rows)
        return cache
    for layer in layers:
        if hasattr(layer, "keys"):  # a recurrent layer holds no K/V
            layer.batch_select_indices(rows)
    return fork_states(cache, cache, rows)


def _shared_prompt(cache, valid, group: int) -> SharedPrefixKV:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # a recurrent layer holds no K/V (its state is forked instead: fork_states)
        keys, values = [getattr(layer, "keys", None) for layer in layers], [getattr(layer, "values", None)
                                                                          for layer in layers]
    else:  # transformers releases before the per-layer cache
        keys, values = list(cache.key_cache), list(cache.value_cache)
    valid = valid.bool()
    pad = ~valid[:, None, :, None]  # left padding: zero it, so that no stray non-finite value reaches a sum
    for t in keys + values:  # a sliding-window layer's cache may keep only the last slots
        if t is not None:
            t.masked_fill_(pad[:, :, pad.shape[2] - t.shape[2]:], 0.0)
    return SharedPrefixKV(keys=keys, values=values, valid=valid, group=group)


def decode(model, last, attention, cache, pick, *, max_new_tokens: int, eos: list[int], pad_id: int,
           min_new_tokens: int = 0, synced: Callable[[bool], bool] | None = None,
           shared: SharedPrefixKV | None = None) -> torch.Tensor:
    """Autoregressive decoding from a prefilled cache: ``last`` (rows,) is each row's last prompt token,
    ``attention`` (rows, width) its left-padded mask. ``pick(logits) -> tokens`` chooses each next token from
    the model's raw next-token logits. Rows stop at their first EOS (then padded); the loop ends when every
    row has stopped or after ``max_new_tokens``. ``synced``: the runtime's ``any_rank``; keep stepping until
    every process is done (DeepSpeed ZeRO-3 needs every rank in every forward). ``shared``: the prompts' K/V
    held once per prompt (cascade attention); ``cache`` then holds each row's own tokens only. Returns
    (rows, n) new tokens, n <= max_new_tokens."""
    rows, device = last.shape[0], last.device
    eos_t = torch.tensor(eos, device=device)
    position = attention.sum(-1, keepdim=True) - 1  # position of the last prompt token
    out = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    step_ids = last[:, None]
    inputs = {_cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    ctx = contextlib.nullcontext()
    if shared is not None:
        inputs.update({DECODE_KWARG: shared, "attention_mask": placeholder_mask(device)})
        ctx = switched_attention(model, DECODE_ATTN_NAME, state=shared)
    with ctx:
        for t in range(max_new_tokens):
            if shared is None:
                inputs["attention_mask"] = attention
            logits = model(input_ids=step_ids, position_ids=position, **inputs).logits[:, -1]
            if shared is not None and t == 0:
                check_every_layer(shared.calls, model, DECODE_ATTN_NAME)
            if t < min_new_tokens:
                logits = logits.index_fill(-1, eos_t, float("-inf"))
            token = pick(logits).masked_fill(done, pad_id)
            out[:, t] = token
            done |= torch.isin(token, eos_t)
            if _all_done(done, synced):
                return out[:, : t + 1]
            step_ids, position = token[:, None], position + 1
            if shared is None:
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
    return out


def _all_done(done: torch.Tensor, synced: Callable[[bool], bool] | None) -> bool:
    mine = bool(done.all())
    return mine if synced is None else not synced(not mine)


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def sample_tokens(logits: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), optionally restricted to the top-k tokens and then
    to the smallest set of most likely tokens whose mass reaches top_p (the order HF applies them in).

    Inverse-CDF sampling: one uniform number per row against the cumulative distribution (float64), instead of
    ``torch.multinomial``'s one exponential draw per vocabulary entry (a fifth of a short CPU step)."""
    z = logits.float() / temperature
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all() & (total > 0).all()):
        raise RuntimeError("the policy's next-token logits are not finite (NaN/inf) while sampling: the model has "
                           "diverged or its weights are broken; lower trainer.lr or resume an earlier checkpoint")
    u = torch.rand(total.shape, dtype=torch.float64, device=cdf.device, generator=generator) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # strictly below the total mass
    return torch.searchsorted(cdf, u, right=True)[:, 0]


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache argument ``cache``; older releases ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the wrapped model's name
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
